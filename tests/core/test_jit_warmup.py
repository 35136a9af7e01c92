"""The kernel families' warm-up hooks: declared, reached through dispatch, a no-op without CUDA, and
their launches valid.

No GPU here: the launches are recorded instead of compiled (the ``_launch`` call monkeypatched), and
with the tiny model's dims they are run through the Triton interpreter, so every argument list a
hook builds is one its launcher accepts.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flashrt import formats, profiles
from flashrt.jit_warmup import warmup, warmup_targets
from flashrt.graphs.config import shipped_config
from flashrt.kernels_cuda import FAMILIES, linear_plain
from flashrt.kernels_cuda import warmup as _warmup

HOOKED = ("attention", "compress", "dense_attention", "engram", "indexer", "kv_gather", "kv_store", "linear",
          "linear_plain", "mhc", "moe", "moe_route", "norm_rope", "norm_rope_quant", "prefix_attention", "quant", "sample",
          "topk")


def _families() -> dict:
    return {fam.name: fam for fam in FAMILIES}


VISION = ("vision_dim", "vision_n_heads", "vision_max_n_token")


def _dims(name: str) -> dict:
    cfg = shipped_config(name)
    keys = list(_warmup.MODELS["tiny"]) + (list(VISION) if cfg.vision_n_layers else [])
    return {key: getattr(cfg, key) for key in keys}


def test_the_dims_are_the_shipped_configs():
    assert {"tiny", "tiny-vl", "small", "v4.1-flash"} <= set(_warmup.MODELS)
    for name, dims in _warmup.MODELS.items():
        want = _dims(name)
        want["compress_ratios"] = tuple(sorted(set(want["compress_ratios"])))
        assert {**dims, "compress_ratios": tuple(sorted(set(dims["compress_ratios"])))} == want, name


def test_hooks_are_declared_and_reached_through_dispatch():
    fams = _families()
    for name in HOOKED:
        assert callable(fams[name].warmup) and callable(fams[name].warmup_cases), name
    assert [name for name, _ in warmup_targets()] == [fam.name for fam in FAMILIES]  # every family, listed once
    assert {name for name, hook in warmup_targets() if hook is not None} == set(HOOKED)


def test_without_cuda_every_hook_says_so_and_the_report_lists_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fams = _families()
    for name in HOOKED:
        assert "no CUDA device" in fams[name].warmup(profiles.load_profile("h200"))["skipped"]
    report = warmup("h200", [(n, fams[n].warmup) for n in HOOKED], progress=lambda done, total: None)
    assert report["warmed"] == [] and report["failed"] == {} and report["skipped"] == list(HOOKED)
    assert all("no CUDA device" in report["notes"][n] for n in HOOKED)


@pytest.fixture
def recorded(monkeypatch):
    """Hooks run as on a GPU, but on CPU tensors, recording each launch instead of compiling it."""
    calls = []
    monkeypatch.setattr(_warmup, "cuda_missing", lambda: None)
    monkeypatch.setattr(_warmup, "_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(_warmup, "_launch", calls.append)
    return calls


def test_every_launcher_of_a_module_is_warmed_for_both_models(recorded):
    fams = _families()
    for name in HOOKED:
        recorded.clear()
        with profiles.using("h200"):
            result = fams[name].warmup(profiles.active_profile())
        assert result["launches"] == len(recorded) > 0, name
        launched = {launch.fn for launch in recorded}
        # linear_plain serves linear.py's op through its launcher
        served = {linear_plain.plain_linear} if name == "linear_plain" else set(fams[name].ops.values())
        assert served <= launched, (name, sorted(f.__name__ for f in launched))
        widths = {a.shape[-1] for launch in recorded for a in launch.args if isinstance(a, torch.Tensor)}
        if name in ("norm_rope", "mhc", "engram", "moe"):  # launched at both models' model width
            assert {1024, 5120} <= widths, (name, widths)
        floats = {a.dtype for launch in recorded for a in launch.args
                  if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.is_floating_point()}
        assert torch.bfloat16 in floats or name in ("compress", "topk", "kv_gather", "kv_store"), (name, floats)  # h200: bf16


def test_moe_covers_every_tile_rule_of_the_profile(recorded):
    from flashrt.kernels_cuda import moe

    with profiles.using("h200"):
        rules = profiles.tiles("moe", moe.TILES)["experts"]
        moe.FAMILY.warmup(profiles.active_profile())
    picked = set()
    for launch in recorded:
        if launch.fn is moe.moe_experts:
            x, _, idx, w1 = launch.args[:4]
            picked.add(id(moe.pick_tile(rules, x.shape[0] * idx.shape[1] / w1.shape[0])))
    assert picked == {id(tile) for _, tile in rules}


@pytest.mark.parametrize("expert_scales,expert_fp4", [("row", "nibbles"), ("k_major", "words")])
def test_moe_warms_the_expert_layout_a_load_makes(expert_scales, expert_fp4):
    """The warm-up's stand-in expert weights are laid out as the MoE layers lay out theirs at load
    (graphs.moe.stack_experts): the scales K major under ``expert_scales: k_major`` (the kernels
    specialise on that stride), an fp4_w stack's largest scale byte recorded (the scale fold's bound),
    its codes in words under ``expert_fp4: words`` (a constexpr of the kernels)."""
    from flashrt.graphs.moe import stack_experts
    from flashrt.kernels_cuda import moe, moe_warmup

    d = dict(_warmup.MODELS["tiny"], expert_dtype="fp4")
    profile = dataclasses.replace(profiles.active_profile(), expert_scales=expert_scales, expert_fp4=expert_fp4)
    with profiles.using(profile):
        warm = [c for c in moe_warmup.warmup_cases("cpu", d, torch.bfloat16) if c.fn is moe.moe_experts]
        loaded = stack_experts([formats.quantize(torch.randn(64, 64), "fp4_w") for _ in range(2)])
    assert warm
    for case in warm:
        w1 = case.args[3]
        shared = case.args[-1] if isinstance(case.args[-1], tuple) else ()
        for w in (w1, *shared):
            k_major = w.scale.stride()[-2:] == (1, w.scale.shape[-2])
            assert k_major if expert_scales == "k_major" else w.scale.is_contiguous()
            assert (w.scale_max is not None) == (w.fmt in ("fp4_w", "fp8_w"))
            assert w.e2m1_words == (w.fmt == "fp4_w" and expert_fp4 == "words")
        assert (w1.scale.stride(-1) == 1) == (loaded.scale.stride(-1) == 1) and loaded.scale_max is not None
        assert w1.e2m1_words == loaded.e2m1_words


def test_moe_warms_the_routing_tables_at_the_models_experts(recorded):
    """Every sort width of the one-program routing kernel (a power of two of the pairs, up to
    route.max_pairs) and the sorted path past it, for each tile rule's row height (and the row tiles
    of a rule's ``qgmma`` knob: the h200 profile's decode rule takes 8 rows a tile), at the expert count
    of each warmed model."""
    from flashrt.kernels_cuda import moe, moe_tables

    with profiles.using("h200"):
        route, rules = profiles.tiles("moe", moe.TILES)["route"], profiles.tiles("moe", moe.TILES)["experts"]
        moe.FAMILY.warmup(profiles.active_profile())
    seen = {}
    for launch in recorded:
        if launch.fn is moe_tables.route_tables:
            idx, _, experts, bm = launch.args[:4]
            pairs = idx.numel()
            seen.setdefault((experts, bm), set()).add(max(16, 1 << (pairs - 1).bit_length())
                                                      if pairs <= route["max_pairs"] else "large")
    widths = {1 << b for b in range(4, route["max_pairs"].bit_length())} | {"large"}
    assert seen and all(v == widths for v in seen.values()), seen
    qgmma = {moe.qgmma_rows(t) for _, t in rules if t.get("qgmma")}
    assert qgmma and {bm for _, bm in seen} == {t["BLOCK_M"] for _, t in rules} | qgmma
    assert {e for e, _ in seen} == {d["n_routed_experts"] for d in _warmup.selected_models().values()}


@pytest.mark.parametrize("name", HOOKED)
def test_the_launches_run_under_the_interpreter_at_tiny_dims(name):
    """The argument lists are valid: each launch of the hook, at the tiny-vl model's dims (tiny's and
    an image encoder), runs."""
    from flashrt.kernels_cuda import moe_tables

    fam, n = _families()[name], 0
    with profiles.using(dataclasses.replace(profiles.load_profile("cpu"), weight_dtype="fp8")):  # fp8_w linears too
        tiny = {"tiny-vl": _warmup.MODELS["tiny-vl"]}
        for launch in _warmup.plan(fam.warmup_cases, profiles.active_profile(), "cpu", tiny):
            if launch.fn is moe_tables.route_tables and _WIDEST_SORT_RUN < launch.args[0].numel() <= _max_pairs():
                continue
            launch.fn(*launch.args)
            n += 1
    assert n > 0


# The one-program routing kernel's wider sorts take the same arguments as its narrower ones (only
# the sort width, a constexpr, grows) and cost minutes in the interpreter; the kernel tests check it
# against the torch tables from its narrowest sort to its widest.
_WIDEST_SORT_RUN = 256


def _max_pairs() -> int:
    from flashrt.kernels_cuda import moe

    return profiles.tiles("moe", moe.TILES)["route"]["max_pairs"]


def test_shapes_narrow_the_models_warmed(recorded, monkeypatch, capsys):
    from flashrt.cli import commands as cli
    from flashrt.kernels_cuda import norm_rope

    monkeypatch.setenv("FLASHRT_WARMUP_MODELS", "small")
    norm_rope.FAMILY.warmup(profiles.load_profile("h200"))
    widths = {launch.args[0].shape[-1] for launch in recorded if launch.fn is norm_rope.rms_norm}
    assert 1024 in widths and 5120 not in widths
    assert cli.main(["jit", "warmup", "--shapes", "small", "big"]) == 2
    assert "--shapes: expected names from ['small', 'tiny', 'tiny-vl', 'v4.1-flash'], got ['big']" in capsys.readouterr().err
    monkeypatch.setenv("FLASHRT_WARMUP_MODELS", "huge")
    with pytest.raises(ValueError, match="FLASHRT_WARMUP_MODELS"):
        norm_rope.FAMILY.warmup(profiles.load_profile("h200"))


def test_the_pool_s_failures_a_stale_plan_entry_is_a_note_a_warm_up_case_a_failure(monkeypatch):
    from flashrt import jit_targets, jit_warmup

    class Pool:
        closed = False

        def start(self, arch, profile, models, sources, launcher):
            assert launcher and models == {"small": {}} and [n for n, _ in sources] == ["norm_rope"]
            return self

        def result(self, timeout):
            return {"done": True, "failed": [
                {"kernel": "m._old_kernel", "family": "plan", "error": "CompilationError: gone"},
                {"kernel": "m._rms_norm_kernel", "family": "norm_rope", "error": "ptxas: too many registers"}]}

        def close(self):
            Pool.closed = True

    monkeypatch.setattr(jit_targets, "device_arch", lambda: jit_targets.ARCHS["sm_90"])
    hook = _families()["norm_rope"].warmup
    report = {"failed": {}, "notes": {}}
    jit_warmup._precompile(Pool(), profiles.load_profile("h200"), {"small": {}}, [("norm_rope", hook)], report)
    assert Pool.closed and report["failed"] == {"compile m._rms_norm_kernel": "ptxas: too many registers"}
    assert "1 planned variants did not compile" in report["notes"]["plan"] and "m._old_kernel" in report["notes"]["plan"]
