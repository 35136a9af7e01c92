"""After the engine's warm-up (engine/warmup.py), a serving workload meets no new kernel variant:
each would be a compile in the middle of serving (seconds on a GPU, with every running request
stalled). ``tools/serve_variants.py`` records every launch for sm_90 under the h200 profile's tiles
(nothing is compiled or run) through random workloads after the warm-up, in a subprocess without
``TRITON_INTERPRET`` as test_decode_variants.py does."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from test_arch_compile import ROOT, needs_ptxas  # noqa: E402


@needs_ptxas
def test_no_variant_after_the_warm_up_for_whole_chunk_prompts():
    """A step's budget of 4 chunks and 16 running: decode batch sizes past the prefill groups'."""
    seed = random.Random().randrange(1 << 20)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "serve_variants.py"), "--model", "tiny", "--max-running", "16",
                        "--chunk", "64", "--max-step-tokens", "256", "--passes", "3", "--seed", str(seed)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "variants in the warm-up" in r.stdout and "pass 3:" in r.stdout, r.stdout[-3000:]
    assert "new after the warm-up: none" in r.stdout, f"seed={seed}\n{r.stdout[-3000:]}"
