"""The tree's text files carry no leftover merge-conflict markers (a merge committed half-resolved)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^(<{7}|>{7})( |$)|^={7}$", re.M)
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".sh", ".json"}


def tracked_files() -> list[Path]:
    """The repository's tracked files (every file under the root outside hidden folders when git
    cannot list them, e.g. an unpacked source tree)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.parts)]


def conflict_lines(text: str) -> list[int]:
    return [text.count("\n", 0, m.start()) + 1 for m in MARKER.finditer(text)]


def test_no_merge_conflict_markers():
    found = {}
    for path in tracked_files():
        if path.suffix in SUFFIXES and path.is_file():
            lines = conflict_lines(path.read_text(errors="replace"))
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert not found, f"merge-conflict markers left in: {found}"


def test_the_check_sees_a_marker():
    text = "a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> branch\n"
    assert conflict_lines(text) == [2, 4, 6]
    assert conflict_lines("a\n====\n<<<<<< x\n") == []
