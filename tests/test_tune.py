"""`flashrt tune` sweeps tiles (here under the Triton interpreter), keeps only correct winners and
writes a loadable profile with the measured times as comments."""
import pytest

from flashrt import profiles, tune
from kernel_check import requires_kernels


@requires_kernels
def test_tune_writes_a_loadable_profile_with_winners(tmp_path, monkeypatch):
    monkeypatch.setitem(tune.SPACES, "quant", ("quantize", {"ELEMS": [2048, 4096], "num_warps": [4]}, tune._quant))
    tuned, results = tune.tune(["quant"], small=True)
    (r,) = results
    assert r["winner"] in ({"ELEMS": 2048, "num_warps": 4}, {"ELEMS": 4096, "num_warps": 4}) and r["rejected"] == 0
    path = tmp_path / f"{tuned.name}.yaml"
    tune.write_profile(tuned, results, str(path))
    text = path.read_text()
    assert "# quant.quantize:" in text and "untuned" in text
    loaded = profiles.load_profile_file(path)
    assert loaded.tiles["quant"]["quantize"]["ELEMS"] == r["winner"]["ELEMS"]


@requires_kernels
def test_a_wrong_candidate_never_wins(monkeypatch):
    real = tune._close
    monkeypatch.setattr(tune, "_close", lambda got, want: real(got, want) and profiles.tiles(
        "quant", tune._module_tiles("quant"))["quantize"]["ELEMS"] != 2048)
    monkeypatch.setitem(tune.SPACES, "quant", ("quantize", {"ELEMS": [2048, 4096], "num_warps": [4]}, tune._quant))
    _, (r,) = tune.tune(["quant"], small=True)
    assert r["winner"]["ELEMS"] == 4096 and r["rejected"] == 1


def test_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="kernels"):
        tune.tune(["nope"])
