"""``benchmarks/moe_prefill_tiles.py``: every tile it times is a rule the profile checks accept, and
the routed experts under it (the rule in front of the active ones, the weights laid out as the
profile's load lays them out) give the reference backend's output."""
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import flashrt
from flashrt import profiles
from kernel_check import DEVICE, rel_err, requires_kernels

pytestmark = requires_kernels
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import moe_prefill_tiles

    return moe_prefill_tiles


def test_every_variant_passes_the_profile_checks(bench):
    data = yaml.safe_load((BENCH.parent / "hwconfigs" / "h200.yaml").read_text())
    decode = data["tiles"]["moe"]["experts"][:-1]  # the rules up to 16 rows; a variant replaces the last

    def with_last(rule):
        return dict(data, tiles=dict(data["tiles"], moe=dict(data["tiles"]["moe"], experts=[*decode, [None, rule]])))

    for label, rule in bench.VARIANTS.items():
        got = profiles.profile_from_mapping(with_last(rule), label)  # raises on a tile the moe family rejects
        assert list(got.tiles["moe"]["experts"][-1]) == [None, rule]
    with pytest.raises(flashrt.errors.ProfileError):  # the checks do reject a bad tile
        profiles.profile_from_mapping(with_last(dict(rule, BLOCK_N=48)), "bad")


@pytest.mark.parametrize("words", [False, True], ids=["nibbles", "words"])
def test_each_variant_gives_the_reference_output(bench, words, rng):
    from flashrt.kernels_cuda import linear, moe

    cfg = SimpleNamespace(n_routed_experts=4, n_activated_experts=2, dim=64, moe_inter_dim=64)
    layout = dict(expert_fp4="words" if words else "nibbles", expert_scales="k_major")
    with profiles.using(dataclasses.replace(profiles.active_profile(), **layout)):
        call, weight_bytes, flops = bench.experts(cfg, 8, DEVICE, rng)
        assert flops == 6.0 * 8 * 2 * 64 * 64 and 0 < weight_bytes
        with flashrt.use_backend("reference"):
            want = call().float()
        for label, rule in bench.VARIANTS.items():
            with flashrt.use_backend("cuda"), bench.with_rule("moe", "experts", None, rule):
                profiles._TILES_CACHE.clear()
                assert linear.pick_tile(moe._tiles()["experts"], 64) == rule  # what a 64-row launch takes
                got = call().float()
            assert rel_err(got, want) < 2e-2, label
    profiles._TILES_CACHE.clear()
