"""The files CLI commands write where ``--out`` points: checked before the work, written whole.

``--out`` may name a new file or one that the same command wrote before (recognized by its content:
:func:`json_report`, :func:`first_line`); any other existing file, or a directory, is refused before the
work starts, so no run ends by overwriting a file flashrt did not create. The text is written atomically
(a temporary file renamed over the path): a run killed while writing leaves the earlier file or none,
never part of one. Should a foreign file appear at the path while the command runs, the output goes to
the first free name beside it instead (``name.1.ext``, ...) and the command says where.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .jit import atomic_write

Recognizer = Callable[[str], bool]  # an existing file's text -> whether the command wrote it


def json_report(*keys: str) -> Recognizer:
    """Recognizes a JSON object holding every one of ``keys``."""
    def ours(text: str) -> bool:
        try:
            data = json.loads(text)
        except ValueError:
            return False
        return isinstance(data, dict) and all(k in data for k in keys)
    return ours


def first_line(prefix: str) -> Recognizer:
    """Recognizes a text whose first line starts with ``prefix``."""
    return lambda text: text.startswith(prefix)


class OutFile:
    """``--out`` of ``command`` (for messages, e.g. ``flashrt conformance``), whose earlier outputs
    ``ours`` recognizes."""

    def __init__(self, path: str | Path, command: str, ours: Recognizer, option: str = "--out"):
        self.path, self.command, self.ours, self.option = Path(path), command, ours, option

    def why_not(self, path: Path | None = None) -> str | None:
        """None where the file may be written: absent, or an earlier output of the command; else why not."""
        path = path or self.path
        if path.is_dir():
            return "a directory"
        if not path.exists():
            return None
        try:
            text = path.read_text(encoding="utf-8", errors="strict")
        except (OSError, UnicodeDecodeError) as exc:
            return f"an existing file it cannot read as text ({type(exc).__name__})"
        return None if self.ours(text) else f"an existing file that `{self.command}` did not write"

    def check(self) -> None:
        """``ValueError`` naming the option where the path may not be written (call before the work)."""
        why = self.why_not()
        if why:
            raise ValueError(f"{self.option}: expected a new file or one an earlier `{self.command}` wrote, got "
                             f"{str(self.path)!r}, {why}; remove it or choose another path")

    def write(self, text: str) -> Path:
        """Write ``text`` whole; returns the path written: a free name beside ``path`` where a file the
        command did not write appeared there meanwhile, which later writes (checkpoints) then keep."""
        target, n = self.path, 0
        while self.why_not(target):
            n += 1
            target = self.path.with_name(f"{self.path.stem}.{n}{self.path.suffix}")
        atomic_write(target, text.encode("utf-8"))
        self.path = target
        return target
