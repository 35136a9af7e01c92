"""tools/ncu_source.py: the per-opcode sums of Nsight Compute's source page against the sums
taken while writing a random page, one table a kernel; its errors for a missing file and a CSV
with no source table."""
from __future__ import annotations

import csv
import gzip
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import ncu_source  # noqa: E402

OPS = ["LDG", "STS", "LDS", "HMMA", "PRMT", "FMUL", "IMAD", "BAR", "F2FP", "ISETP"]
MODS = ["", ".E", ".E.U8", ".128", ".SYNC", ".16816.F32.BF16"]


def _page(rng: random.Random, kernels: int):
    """(CSV rows, the expected {opcode: [executed, samples]} a kernel)."""
    rows, want = [["Kernel Name", "Context"]], []
    for _ in range(kernels):
        rows.append(["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "Extra"])
        sums = defaultdict(lambda: [0.0, 0.0])
        for i in range(rng.randint(1, 60)):
            op = rng.choice(OPS)
            pred = rng.choice(["", "@P0 ", "@!PT "])
            executed, samples = rng.randint(0, 5_000_000), rng.randint(0, 3000)
            rows.append([hex(16 * i), f"{pred}{op}{rng.choice(MODS)} R{i}, R{i + 1} ;", f"{samples:,}",
                         f"{executed:,}", "x"])
            sums[op][0] += executed
            sums[op][1] += samples
        want.append(sums)
    return rows, want


def test_sums_by_opcode_match_the_page(tmp_path):
    rng = random.Random()
    rows, want = _page(rng, rng.randint(1, 3))
    got = ncu_source.tables(rows)
    assert len(got) == len(want)
    for table, sums in zip(got, want):
        assert {k: [v["executed"], v["samples"]] for k, v in table["by_opcode"].items()} == dict(sums)
        assert table["executed"] == sum(v[0] for v in sums.values())
        assert sum(v["executed"] for v in table["by_instruction"].values()) == table["executed"]
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "ncu_source.py"), str(path), "--top", "3",
                          "--json", str(tmp_path / "s.json")], capture_output=True, text=True, check=True).stdout
    assert out.count("== kernel") == len(want)
    assert (tmp_path / "s.json").exists()
    zipped = tmp_path / "source.csv.gz"
    zipped.write_bytes(gzip.compress(path.read_bytes()))
    again = subprocess.run([sys.executable, str(ROOT / "tools" / "ncu_source.py"), str(zipped), "--top", "3"],
                           capture_output=True, text=True, check=True).stdout
    assert again == out


def test_clear_errors(tmp_path):
    tool = str(ROOT / "tools" / "ncu_source.py")
    missing = subprocess.run([sys.executable, tool, str(tmp_path / "none.csv")], capture_output=True, text=True)
    assert missing.returncode != 0 and "cannot read" in missing.stderr and "none.csv" in missing.stderr
    (tmp_path / "empty.csv").write_text("a,b\n1,2\n")
    empty = subprocess.run([sys.executable, tool, str(tmp_path / "empty.csv")], capture_output=True, text=True)
    assert empty.returncode != 0 and "no source table" in empty.stderr
    bad = subprocess.run([sys.executable, tool, str(tmp_path / "empty.csv"), "--top", "0"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "--top" in bad.stderr and "got 0" in bad.stderr
