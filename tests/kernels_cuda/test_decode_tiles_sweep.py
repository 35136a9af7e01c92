"""``benchmarks/decode_tiles.py --small`` end to end under the interpreter: every entry the decode
calls use is swept with the profile's values first (the baseline of the same run), each candidate
checked against the reference, the new split / narrow launches taken (132 SMs as on an H200), and
the YAML fragment passes the profile checks of the kernel families."""
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from flashrt import profiles, tile_checks
from kernel_check import requires_kernels

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
lp = pytest.importorskip("flashrt.kernels_cuda.linear_plain")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_small_sweep_writes_timings_and_a_valid_fragment(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import decode_tiles

    monkeypatch.setattr(lin, "num_sms", lambda: 132)  # the knobs act as on an H200
    monkeypatch.setattr(lp, "num_sms", lambda device: 132)
    out, frag = tmp_path / "tiles.json", tmp_path / "frag.yaml"
    assert decode_tiles.main(["--small", "--budget", "120", "--out", str(out), "--fragment", str(frag)]) == 0
    report = json.loads(out.read_text())
    got = {(r["entry"]["module"], r["entry"]["key"], r["entry"]["rule"]) for r in report["results"]}
    assert got == {("linear", "linear", 0), ("moe", "experts", 0), ("mhc", "hc_coefficients", None),
                   ("linear_plain", "plain", 0)}
    for r in report["results"]:
        assert r["scores"][0]["values"] == {} and r["baseline_ms"] > 0  # the profile's own tiles, timed first
        assert len(r["scores"]) == 2 and all(s["why"] is None for s in r["scores"])
        assert len(r["rows"]) == 2 * len(r["cases"])
        assert all(row["rel_err"] < decode_tiles.TOL[r["entry"]["module"]] for row in r["rows"])
        assert r["winner_ms"] == min(s["score_ms"] for s in r["scores"])
    linear = next(r for r in report["results"] if r["entry"]["module"] == "linear")
    # tiny's projections: wq_a, wq_b, wkv and wo_b (both 64 x 64), the indexer's wq_b, the Engram wkv
    assert linear["cases"] == ["linear 32x64 b1", "linear 256x32 b1", "linear 64x64 b1", "linear 64x32 b1",
                               "linear 320x192 b1"]
    assert [row["per_step"] for row in linear["rows"][:5]] == [8, 8, 16, 3, 2]
    grids = lambda r, name: [g for row in r["rows"] for g in row["grids"][name]]  # noqa: E731
    assert all(row["grids"] for r in report["results"] for row in r["rows"])  # each case's launches recorded
    assert any(g[1] > 1 for g in grids(linear, "_linear_kernel"))  # K split by split_min_blocks
    moe_up = grids(next(r for r in report["results"] if r["entry"]["module"] == "moe"), "_moe_up_kernel")
    assert len({g[0] for g in moe_up}) > 1  # narrower column tiles (tiny's K: one block, no split)
    plain = next(r for r in report["results"] if r["entry"]["module"] == "linear_plain")
    # tiny's plain linears: wo_a (2 groups), the gate, the head, the fused compressor (fp32 x), the
    # ratio-1 compressor, the indexer's wk and weights_proj
    assert plain["cases"] == ["plain 64x128 g2 bfloat16 b1", "plain 8x64 bfloat16 b1", "plain 320x64 float32 b1",
                              "plain 128x64 float32 b1", "plain 64x64 bfloat16 b1", "plain 32x64 bfloat16 b1",
                              "plain 2x64 bfloat16 b1"]
    assert [row["per_step"] for row in plain["rows"][:7]] == [8, 8, 1, 1, 1, 2, 3]
    head = [row["grids"]["_plain_linear_kernel"][0] for row in plain["rows"] if row["case"].startswith("plain 320x64")]
    assert head[0][0] < head[1][0]  # the candidate's narrower column tiles
    tiles = yaml.safe_load(frag.read_text())["tiles"]
    assert tiles == report["fragment"]
    tile_checks.check_profile(dataclasses.replace(profiles.active_profile(), tiles=tiles), str(frag))


def test_bad_budget_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    import decode_tiles

    with pytest.raises(SystemExit):
        decode_tiles.main(["--budget", "0", "--out", str(tmp_path / "x.json")])
    assert "--budget: expected seconds > 0, got 0.0" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
