"""``FLASHRT_JIT_LOG=FILE``: one JSON line per Triton kernel variant this process compiles or loads
from the cache, with the wall time it finished and how long it took; a diagnostic for compiles that
happen where none should (a serving level after its warm-up, a captured step).

Triton calls ``jit_cache_hook`` before it builds a variant the process has not loaded yet and
``jit_post_compile_hook`` after; the time between them is the compile (or, on a disk-cache hit,
the load). Hooks already set are kept and called first. Each line::

    {"t": <unix time at the end>, "s": <seconds>, "pid": ..., "module": ..., "name": ...,
     "repr": <Triton's description: launch options and argument types>,
     "key": <Triton's specialisation key, as text>}

The file is appended to (several processes may share it: each line is one ``write`` of a
line-buffered file), and created if missing; nothing is ever truncated.
"""
from __future__ import annotations

import json
import os
import threading
import time

ENV = "FLASHRT_JIT_LOG"
_INSTALLED: dict = {}


def _name(fn) -> tuple[str, str]:
    """Module and name of the hooks' ``fn`` (Triton's ``JitFunctionInfo``)."""
    return str(getattr(fn, "module", "?")), str(getattr(fn, "name", fn))


class JitLog:
    """Appends a line to ``path`` for every variant built while installed (``close()`` unhooks)."""

    def __init__(self, path: str):
        from triton import knobs

        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"{ENV}: expected a file in an existing folder, got {path!r}")
        self.path, self._knobs = path, knobs
        self._file = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self._started: dict = {}
        self._prev_cache = knobs.runtime.jit_cache_hook
        self._prev_post = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *args, **kwargs):
        self._started[(*_name(kwargs.get("fn")), str(kwargs.get("key")))] = time.perf_counter()
        return self._prev_cache(*args, **kwargs) if self._prev_cache is not None else None

    def _after(self, *args, **kwargs):
        result = self._prev_post(*args, **kwargs) if self._prev_post is not None else None
        module, name = _name(kwargs.get("fn"))
        key = str(kwargs.get("key"))
        start = self._started.pop((module, name, key), None)
        line = {"t": round(time.time(), 3), "s": None if start is None else round(time.perf_counter() - start, 4),
                "pid": os.getpid(), "module": module, "name": name, "repr": str(kwargs.get("repr")), "key": key}
        with self._lock:
            self._file.write(json.dumps(line) + "\n")
        return result

    def close(self) -> None:
        runtime = self._knobs.runtime
        if runtime.jit_cache_hook == self._before:
            runtime.jit_cache_hook = self._prev_cache
        if runtime.jit_post_compile_hook == self._after:
            runtime.jit_post_compile_hook = self._prev_post
        self._file.close()


def install_from_env() -> JitLog | None:
    """Start the log ``FLASHRT_JIT_LOG`` names (once per process and path); None when unset."""
    path = os.environ.get(ENV, "").strip()
    if not path:
        return None
    key = (os.getpid(), os.path.abspath(path))
    if key not in _INSTALLED:
        _INSTALLED[key] = JitLog(path)
    return _INSTALLED[key]


def read(path: str) -> list[dict]:
    """The log's lines (a torn last line, from a process killed mid-write, is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def between(rows: list[dict], start: float, end: float) -> list[dict]:
    """The variants first built in ``[start, end)`` (unix times): what a timed window compiled."""
    return [r for r in rows if start <= r["t"] < end]
