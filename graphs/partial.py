"""Temporary directories of a checkpoint save, and sweeping those a killed save left behind.

A save writes ``.{name}.tmp-XXXX`` beside its target (and moves a replaced checkpoint aside into
``.{name}.old-XXXX``); each holds :data:`MARKER` naming the target, the writing process and host.
:func:`sweep` removes only such directories: the right name pattern, our marker for this target,
and a writer on this host that no longer runs. An ``.old-`` directory is removed only while the
target is a complete checkpoint (otherwise it holds the only complete copy). Nothing else is touched.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

MARKER = ".flashrt-partial-save"


def make_temp(parent: Path, name: str, kind: str) -> Path:
    """A new marked ``.{name}.{kind}-XXXX`` directory in ``parent`` (``kind``: tmp or old)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.{kind}-", dir=parent))
    (tmp / MARKER).write_text(json.dumps({"target": name, "pid": os.getpid(), "host": socket.gethostname()}))
    return tmp


def _writer_gone(info: dict) -> bool:
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False  # another machine's save (shared file system), or not our marker
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    return False


def _marker(path: Path) -> dict | None:
    try:
        info = json.loads((path / MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return info if isinstance(info, dict) else None


def sweep(parent: Path, name: str, complete: str = "config.json") -> list[Path]:
    """Remove the leftovers of killed saves of ``parent / name``; returns what was removed."""
    removed = []
    for entry in sorted(parent.glob(f".{glob.escape(name)}.*-*")):
        kind = entry.name[len(name) + 2:].split("-", 1)[0]
        if kind not in ("tmp", "old") or entry.is_symlink() or not entry.is_dir():
            continue
        info = _marker(entry)
        if info is None or info.get("target") != name or not _writer_gone(info):
            continue
        if kind == "old" and not (parent / name / complete).is_file():
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed
