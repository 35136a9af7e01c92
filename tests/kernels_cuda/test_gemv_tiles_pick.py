"""``benchmarks/gemv_tiles.py --profile-out``: the MMA variant with the least time summed over a
family's cases becomes that family's first rule in a copy of the active profile, only where it beats
the profile's sum by the margin and was timed on every case; a GEMV variant goes in front of the
rules for up to the row count that gives the least total with the profile serving the cases with more
rows; the copy passes the profile checks."""
import random
from pathlib import Path

from flashrt import profiles
from kernel_check import requires_kernels

pytestmark = requires_kernels
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _rows(gemv_tiles, times: dict) -> list[dict]:
    """Rows as the benchmark writes them: (case prefix, rows) x variant -> microseconds."""
    rows = []
    for (case, m), by_variant in times.items():
        for variant, us in by_variant.items():
            tile = gemv_tiles.MMA_VARIANTS.get(variant) or gemv_tiles.GEMV_VARIANTS.get(variant)
            row = {"case": case, "rows": m, "variant": variant, "tile": dict(tile, min_block_n=32) if tile else None}
            if us is not None:
                row["us_per_call"] = us
            else:
                row["error"] = "failed"
            rows.append(row)
    return rows


def test_the_fastest_variant_over_every_case_becomes_the_first_rule(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gemv_tiles

    labels = list(gemv_tiles.MMA_VARIANTS)
    fast, failed, near = random.sample(labels, 3)
    base = {v: random.uniform(20, 30) for v in labels}
    times = {}
    for case in ("linear a", "linear b"):
        for m in (1, 4):
            by = {"profile": 20.0, **{v: 25.0 + base[v] for v in labels}}
            by[fast], by[failed] = 12.0, 1.0  # the fastest where timed; `failed` fails on one case below
            times[(case, m)] = by
    times[("linear b", 4)][failed] = None
    for m in (1, 8):  # the experts: the best variant within the margin of the profile
        times[(f"moe_experts E{m}", m)] = {"profile": 100.0, near: 98.0, **{v: 150.0 for v in labels if v != near}}
    rules = gemv_tiles.fastest_rules(_rows(gemv_tiles, times))
    assert rules == {("linear", "linear"): (dict(gemv_tiles.MMA_VARIANTS[fast], min_block_n=32), None)}
    out = tmp_path / "h200-picked.yaml"
    with profiles.using("h200"):
        gemv_tiles.write_profile(str(out), rules)
        before = profiles.active_profile()
    got = profiles.load_profile_file(str(out))
    assert got.name == "h200-picked"
    limit, tile = got.tiles["linear"]["linear"][0]
    assert limit == before.tiles["linear"]["linear"][0][0] and tile == rules[("linear", "linear")][0]
    assert got.tiles["moe"] == before.tiles["moe"]


def test_a_fastest_gemv_goes_in_front_of_the_rules(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gemv_tiles

    gemv, mma = random.choice(list(gemv_tiles.GEMV_VARIANTS)), random.choice(list(gemv_tiles.MMA_VARIANTS))
    times = {(case, m): {"profile": 20.0, gemv: 10.0 + m, mma: 15.0} for case in ("linear a", "linear b")
             for m in (1, 4)}
    rules = gemv_tiles.fastest_rules(_rows(gemv_tiles, times))
    assert rules == {("linear", "linear"): (dict(gemv_tiles.GEMV_VARIANTS[gemv], min_block_n=32), 4)}
    out = tmp_path / "h200-gemv.yaml"
    with profiles.using("h200"):
        gemv_tiles.write_profile(str(out), rules)
        before = profiles.active_profile()
    got = profiles.load_profile_file(str(out))
    assert list(got.tiles["linear"]["linear"][0]) == [4, rules[("linear", "linear")][0]]
    # the profile's rules for up to 4 rows give way; the rest follow as they were
    assert got.tiles["linear"]["linear"][1:] == [r for r in before.tiles["linear"]["linear"] if r[0] is None or r[0] > 4]
    assert any(r[0] is not None and r[0] <= 4 for r in before.tiles["linear"]["linear"])


def test_a_gemv_that_loses_at_more_rows_serves_only_the_rows_it_wins(monkeypatch):
    """A GEMV fastest at one row and slower than the profile at four gets a rule for one row, in both
    linear families, over a GEMV within the margin at both row counts."""
    monkeypatch.syspath_prepend(str(BENCH))
    import gemv_tiles

    one, four = random.sample(list(gemv_tiles.GEMV_VARIANTS), 2)
    win, lose = random.uniform(5, 15), random.uniform(25, 40)  # against the profile's 20 us
    times = {}
    for case in ("linear a", "linear b", "plain c"):
        times[(case, 1)] = {"profile": 20.0, one: win, four: 19.5}
        times[(case, 4)] = {"profile": 20.0, one: lose, four: 19.8}  # `four` within the margin at 4 rows
    rules = gemv_tiles.fastest_rules(_rows(gemv_tiles, times))
    assert rules == {("linear", "linear"): (dict(gemv_tiles.GEMV_VARIANTS[one], min_block_n=32), 1),
                     ("linear_plain", "plain"): (dict(gemv_tiles.GEMV_VARIANTS[one], min_block_n=32), 1)}
