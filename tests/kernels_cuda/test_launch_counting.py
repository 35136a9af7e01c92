"""The ``launches`` fixture (tests/kernel_check.py) sees compiled launches, not only interpreted
ones: a subprocess without ``TRITON_INTERPRET`` runs ``moe_experts`` for sm_90 through Triton's
launch path up to the compile (``flashrt.jit_compile.recording``, as ``flashrt jit compile``
does), the way a GPU run launches, and reports what the fixture's recorder saw."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernel_check import requires_kernels

pytestmark = requires_kernels
triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from _pytest.monkeypatch import MonkeyPatch
    from flashrt import formats, profiles
    from flashrt.jit_compile import recording
    from flashrt.jit_targets import parse_arch
    from flashrt.kernels_cuda import moe
    from kernel_check import record_launches

    names = record_launches(MonkeyPatch())
    w = [formats.quantize(torch.randn(*s) * 0.25, "fp8_w") for s in ((1, 64, 96), (1, 64, 96), (1, 96, 64))]
    route = (torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.int32))
    profile = dataclasses.replace(profiles.load_profile("h200"), tiles={"moe": {"direct": True, "fused_max_tokens": 64}})
    with profiles.using(profile), recording(parse_arch("sm_90"), lambda *a: None):
        moe.moe_experts(torch.randn(5, 96).to(torch.bfloat16), *route, *w, 10.0)
    print(json.dumps(names))
""")


def test_compiled_launches_are_counted(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "tests")], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["_moe_up_kernel", "_moe_down_kernel"]
