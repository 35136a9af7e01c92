"""``benchmarks/prefix_attention.py --profile-out``: the fastest timed tile variant of the prefix
kernel goes into a copy of the active profile, over its ``tiles.prefix_attention.prefix``, only where it
beats the shipped tiles by the margin; failed variants never win; the copy passes the profile
checks and keeps every other section."""
import random
from pathlib import Path

from flashrt import profiles
from kernel_check import requires_kernels

pytestmark = requires_kernels
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _variants(prefix_attention, times: dict) -> list[dict]:
    """Variants as the benchmark records them: label -> microseconds, or None where it failed."""
    return [{"variant": k, "tiles": prefix_attention.VARIANTS[k], **({"us": us} if us is not None else {"error": "x"})}
            for k, us in times.items()]


def test_the_fastest_variant_past_the_margin_is_written(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import prefix_attention

    labels = [k for k in prefix_attention.VARIANTS if k != "shipped"]
    fast, failed, near = random.sample(labels, 3)
    shipped = random.uniform(500, 1000)
    times = {"shipped": shipped, **{k: shipped * random.uniform(1.0, 2.0) for k in labels}}
    times[fast], times[failed] = shipped * random.uniform(0.5, 0.96), None
    assert prefix_attention.fastest_tiles(_variants(prefix_attention, times)) == prefix_attention.VARIANTS[fast]
    times[fast] = shipped * 1.5
    times[near] = shipped * random.uniform(0.975, 0.999)  # within the margin: the shipped tiles stay
    assert prefix_attention.fastest_tiles(_variants(prefix_attention, times)) is None

    out = tmp_path / "h200-prefix-picked.yaml"
    with profiles.using("h200"):
        prefix_attention.write_profile(str(out), prefix_attention.VARIANTS[fast])
        before = profiles.active_profile()
    got = profiles.load_profile_file(str(out))
    assert got.name == "h200-prefix-picked"
    # a variant is timed over the active profile's tiles (with_tiles), so it is written over them too
    shipped_rule = before.tiles.get("prefix_attention", {}).get("prefix", {})
    assert got.tiles["prefix_attention"]["prefix"] == {**shipped_rule, **prefix_attention.VARIANTS[fast]}
    assert {k: v for k, v in got.tiles.items() if k != "prefix_attention"} == \
        {k: v for k, v in before.tiles.items() if k != "prefix_attention"}
    with profiles.using(got):  # the tile checks accept the written variant
        from flashrt.kernels_cuda import prefix_attention as kernel

        profiles._TILES_CACHE.clear()
        assert {k: kernel.PLANS.tiles()["prefix"][k] for k in prefix_attention.VARIANTS[fast]} == \
            prefix_attention.VARIANTS[fast]
    profiles._TILES_CACHE.clear()
