"""benchmarks/wgmma_rate.py on a machine without an sm_90 GPU: an unknown case is refused naming it and
the known ones; a valid run says what it needs instead of a traceback; every case's tile fits a
warpgroup MMA (N a multiple of 8 a warpgroup, K of 16) and its trip count keeps the run near a
millisecond at the MMA's rate."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "wgmma_rate.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import wgmma_rate  # noqa: E402


def test_unknown_case_is_refused():
    run = subprocess.run([sys.executable, str(SCRIPT), "--cases", "no such case"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--cases" in run.stderr and "no such case" in run.stderr
    assert all(name in run.stderr for name in wgmma_rate.CASES)


@pytest.mark.skipif(wgmma_rate.torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_it_says_what_it_needs():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "sm_90" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("name", sorted(wgmma_rate.CASES))
def test_cases_are_warpgroup_mma_tiles(name):
    wgm, wgn, n, k, *_ = wgmma_rate.CASES[name]
    assert wgm >= 1 and wgn >= 1 and (n // wgn) % 8 == 0 and k % 16 == 0
    m = 64 * wgm
    iters = wgmma_rate.iters_for(m, n, k)
    assert iters >= 64 and m * n * k * iters <= 2e9 + m * n * k * 64
