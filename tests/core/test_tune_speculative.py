"""`flashrt tune --speculative MODEL` times plain decode, draft and verify steps on this device and
writes them as the profile's ``speculative_costs``: the file validates and the adaptive choice of
``k`` reads it (tiny on the CPU, one batch size)."""
import math

import pytest
import torch

from flashrt import profiles
from flashrt.cli import commands as cli
from flashrt.cli.tune_speculative import batches_for
from flashrt.engine import adaptive, spec_costs
from flashrt.engine.run import load_model


def test_tune_writes_the_speculative_cost_table(tmp_path, capsys, monkeypatch):
    rows = []
    real = spec_costs.measure
    monkeypatch.setattr(spec_costs, "measure", lambda *a, **kw: rows.append(real(*a, **kw)) or rows[-1])
    out = tmp_path / "mine.yaml"
    assert cli.main(["tune", "--out", str(out), "--no-kernels", "--speculative", "tiny",
                     "--speculative-batches", "2", "--device", "cpu"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    text = out.read_text()
    assert "# speculative_costs: tiny on cpu" in text and "# tuned by `flashrt tune`" in text
    written = profiles.load_profile_file(out)  # passes the profile's checks
    (row,) = rows
    K = row["block_size"]
    assert list(written.speculative_costs) == [2] and row["batch"] == 2
    entry = written.speculative_costs[2]
    want = [1.0] + [row["verify_ms"][k] / row["decode_ms"] for k in range(1, K + 1)]
    assert entry["verify"] == pytest.approx(want) and entry["draft"] == pytest.approx(row["draft_ms"] / row["decode_ms"])
    assert all(math.isfinite(v) and v > 0 for v in entry["verify"])
    base = profiles.active_profile()
    assert written.name == "mine"
    assert {k: v for k, v in written.to_dict().items() if k not in ("speculative_costs", "name", "tiles")} == \
        {k: v for k, v in base.to_dict().items() if k not in ("speculative_costs", "name", "tiles")}
    model = load_model("tiny", torch.device("cpu"), quiet=True, profile=str(out))
    curve = adaptive.CostCurve.for_model(model)
    assert curve.at(2, K) == (pytest.approx(entry["verify"]), pytest.approx(entry["draft"]))
    # the same confidence c at every position: a row gains 1 + c + c^2 + .. + c^k tokens for
    # verify[k] + draft (k >= 1) of the written table; the measured table decides which k wins
    for logit in (-30.0, 0.0, 2.0, 30.0):
        c = 1 / (1 + math.exp(-logit))
        rates = [sum(c ** i for i in range(k + 1)) / (entry["verify"][k] + (entry["draft"] if k else 0))
                 for k in range(K + 1)]
        want = max(range(K + 1), key=lambda k: (round(rates[k], 9), -k))
        assert adaptive.choose_k(torch.full((2, K), logit), curve, 2) == want


def test_batches_and_errors_are_named(capsys):
    base = profiles.active_profile()
    assert batches_for(base, [8, 1, 8]) == [1, 8]
    assert batches_for(base, None) == (sorted(base.speculative_costs) or [1, 8, 64])
    with pytest.raises(ValueError, match="--speculative-batches"):
        batches_for(base, [0])
    assert cli.main(["tune", "--out", "x.yaml", "--no-kernels"]) == 2
    assert "--no-kernels: expected --speculative MODEL too" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: exit status 2 with the argument named
        cli.main(["tune", "--out", "x.yaml", "--speculative", "tiny", "--speculative-batches", "0"])
    assert "--speculative-batches: expected an integer >= 1, got '0'" in capsys.readouterr().err
