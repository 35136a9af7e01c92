"""tools/sass_pieces.py: the straight-line pieces of a SASS span: cut exactly at its branches and at their
targets, each instruction in one piece, against cut points worked out from a random span."""
from __future__ import annotations

import random
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import sass_pieces  # noqa: E402

OPS = ["IMAD", "LDS", "STS", "HMUL2", "PRMT", "LDGSTS", "BAR", "ISETP"]


def test_pieces_cut_at_branches_and_their_targets():
    rng = random.Random()
    n = rng.randint(1, 200)
    addrs = [0x100 + 16 * i for i in range(n)]
    code, targets, after_branch = [], set(), set()
    for i, a in enumerate(addrs):
        if rng.random() < 0.1:
            t = rng.choice(addrs)
            code.append((a, "BRA", f" {t:#x}"))
            targets.add(t)
            if i + 1 < n:
                after_branch.add(addrs[i + 1])
        else:
            code.append((a, rng.choice(OPS), " R1, R2"))
    pieces = sass_pieces.pieces_of(code)
    want = sorted({addrs[0]} | targets | after_branch)
    assert [int(p["at"], 16) for p in pieces] == want
    assert sum(p["instructions"] for p in pieces) == n
    for p, nxt in zip(pieces, [*want[1:], addrs[-1] + 16]):
        assert p["instructions"] == (nxt - int(p["at"], 16)) // 16
        assert sum(p["opcodes"].values()) <= p["instructions"]
