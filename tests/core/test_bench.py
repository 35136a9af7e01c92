"""``flashrt bench kernels``: the suite ships in the package, refuses clearly without CUDA, names bad
arguments, and computes rates and ratios from the graph-replay times (plain times as the fallback)."""
import importlib
import os
import subprocess
import sys

import pytest
import torch

from flashrt.cli import commands as cli
from flashrt.bench import FAMILIES, run_suite
from flashrt.bench.common import Ceilings, Timing, bench_ms, row

CEIL = Ceilings(copy_bytes_per_s=4e12, bf16_flops=800e12, fp8_flops=1600e12)


def test_every_family_imports_from_the_package():
    for fam in FAMILIES:
        assert callable(importlib.import_module(f"flashrt.bench.{fam}").run), fam


def test_without_cuda_the_cli_refuses_clearly(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "kernels", "--families", "gemm"]) == 2
    err = capsys.readouterr().err
    assert "flashrt bench: error: kernels: needs a CUDA device" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="needs a CUDA device"):
        run_suite(["gemm"])


def test_argument_errors_name_the_argument(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "kernels", "--families", "gemm", "nope"])
    assert exc.value.code == 2 and "argument --families: invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"families: expected names from .*got \['nope'\]"):
        run_suite(["nope"])
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "h200_kernels.py")
    r = subprocess.run([sys.executable, script, "--families", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "--families" in r.stderr


def test_rates_and_ratios_come_from_the_graph_times():
    ours, base = Timing(plain=0.02, graph=0.01, calls=50), Timing(plain=0.04, graph=0.03, calls=20)
    r = row("k", "s", ours, flops=0.0, nbytes=20e6, ceil=CEIL, baseline="b", baseline_ms=base)
    assert r["timing"] == "graph" and r["ms"] == 0.01 and r["plain_ms"] == 0.02
    assert r["roofline_fraction"] == pytest.approx((20e6 / 4e12 * 1e3) / 0.01)  # 0.005 ms floor / 0.01 ms
    assert r["gb_per_s"] == pytest.approx(20e6 / 1e-5 / 1e9) and r["bound"] == "memory"
    assert r["speedup_vs_baseline"] == pytest.approx(3.0) and r["speedup_vs_baseline_plain"] == pytest.approx(2.0)


def test_a_call_that_was_not_captured_keeps_its_plain_time_and_says_why():
    ours = Timing(plain=0.02, note="not captured: RuntimeError: host sync")
    r = row("k", "s", ours, flops=2e12, nbytes=1.0, ceil=CEIL, fp8_math=True, extra_ms=Timing(0.5, 0.25))
    assert r["timing"] == "plain" and r["ms"] == 0.02 and "host sync" in r["graph_note"]
    assert r["bound"] == "compute" and r["floor_ms"] == pytest.approx(2e12 / 1600e12 * 1e3)
    assert r["extra_ms"] == 0.25 and r["extra_ms_plain"] == 0.5
    total = sum([Timing(1.0, 0.5, 10), Timing(2.0, None, 0, "x")])  # chunks: graph only when all were captured
    assert total.plain == 3.0 and total.graph is None and total.ms == 3.0


@pytest.mark.gpu
def test_graph_replay_timing_on_the_device():
    x = torch.randn(1 << 20, device="cuda")
    t = bench_ms(lambda: x * 2)
    assert t.graph is not None and 0 < t.graph and t.calls >= 1 and t.note is None
    synced = bench_ms(lambda: (x * 2).sum().item())  # a host sync cannot be captured
    assert synced.graph is None and synced.note.startswith("not captured") and synced.plain > 0
    assert bench_ms(lambda: x * 3).graph is not None  # nothing left mid-capture: captures and RNG still work
    assert torch.randn(4, device="cuda").isfinite().all()
    assert torch.cuda.is_available() and float((x * 2).sum()) == pytest.approx(float(x.sum()) * 2, rel=1e-4)


def test_the_cli_writes_the_report_after_every_family(monkeypatch, tmp_path, capsys):
    """A run killed in a later family keeps the families it finished (written atomically each time)."""
    import json

    from flashrt import bench
    from flashrt.bench import common, elementwise, gemm

    out = tmp_path / "report.json"
    seen = []
    monkeypatch.setattr(bench, "cuda_missing", lambda: None)
    monkeypatch.setattr(common.Ceilings, "measure", staticmethod(lambda: CEIL))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def first(ceil):
        return [{"kernel": "k1", "shape": "s", "bound": "error", "error": "x"}]

    def second(ceil):  # the report on disk already holds the first family when the second starts
        seen.append(json.loads(out.read_text()))
        raise KeyboardInterrupt  # killed mid-run

    monkeypatch.setattr(elementwise, "run", first)
    monkeypatch.setattr(gemm, "run", second)
    assert cli.main(["bench", "kernels", "--families", "elementwise", "gemm", "--out", str(out)]) == 130  # Ctrl-C
    assert [r["kernel"] for r in seen[0]["rows"]] == ["k1"] and seen[0]["rows"][0]["family"] == "elementwise"
    assert json.loads(out.read_text()) == seen[0]  # the kill left the last whole report
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left behind
