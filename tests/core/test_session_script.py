"""benchmarks/h200_session.sh: every phase it can run is documented in its header, a name it
cannot run is refused before any work (exit 2, naming the phase and the ones it has), and
``before_run`` puts back every file it swapped in for a command."""
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


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("command_fails", [False, True])
def test_before_run_swaps_the_folder_s_files_in_for_one_command_and_back(tmp_path, command_fails):
    """``before_run DIR CMD``: CMD sees the files under DIR at their repository paths; afterwards
    (whether CMD failed or not) every file holds what it held before, and CMD's status is returned."""
    text = SCRIPT.read_text()
    function = text[text.index("before_run() {"):]
    function = function[:function.index("\n}\n") + 3]
    repo, before = tmp_path / "repo", tmp_path / "before"
    for root, body in ((repo, "now"), (before, "then")):
        (root / "pkg").mkdir(parents=True)
        (root / "pkg" / "mod.py").write_text(f"{body} mod\n")
    (repo / "other.py").write_text("untouched\n")
    cmd = "cat pkg/mod.py other.py" + ("; exit 3" if command_fails else "")
    run = subprocess.run(["bash", "-c", f"set -u\n{function}\nbefore_run {before} bash -c '{cmd}'"],
                         cwd=repo, capture_output=True, text=True, timeout=60)
    assert run.stdout == "then mod\nuntouched\n", run.stderr
    assert run.returncode == (3 if command_fails else 0)
    assert (repo / "pkg" / "mod.py").read_text() == "now mod\n" and (repo / "other.py").read_text() == "untouched\n"
    assert (before / "pkg" / "mod.py").read_text() == "then mod\n"
