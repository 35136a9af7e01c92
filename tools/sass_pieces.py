"""Straight-line pieces of a span of SASS (no imports with side effects, so tests can load it; the
compile tool, tools/sm90_compile.py, reports a loop's pieces with it)."""
from __future__ import annotations

import collections
import re


def pieces_of(body: list[tuple]) -> list[dict]:
    """A span of SASS cut at its branches and at their targets: each straight-line piece's first address,
    instruction count and its 4 most frequent opcodes (the instructions a path through the span runs are
    the sums of the pieces it takes)."""
    targets = {int(m.group(1), 16) for _, op, rest in body if op == "BRA" for m in [re.search(r"0x([0-9a-f]+)", rest)]
               if m}
    out, cur = [], []
    for addr, op, rest in body:
        if addr in targets and cur:
            out.append(cur)
            cur = []
        cur.append(op)
        if op in ("BRA", "EXIT"):
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    starts, at = [], 0
    for piece in out:
        starts.append(body[at][0])
        at += len(piece)
    return [{"at": hex(a), "instructions": len(p), "opcodes": dict(collections.Counter(p).most_common(4))}
            for a, p in zip(starts, out)]
