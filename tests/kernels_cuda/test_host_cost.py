"""tools/host_cost.py: host time per forward on the CUDA launchers with no kernel run.

Run in a subprocess without ``TRITON_INTERPRET`` (the launches must reach Triton's compile path,
as in test_decode_variants.py): the warm-launch stand-in (one record per variant, later launches
served from Triton's cache, nothing left in the cache afterwards), the profile grouping, and the
tool over the tiny model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

from test_arch_compile import ROOT, needs_ptxas  # noqa: E402

WARM_SCRIPT = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, os.path.join(sys.argv[1], "tools"))
    import host_cost as hc
    import torch
    from flashrt import profiles
    from flashrt.jit_targets import ARCHS
    from flashrt.kernels_cuda import norm_rope
    from triton.runtime.jit import JITFunction

    compiles, real = [], JITFunction._do_compile
    out = {}
    with profiles.using("h200"), hc.cuda_on_cpu(), hc.empty_as_zeros(), hc.warm_launches(ARCHS["sm_90"]):
        inner = JITFunction._do_compile
        def counting(self, *a, **k):
            compiles.append(self.fn.__name__)
            return inner(self, *a, **k)
        JITFunction._do_compile = counting
        x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
        wide, wide_w = torch.randn(3, 4096, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16)
        with hc.Launches() as n:
            for _ in range(3):
                y = norm_rope.rms_norm(x, w, 1e-6)       # one variant, three launches
            norm_rope.rms_norm(wide, wide_w, 1e-6)      # another variant
            z = x.float() + 1                            # two torch ops that launch on a GPU
        out["compiles"], out["triton"], out["torch_ops"] = compiles, n.triton, dict(n.torch_ops)
        out["zeros"] = bool((y == 0).all())              # outputs never written: the zero fill
        JITFunction._do_compile = inner
    out["left"] = sum(len(c[0]) for c in norm_rope._rms_norm_kernel.device_caches.values())
    out["restored"] = JITFunction._do_compile is real
    tool = os.path.join(sys.argv[1], "tools", "host_cost.py")
    out["groups"] = [hc.group(*f) for f in (
        (os.path.join(sys.argv[1], "core", "checks.py"), "shape"),
        (os.path.join(sys.argv[1], "core", "ops_moe.py"), "moe_experts"),
        (os.path.join(sys.argv[1], "kernels_cuda", "linear.py"), "linear"),
        (os.path.join(sys.argv[1], "graphs", "block.py"), "forward"),
        (os.path.join(sys.argv[1], "core", "kv", "state.py"), "ring_slots"),
        ("/x/site-packages/triton/runtime/jit.py", "run"),
        (tool, "launch_metadata"),
        ("~", "<built-in method torch.empty>"),
        ("~", "<built-in method builtins.len>"),
        ("/x/lib/python3.11/functools.py", "wrapper"))]
    print(json.dumps(out))
''')


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@needs_ptxas
def test_warm_launches_record_each_variant_once_and_leave_no_stand_in(tmp_path):
    script = tmp_path / "warm.py"
    script.write_text(WARM_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True, env=_env(),
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["compiles"] == ["_rms_norm_kernel", "_rms_norm_kernel"], out  # two variants: the wider row
    assert out["triton"] == 4 and out["torch_ops"] == {"_to_copy": 1, "add": 1}, out
    assert out["zeros"] and out["left"] == 0 and out["restored"], out
    assert out["groups"] == ["flashrt ops/dispatch/checks", "flashrt ops/dispatch/checks", "launcher plans",
                             "model glue", "model glue", "triton launch path", "triton launch path", "torch ops",
                             "other", "other"], out


@needs_ptxas
def test_tool_over_the_tiny_model(tmp_path):
    out = tmp_path / "cost.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "host_cost.py"), "--model", "tiny", "--prefill", "1x16",
                        "2x8", "--decode", "2", "--decode-prompt", "8", "--repeats", "2", "--profile-top", "5",
                        "--json", str(out)], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert [c["case"] for c in cases] == ["prefill [1, 16]", "prefill [2, 8]", "decode batch 2"]
    for c in cases:
        assert c["triton_launches"] > 20 and c["torch_ops"] == sum(c["torch_ops_by_name"].values()), c["case"]
        assert c["host_us"] >= c["host_less_torch_us"] > 0, c["case"]
        assert set(c["profile_groups_us"]) == {"triton launch path", "flashrt ops/dispatch/checks", "launcher plans",
                                               "model glue", "torch ops", "other"}
        assert len(c["top_own"]) == len(c["top_cum"]) == 5
    assert "host us per forward" in r.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "host_cost.py"), "--prefill", "4by512"],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert bad.returncode == 2 and "expected ROWSxTOKENS" in bad.stderr
