"""`flashrt tune` sweeps tiles (here under the Triton interpreter), keeps only correct winners, skips
candidates that cannot run, and writes a loadable profile with the measured times as comments."""
import contextlib
import dataclasses
import math

import pytest

from flashrt import profiles, tune
from flashrt.kernels_cuda.linear import pick_tile
from flashrt.tune_spaces import SPACES, Space
from kernel_check import requires_kernels


def _narrow(monkeypatch, name: str, **params) -> None:
    monkeypatch.setitem(SPACES, name, dataclasses.replace(SPACES[name], params=params))


@requires_kernels
def test_tune_writes_a_loadable_profile_with_winners(tmp_path, monkeypatch):
    _narrow(monkeypatch, "quant", ELEMS=[2048, 4096], num_warps=[4])
    tuned, results = tune.tune(["quant"], small=True)
    (r,) = results
    assert r["winner"] in ({"ELEMS": 2048, "num_warps": 4}, {"ELEMS": 4096, "num_warps": 4}) and r["rejected"] == 0
    path = tmp_path / f"{tuned.name}.yaml"
    tune.write_profile(tuned, results, str(path))
    text = path.read_text()
    assert "# quant.quantize (quant):" in text and "untuned" in text
    loaded = profiles.load_profile_file(path)
    with profiles.using(loaded):
        assert profiles.tiles("quant", tune._module_tiles("quant"))["quantize"]["ELEMS"] == r["winner"]["ELEMS"]
    defaults = tune._module_tiles("quant")["quantize"]
    written = loaded.tiles.get("quant", {}).get("quantize", {})
    assert all(defaults[k] != v for k, v in written.items())  # only what differs from the defaults is written


@requires_kernels
def test_a_wrong_candidate_never_wins(monkeypatch):
    real = tune._close
    monkeypatch.setattr(tune, "_close", lambda got, want: real(got, want) and profiles.tiles(
        "quant", tune._module_tiles("quant"))["quantize"]["ELEMS"] != 2048)
    _narrow(monkeypatch, "quant", ELEMS=[2048, 4096], num_warps=[4])
    _, (r,) = tune.tune(["quant"], small=True)
    assert r["winner"]["ELEMS"] == 4096 and r["rejected"] == 1


@requires_kernels
def test_a_candidate_that_cannot_run_is_skipped_with_a_note(monkeypatch):
    _narrow(monkeypatch, "quant", ELEMS=[24, 4096], num_warps=[4])  # 24: not a power of two -> error
    _, (r,) = tune.tune(["quant"], small=True)
    assert r["winner"] == {"ELEMS": 4096, "num_warps": 4} and r["failed"] == 1 and r["rejected"] == 0
    assert any(n.startswith("{'ELEMS': 24") for n in r["notes"])


@requires_kernels
def test_a_rule_space_tunes_its_rule_only(tmp_path, monkeypatch):
    _narrow(monkeypatch, "linear_decode", BLOCK_N=[32, 64], num_stages=[2])
    with profiles.using("h200"):
        base_rules = profiles.tiles("linear", tune._module_tiles("linear"))["linear"]
        tuned, (r,) = tune.tune(["linear_decode"], small=True)
    # the rule the case's 4 rows land in among the profile's rules (not the defaults' first)
    i = r["rule"]
    assert i == tune.rule_index(profiles.load_profile("h200"), SPACES["linear_decode"], True) and base_rules[i][0] >= 4
    assert all(limit is not None and limit < 4 for limit, _ in base_rules[:i])
    # the profile's own tile is a candidate too (tried first): it may win
    assert r["winner"]["BLOCK_N"] in (32, 64, base_rules[i][1]["BLOCK_N"]) and r["rejected"] == 0 and r["failed"] == 0
    tune.write_profile(tuned, [r], str(tmp_path / "h200.yaml"))
    with profiles.using(profiles.load_profile_file(tmp_path / "h200.yaml")):
        rules = profiles.tiles("linear", tune._module_tiles("linear"))["linear"]
    assert rules[i][1] == {**base_rules[i][1], **r["winner"]}
    assert [list(x) for j, x in enumerate(rules) if j != i] == [list(x) for j, x in enumerate(base_rules) if j != i]


@requires_kernels
def test_the_attention_split_space_sweeps(monkeypatch):
    _narrow(monkeypatch, "attention_split", programs=[0], min_blocks=[1, 2], max_splits=[4])
    _, (r,) = tune.tune(["attention_split"], small=True)
    current = tune._current(profiles.active_profile(), SPACES["attention_split"])
    tried = [current] + [{"programs": 0, "min_blocks": m, "max_splits": 4} for m in (1, 2)]
    assert r["winner"] in tried and r["candidates"] == 3 and r["rejected"] == 0 and r["failed"] == 0


@requires_kernels
def test_a_spent_budget_keeps_the_profile_tiles():
    tuned, (r,) = tune.tune(["quant"], small=True, budget=1e-9)
    assert r["winner"] is None and r["candidates"] == 0 and r["skipped"] == len(tune.candidates(tuned, SPACES["quant"]))
    assert tuned.tiles == profiles.active_profile().tiles and "time budget" in r["notes"][-1]


