"""Programmatic dependent launch (``kernels_cuda/pdl.py``, ``tiles.pdl.enabled``).

The rule that makes PDL safe: every kernel waits for the previous one (``wait_inputs()``) before
anything else, so a launch carrying the attribute never reads or overwrites memory the kernel
before it is still using. Checked three ways: every kernel the launchers launch calls it first
(source); every launch of every family's warm-up cases carries ``launch_pdl`` on sm_90 under a
profile enabling it and none on sm_80 or with it off (launches recorded without a GPU); the sm_90
binary waits before its first global load and the sm_80 one has no grid-dependency instruction
(cross-compiled PTX). On an sm_90 GPU, a captured decode step with PDL on matches it with PDL off.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernel_check import GPU, requires_kernels

pytestmark = requires_kernels
triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels_cuda"


def _launched_kernels() -> set[str]:
    """Names of the kernels the launchers launch (``name[grid](...)`` and ``module.name[grid](...)``
    calls)."""
    names = set()
    for path in KERNELS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                if isinstance(node.func.value, ast.Name):
                    names.add(node.func.value.id)
                elif isinstance(node.func.value, ast.Attribute):
                    names.add(node.func.value.attr)
    return names


def test_every_launched_kernel_waits_first():
    launched = _launched_kernels()
    assert len(launched) >= 30, sorted(launched)
    found = {}
    for path in KERNELS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in launched:
                body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(
                    node.body[0].value, ast.Constant) else node.body
                first = ast.unparse(body[0]) if body else ""
                found[node.name] = first
    assert set(found) == launched, sorted(launched - set(found))
    late = {name: first for name, first in found.items() if first != "wait_inputs()"}
    assert not late, f"kernels whose first statement is not wait_inputs(): {late}"


_RECORD = textwrap.dedent("""
    import json, sys
    import yaml
    from flashrt import profiles
    from flashrt.jit_compile import collect, compile_kernel, launch_sources
    from flashrt.jit_targets import ARCHS
    from flashrt.kernels_cuda.warmup import MODELS

    out = {}
    for arch_name, base in (("sm_90", "h200"), ("sm_80", "a100")):
        for enabled in (True, False):
            data = yaml.safe_load(open(profiles.load_profile(base).source))
            data.setdefault("tiles", {})["pdl"] = {"enabled": enabled}
            profile = profiles.profile_from_mapping(data, f"<{base} pdl {enabled}>")
            variants, failures = {}, []
            launches = collect(ARCHS[arch_name], profile, {"tiny": MODELS["tiny"]}, launch_sources(), variants,
                               failures)
            out[f"{arch_name} {enabled}"] = {
                "launches": launches, "failures": failures,
                "kernels": sorted({v.kernel for v in variants.values()}),
                "pdl": sorted({(v.kernel, bool(getattr(v.options, "launch_pdl", False))) for v in variants.values()})}
    from flashrt.kernels_cuda.norm_rope import _rms_norm_kernel
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "n_rows": "i32", "N": "i32",
           "x_row_stride": "i32", "eps": "fp32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "SINGLE": "constexpr"}
    consts = {("BLOCK_M",): 1, ("BLOCK_N",): 1024, ("SINGLE",): True}
    consts = {(list(sig).index(k[0]),): v for k, v in consts.items()}
    for cc in (90, 80):
        kernel, error = compile_kernel(_rms_norm_kernel, sig, consts, {}, {"launch_pdl": cc == 90}, cc)
        assert error is None, error
        ptx = [l.strip() for l in kernel.asm["ptx"].splitlines()]
        first = lambda word: next((i for i, l in enumerate(ptx) if word in l.split(";")[0]), None)
        out[f"ptx {cc}"] = {"wait": first("griddepcontrol.wait"), "trigger": first("griddepcontrol.launch_dependents"),
                            "load": first("ld.global"), "launch_pdl": bool(kernel.metadata.launch_pdl)}
    json.dump(out, sys.stdout)
""")


@pytest.fixture(scope="module")
def recorded():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _RECORD], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


def _ptxas_missing() -> bool:
    return not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(_ptxas_missing(), reason="Triton without its bundled ptxas (no NVIDIA backend)")
def test_launches_carry_the_attribute_only_on_sm90_with_the_profile_on(recorded):
    on = recorded["sm_90 True"]
    assert not on["failures"] and on["launches"] > 20
    assert len(on["kernels"]) >= 20, on["kernels"]
    assert all(pdl for _, pdl in on["pdl"]), [k for k, pdl in on["pdl"] if not pdl]
    for case in ("sm_90 False", "sm_80 True", "sm_80 False"):
        assert not recorded[case]["failures"]
        assert not any(pdl for _, pdl in recorded[case]["pdl"]), (case, recorded[case]["pdl"])
    assert recorded["sm_90 False"]["kernels"] == on["kernels"]  # the same kernels, launched plainly


@pytest.mark.skipif(_ptxas_missing(), reason="Triton without its bundled ptxas (no NVIDIA backend)")
def test_sm90_waits_before_its_first_load_and_sm80_has_no_grid_dependency(recorded):
    sm90, sm80 = recorded["ptx 90"], recorded["ptx 80"]
    assert sm90["launch_pdl"] and sm90["wait"] is not None and sm90["load"] is not None
    assert sm90["wait"] < sm90["load"] and sm90["trigger"] is None, sm90  # dependents launch at exit
    assert sm80["wait"] is None and sm80["trigger"] is None and sm80["load"] is not None
    assert not sm80["launch_pdl"]


def _profile(base: str, enabled: bool):
    import yaml
    from flashrt import profiles

    data = yaml.safe_load(Path(profiles.load_profile(base).source).read_text())
    data.setdefault("tiles", {})["pdl"] = {"enabled": enabled}
    return profiles.profile_from_mapping(data, f"<{base}, tiles.pdl.enabled {enabled}>")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm_90+ GPU")
def test_captured_decode_steps_match_with_pdl():
    """Logits of 24 captured decode steps of ``tiny`` (2 rows, pages of 4 entries filling as it goes)
    with every launch carrying the attribute are bit-identical to those of the same steps without it:
    a kernel racing its predecessor would read stale data somewhere along the way."""
    from flashrt import profiles
    from flashrt.engine.step_capture import StepCapture
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model
    from flashrt.kv.state import KVState

    cfg = shipped_config("tiny")
    seed = int.from_bytes(os.urandom(4), "little")
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(seed)).cuda()
    logits = {}
    for enabled in (False, True):
        with profiles.using(_profile("h200", enabled)):
            model = Model(cfg, init_weights(cfg, seed=3, device="cuda"))
            pool = KVState.pool_for(cfg, 2, 200, model.device, None, 4)
            state = model.new_state(2, 200, pool=pool)
            out = [model.forward(ids, state=state)]
            runner = StepCapture(model, state)
            for _ in range(24):
                out.append(runner.step(out[-1].argmax(-1)).clone())
            assert runner.stats["replayed"] > 10, runner.stats
            logits[enabled] = torch.stack(out)
    assert torch.equal(logits[True], logits[False]), f"seed {seed}"
