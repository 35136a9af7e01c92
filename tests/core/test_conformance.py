"""`flashrt conformance`: every op vs the reference, and a wrong backend is caught."""
import json
import subprocess
import sys

import torch

from flashrt import conformance, dispatch, ops, refmath
from flashrt.hookspecs import Backend, hookimpl


class WrongNorm:
    @hookimpl
    def flashrt_backend(self):
        return Backend(name="wrong", device_types=("cpu",), priority=60,
                       ops={"rms_norm": lambda x, weight, eps: x * 1.1})


class OffByOneGather:
    """Stages the right rows but points the cold picks one slot too far."""

    @hookimpl
    def flashrt_backend(self):
        def gather(*args):
            staging, index = refmath.gather_cold_rows(*args)
            return staging, index + (index >= args[4]).int()

        return Backend(name="offbyone", device_types=("cpu",), priority=60, ops={"gather_cold_rows": gather})


def test_every_op_is_checked_and_passes_on_the_reference():
    report = conformance.run("cpu")
    assert {r["op"] for r in report["rows"]} == set(ops.OPS)
    assert report["passed"] == report["total"]


def test_a_wrong_cold_gather_fails_conformance():
    dispatch.register(OffByOneGather(), name="offbyone")
    rows = {r["op"]: r for r in conformance.run("cpu")["rows"]}
    assert rows["gather_cold_rows"]["backend"] == "offbyone" and not rows["gather_cold_rows"]["pass"]


def test_a_wrong_backend_fails_conformance():
    dispatch.register(WrongNorm(), name="wrong-norm")
    rows = {r["op"]: r for r in conformance.run("cpu")["rows"]}
    assert rows["rms_norm"]["backend"] == "wrong" and not rows["rms_norm"]["pass"]
    assert rows["rms_norm"]["max_rel_err"] > 0.05 and rows["linear"]["pass"]


def test_cli_writes_the_json_report(tmp_path):
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "flashrt.cli", "conformance", "--out", str(out)],
                       capture_output=True, text=True, cwd="/")
    assert r.returncode == 0 and "ops conform" in r.stdout
    report = json.loads(out.read_text())
    assert report["device_type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert all({"op", "backend", "inputs", "max_rel_err", "tolerance", "pass", "route"} <= set(row) for row in report["rows"])