@pytest.mark.parametrize("name", [n for n, sp in SPACES.items() if sp.rule is not None])
def test_each_rule_space_case_lands_in_its_rule(name):
    sp: Space = SPACES[name]
    rules = tune._module_tiles(sp.module)[sp.key]
    for small in (False, True):
        assert pick_tile(rules, sp.case.rows[small]) is rules[sp.rule][1], (name, small)


@pytest.mark.parametrize("name", [n for n, sp in SPACES.items() if sp.rule is not None])
def test_a_profile_with_more_rules_tunes_the_rule_its_case_lands_in(name):
    """The h200 profile's rule lists hold more rules than the kernels' defaults (row and weight-size
    splits): the rule tuned is the one its case's launch takes there (the kernels' own pick), its winner
    merged into that rule alone."""
    sp: Space = SPACES[name]
    h200 = profiles.load_profile("h200")
    with profiles.using(h200):
        rules = profiles.tiles(sp.module, tune._module_tiles(sp.module))[sp.key]
    assert len(rules) > len(tune._module_tiles(sp.module)[sp.key])  # else the default index would do
    for small in (False, True):
        i = tune.rule_index(h200, sp, small)
        weights = getattr(sp.case, "weights", {}).get(small)
        picked = pick_tile(rules, sp.case.rows[small], weights)
        assert rules[i][1] is picked, (name, small, i)
        values = {p: vals[-1] for p, vals in sp.params.items()}
        with profiles.using(tune._with_tiles(h200, sp, values, i)):
            after = profiles.tiles(sp.module, tune._module_tiles(sp.module))[sp.key]
        assert [limit for limit, _ in after] == [limit for limit, _ in rules]
        for j, ((_, new), (_, old)) in enumerate(zip(after, rules)):
            assert new == ({**old, **values} if j == i else old), (name, j)


def test_spaces_are_bounded_and_name_real_tile_parameters():
    import importlib

    for name, sp in SPACES.items():
        tiles = tune._module_tiles(sp.module)[sp.key]
        known = tiles[sp.rule][1] if sp.rule is not None else tiles
        assert set(sp.params) <= set(known), name
        assert sp.size <= 24, name
        knobs = set(getattr(importlib.import_module(f"flashrt.kernels_cuda.{sp.module}"), "KNOBS", {}))
        for path, params in sp.paths.items():  # a launch's knobs: the rule's tile keys or the family's knobs,
            own = tune._module_tiles(sp.module).get(sp.path_keys.get(path), {})  # or those of its own key
            if params is not None:
                assert set(params) <= set(known) | knobs | set(own), (name, path)
                assert 1 < math.prod(map(len, params.values())) <= 24, (name, path)
        assert set(sp.path_keys) <= set(sp.paths), name
    assert {"attention", "attention_split", "linear_decode", "linear_large", "moe_decode", "moe_prefill"} <= set(SPACES)


def test_unknown_kernel_and_bad_budget_are_named(capsys):
    from flashrt.cli import commands as cli

    with pytest.raises(ValueError, match="kernels"):
        tune.tune(["nope"])
    assert cli.main(["tune", "--out", "x.yaml", "--budget", "0"]) == 2
    assert "--budget: expected seconds > 0, got 0.0" in capsys.readouterr().err


@contextlib.contextmanager
def _takes(module: str, op: str, path: str):
    """The cuda family of ``module`` names ``path`` as the launch every ``op`` call takes (the family is a
    frozen declaration: its table is swapped and put back)."""
    from flashrt import dispatch

    fam = dispatch.family(module, "cuda")
    real = fam.paths
    object.__setattr__(fam, "paths", {**real, op: lambda *args: path})
    try:
        yield
    finally:
        object.__setattr__(fam, "paths", real)


@requires_kernels
@pytest.mark.parametrize("path", ["qgmma", "gemv_mma"])
def test_a_rule_space_sweeps_the_knobs_of_the_launch_its_case_takes(tmp_path, monkeypatch, path):
    """Where the profile's rule sends the case to another launch than its MMA tile, the sweep varies that
    launch's knobs (the MMA tile's would change nothing it runs) and writes the winner into the same rule."""
    knob = {"qgmma": "qgmma_per_sm", "gemv_mma": "gemv_mma_per_sm"}[path]
    sp = SPACES["linear_decode"]
    monkeypatch.setitem(SPACES, "linear_decode", dataclasses.replace(sp, paths={**sp.paths, path: {knob: [2, 5]}}))
    with _takes("linear", "linear", path), profiles.using("h200"):
        base_rules = profiles.tiles("linear", tune._module_tiles("linear"))["linear"]
        tuned, (r,) = tune.tune(["linear_decode"], small=True)
    assert r["path"] == path and set(r["winner"]) == {knob} and r["rejected"] == r["failed"] == 0
    assert r["candidates"] == 2 + (base_rules[r["rule"]][1].get(knob) not in (2, 5, None))
    assert f"{path} launch" in tune.describe(r)
    with profiles.using(tuned):
        rules = profiles.tiles("linear", tune._module_tiles("linear"))["linear"]
    assert rules[r["rule"]][1] == {**base_rules[r["rule"]][1], **r["winner"]}


