"""``flashrt run --speculative dspark``: the same tokens as a plain run, the speculative report
fields, and one clear error line for a model without draft layers or a bad --draft-tokens."""
import dataclasses
import json

import pytest

from flashrt.cli import commands as cli


def run_json(capsys, *args) -> dict:
    assert cli.main(["run", "--json", "--max-new-tokens", "7", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_run_speculative_reports_and_matches_plain(capsys):
    plain = run_json(capsys)
    got = run_json(capsys, "--speculative", "dspark", "--draft-tokens", "2")
    assert got["new_token_ids"] == plain["new_token_ids"]
    assert plain["speculative"] is None
    s = got["speculative"]
    for key in ("acceptance_rate", "mean_accepted_length", "draft_seconds", "verify_seconds", "rounds"):
        assert key in s
    assert s["rounds"] >= 1 and 0 <= s["acceptance_rate"] <= 1 and s["mean_accepted_length"] >= 1
    assert set(s["k_counts"]) <= {"1", "2"}  # JSON keys
    assert cli.main(["run", "--max-new-tokens", "3", "--speculative", "dspark"]) == 0
    assert "speculative (dspark): acceptance" in capsys.readouterr().out


def test_run_speculative_errors(capsys, tmp_path, cfg, weights):
    from flashrt.graphs.model import Model

    plain = dataclasses.replace(cfg, dspark_block_size=0, n_mtp_layers=0)
    keep = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    Model(plain, keep).save(tmp_path / "plain")
    assert cli.main(["run", "--model", str(tmp_path / "plain"), "--speculative", "dspark", "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err
    assert "speculative" in err and "no DSpark draft layers" in err and "Traceback" not in err
    assert cli.main(["run", "--speculative", "dspark", "--draft-tokens", "9", "--max-new-tokens", "2"]) != 0
    assert "draft_tokens: expected an int in [1, 3]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["run", "--speculative", "dspark", "--draft-tokens", "some"])
    assert "--draft-tokens" in capsys.readouterr().err
