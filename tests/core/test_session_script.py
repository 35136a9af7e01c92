"""benchmarks/h200_session.sh: every phase it can run is documented in its header, and a name it
cannot run is refused before any work (exit 2, naming the phase and the ones it has)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "h200_session.sh"


def _phases(text: str) -> set[str]:
    return {m.group(1).replace("_", "-") for m in re.finditer(r"^phase_([a-z0-9_]+)\(\) \{", text, re.M)}


def test_every_phase_is_documented():
    text = SCRIPT.read_text()
    header = text[:text.index("\nset -u")]
    documented = set(re.findall(r"^#   ([a-z0-9-]+) ", header, re.M))
    phases = _phases(text)
    assert len(phases) > 10
    assert not phases - documented, f"phases without a line in the header: {sorted(phases - documented)}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_unknown_phase_is_refused_and_known_ones_listed(tmp_path):
    phases = sorted(_phases(SCRIPT.read_text()))
    bad = "no-such-phase"
    run = subprocess.run(["bash", str(SCRIPT), phases[0], bad], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert run.returncode == 2
    assert f"unknown phase: {bad}" in run.stderr
    assert all(f" {p} " in run.stderr for p in phases), run.stderr
    assert list(tmp_path.iterdir()) == []  # refused before any phase ran