@requires_kernels
def test_a_case_on_a_launch_without_tiles_is_not_swept():
    with _takes("linear", "linear", "bf16_gemm"), profiles.using("h200"):
        tuned, (r,) = tune.tune(["linear_large"], small=True)
        assert tuned.tiles == profiles.active_profile().tiles
    assert r["winner"] is None and r["candidates"] == 0 and "bf16_gemm launch" in r["notes"][0]
    assert "no winner" in tune.describe(r)


@requires_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 24, 4096])
def test_linear_names_the_launch_it_takes(monkeypatch, rows):
    """``launch_path`` (what tune reads) agrees with the launch ``linear`` runs, under the h200 profile's rules."""
    import torch

    from flashrt import formats
    from flashrt.kernels_cuda import linear

    ran = []
    for name in ("_bf16_gemm", "_gemv"):
        real = getattr(linear, name)
        monkeypatch.setattr(linear, name, lambda *a, _r=real, _n=name: ran.append(_n) or _r(*a))
    x = torch.randn(rows, 128).to(torch.bfloat16)
    w = formats.quantize(torch.randn(64, 128) * 0.1, "fp8_w")
    with profiles.using("h200"):
        path = linear.launch_path(x, w)
        linear.linear(x, w)
    assert path in {"bf16_gemm", "gemv", "tile"}  # no Gluon launches under the interpreter
    assert ran == ([f"_{path}"] if path != "tile" else []), (path, ran)
    assert (path == "bf16_gemm") == (rows >= 4096)


@requires_kernels
def test_the_untuned_time_is_the_profile_tiles_candidate(monkeypatch):
    """The profile's own tiles are the first candidate: their time is the untuned time (not a second, noisier
    timing), so a winner is never reported slower than the tiles it replaces."""
    import random

    times = []
    monkeypatch.setattr(tune, "_time_ms", lambda fn, gpu: times.append(random.uniform(1, 2)) or times[-1])
    _narrow(monkeypatch, "quant", ELEMS=[2048, 4096], num_warps=[2, 4])
    _, (r,) = tune.tune(["quant"], small=True)
    assert len(times) == r["candidates"] and r["untuned_ms"] == times[0] and r["ms"] == min(times) <= r["untuned_ms"]


@requires_kernels
def test_a_launch_with_tiles_of_its_own_is_swept_there(monkeypatch):
    """The attention case on the warp-specialized kernel sweeps ``tiles.attention.ws`` (not the plain kernel's
    ``attention`` tiles) and the winner lands there alone."""
    narrow = dataclasses.replace(SPACES["attention"], paths={"ws": {"RAW_STAGES": [2, 3]}})
    monkeypatch.setitem(SPACES, "attention", narrow)
    with _takes("attention", "sparse_attention", "ws"), profiles.using("h200"):
        base = profiles.active_profile()
        tuned, (r,) = tune.tune(["attention"], small=True)
    assert r["path"] == "ws" and r["key"] == "ws" and set(r["winner"]) == {"RAW_STAGES"} and r["rejected"] == 0
    with profiles.using(tuned):
        ws = profiles.tiles("attention", tune._module_tiles("attention"))["ws"]
        plain = profiles.tiles("attention", tune._module_tiles("attention"))["attention"]
    with profiles.using(base):
        assert plain == profiles.tiles("attention", tune._module_tiles("attention"))["attention"]
        assert ws == {**profiles.tiles("attention", tune._module_tiles("attention"))["ws"], **r["winner"]}


@requires_kernels
def test_attention_names_the_kernel_it_takes(monkeypatch):
    """``launch_path`` follows the ws tile: on an sm_90 device (pretended here, the interpreter never runs Gluon)
    the h200 profile's 8 queries of 64 heads x 512 take ``ws``; one query (under its min_queries), fp32 q, 16
    heads or a profile without the kernel ``plain``."""
    import torch

    from flashrt import ops
    from flashrt.dtypes import MAIN_KV_FORMAT
    from flashrt.kernels_cuda import attention

    monkeypatch.setattr(attention, "interpreted", lambda: False)
    monkeypatch.setattr(attention.attention_ws, "AVAILABLE", True)
    monkeypatch.setattr(attention.jit_targets, "capability", lambda: (9, 0))

    def args(B, H=64, dtype=torch.bfloat16):
        kv = (ops.quantize(torch.randn(B, 8, 512), "fp8"), ops.quantize(torch.randn(B, 64, 512), MAIN_KV_FORMAT))
        idx = torch.randint(0, 72, (B, 1, 24), dtype=torch.int32)
        return torch.randn(B, 1, H, 512).to(dtype), kv, idx, torch.zeros(H), 512 ** -0.5

    with profiles.using("h200"):
        assert attention.launch_path(*args(8)) == "ws"
        assert attention.launch_path(*args(1)) == "plain"
        assert attention.launch_path(*args(8, dtype=torch.float32)) == "plain"
        assert attention.launch_path(*args(8, H=16)) == "plain"
    with profiles.using("cpu"):
        assert attention.launch_path(*args(8)) == "plain"
