"""benchmarks/speculative.py runs on the CPU (tiny model) and writes every figure it promises."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_speculative_benchmark_smoke(tmp_path):
    out = tmp_path / "spec.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "speculative.py"), "--model", "tiny", "--batches", "1",
           "--prompt", "12", "--steps", "1", "--device", "cpu", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900, cwd=ROOT)
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    K = row["block_size"]
    assert sorted(row["verify_ms"]) == [str(k) for k in range(1, K + 1)]
    assert row["draft_ms"] > 0 and row["decode_ms_eager"] > 0
    for a in ("0.5", "0.7", "0.9"):
        assert all(v > 0 for v in row["expected_speedup"][a].values())
    f = row["forced"]
    assert f["tokens"] == f["rounds"] * (K + 1) and f["tokens_per_s"] > 0
    costs = result["costs"]["1"]
    assert costs["verify"][0] == 1.0 and len(costs["verify"]) == K + 1 and costs["draft"] > 0
