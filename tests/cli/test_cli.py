"""`flashrt doctor`: devices, backends with availability, versions — as text and as JSON."""
import json
import subprocess
import sys

import torch

from flashrt.cli import commands as cli


def test_doctor_json_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-m", "flashrt.cli", "doctor", "--json"], capture_output=True,
                         text=True, check=True, cwd="/").stdout
    report = json.loads(out)
    assert report["versions"]["torch"] == torch.__version__
    names = {b["name"]: b for b in report["backends"]}
    assert names["reference"]["available"] and "cpu" in names["reference"]["device_types"]
    assert report["devices"]["cpu"]["available"]
    assert report["devices"]["cuda"]["available"] == torch.cuda.is_available()
    assert "cpu" in report["profiles"]["shipped"]


def test_doctor_text(capsys):
    assert cli.main(["doctor"]) == 0
    text = capsys.readouterr().out
    for needle in ("versions: torch", "devices:", "backends (automatic order):", "reference", "profiles:"):
        assert needle in text
    assert ("cuda  not available" in text) != torch.cuda.is_available()


def test_unknown_command_exits_with_usage(capsys):
    try:
        cli.main(["frobnicate"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "invalid choice" in capsys.readouterr().err
