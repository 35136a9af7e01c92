"""tools/ncu_source.py: the per-opcode sums and the groups by run count of Nsight Compute's source
page against the sums taken while writing a random page, one table a kernel, and its stall reasons and
shared wavefronts by opcode; its errors for a missing file, a CSV with no source table and two exclusive
views."""
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


def _page(rng: random.Random, kernels: int, counts: list | None = None):
    """(CSV rows, the expected {opcode: [executed, samples]} a kernel); ``counts`` gets, a kernel,
    the expected {times run: [rows, samples]} (each instruction runs one of a few counts, as every
    warp of a launch or only those of one program do)."""
    rows, want = [["Kernel Name", "Context"]], []
    for _ in range(kernels):
        rows.append(["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "Extra"])
        sums, by_count = defaultdict(lambda: [0.0, 0.0]), defaultdict(lambda: [0, 0.0])
        runs = [rng.randint(0, 5_000_000) for _ in range(rng.randint(1, 4))]
        for i in range(rng.randint(1, 60)):
            op = rng.choice(OPS)
            pred = rng.choice(["", "@P0 ", "@!PT "])
            executed, samples = rng.choice(runs), rng.randint(0, 3000)
            rows.append([hex(16 * i), f"{pred}{op}{rng.choice(MODS)} R{i}, R{i + 1} ;", f"{samples:,}",
                         f"{executed:,}", "x"])
            sums[op][0] += executed
            sums[op][1] += samples
            by_count[executed][0] += 1
            by_count[executed][1] += samples
        want.append(sums)
        if counts is not None:
            counts.append(by_count)
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


def test_groups_by_run_count_match_the_page(tmp_path):
    rng, counts = random.Random(), []
    rows, _ = _page(rng, rng.randint(1, 3), counts)
    for table, want in zip(ncu_source.tables(rows), counts):
        assert {int(k): [v["rows"], v["samples"]] for k, v in table["by_count"].items()} == dict(want)
        assert sum(v["executed"] for v in table["by_count"].values()) == table["executed"]
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "ncu_source.py"), str(path), "--by-count"],
                         capture_output=True, text=True, check=True).stdout
    assert out.count("== kernel") == len(counts) and out.count("runs each") == len(counts)


def test_reasons_and_wavefronts_match_the_page(tmp_path):
    """The stall_* columns (not their "Not Issued" twins) summed by reason and opcode, and the shared
    wavefronts by opcode, against the sums taken while writing the page."""
    rng = random.Random()
    reasons = ["stall_barrier", "stall_long_sb", "stall_mio", "stall_wait"]
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "L1 Wavefronts Shared", *reasons, *(f"{r} (Not Issued)" for r in reasons)]
    rows, by_reason, waves = [["Kernel Name", "k"], header], defaultdict(lambda: defaultdict(float)), defaultdict(float)
    by_runs, runs = defaultdict(lambda: defaultdict(float)), [rng.randint(1, 10 ** 5) for _ in range(3)]
    for i in range(rng.randint(1, 80)):
        op, executed = rng.choice(OPS), rng.choice(runs)
        split = [rng.randint(0, 500) for _ in reasons]
        wave = rng.choice([0, rng.randint(1, 10 ** 6)])
        rows.append([hex(16 * i), f"{op}{rng.choice(MODS)} R1 ;", f"{sum(split):,}", f"{executed:,}", f"{wave:,}",
                     *(f"{n:,}" for n in split), *(str(rng.randint(0, 9)) for _ in reasons)])
        for r, n in zip(reasons, split):
            by_reason[op][r] += n
            by_runs[f"{executed}"][r] += n
        waves[op] += wave
    (table,) = ncu_source.tables(rows)
    assert table["by_reason"] == {op: dict(v) for op, v in by_reason.items()}
    assert table["reasons_by_count"] == {k: dict(v) for k, v in by_runs.items()}
    assert table["wavefronts"] == dict(waves)
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "ncu_source.py"), str(path), "--reasons"],
                         capture_output=True, text=True, check=True).stdout
    worst = max(by_reason, key=lambda op: sum(by_reason[op].values()))
    assert f"{sum(waves.values()):,.0f} shared wavefronts" in out
    if sum(by_reason[worst].values()) > 0:
        assert out.splitlines()[3].startswith(worst)
        assert "by run count" in out


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
    both = subprocess.run([sys.executable, tool, str(tmp_path / "empty.csv"), "--lines", "--by-count"],
                          capture_output=True, text=True)
    assert both.returncode == 2 and "expected at most one of them" in both.stderr
