"""``FLASHRT_JIT_LOG=FILE``: one JSON line per Triton kernel variant this process compiles or loads
from the cache, with the wall time it finished and how long it took; a diagnostic for compiles that
happen where none should (a serving level after its warm-up, a captured step).

Triton calls ``jit_cache_hook`` before it builds a variant the process has not loaded yet and
``jit_post_compile_hook`` after; the time between them is the compile (or, on a disk-cache hit,
the load). Hooks already set are kept and called first. Each line::

    {"t": <unix time at the end>, "s": <seconds>, "pid": ..., "module": ..., "name": ...,
     "repr": <Triton's description: launch options and argument types>,
     "key": <Triton's specialisation key, as text>,
     "cache_key": <Triton's cache key (the compile cache's folder name): the same in every process>,
     "compiled": <whether this process compiled it, not found in the cache>}

Each line also has ``parts``: the pieces Triton's cache key is made of (the source and
specialization hash, the backend's, the options', the cache-invalidating environment), and
``plan_parts``: the same for the variant after a plan's round trip (its specialization data written
and decoded as :mod:`flashrt.jit_plans` does). A pool line has the ``parts`` its worker computed.
Where a run's key and a worker's differ for one variant, the differing part names the cause.

The compile pool (:mod:`flashrt.jit_parallel`) adds a line per variant its workers finished, written
by the parent: ``"pool": true``, the worker's ``pid``, ``submitted`` and ``start`` (unix times: when
the variant was queued and when a worker began it), ``t``, ``s``, ``cache_key`` and ``compiled``
(False: a worker found it in the cache, compiled by another process first). Two lines of one
``cache_key`` tell whether the run waited on the pool, raced it or compiled what the pool never had.

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
        from .jit_triton import COMPILED

        self._started[(*_name(kwargs.get("fn")), str(kwargs.get("key")))] = (time.perf_counter(), len(COMPILED))
        return self._prev_cache(*args, **kwargs) if self._prev_cache is not None else None

    def _after(self, *args, **kwargs):
        result = self._prev_post(*args, **kwargs) if self._prev_post is not None else None
        module, name = _name(kwargs.get("fn"))
        key = str(kwargs.get("key"))
        from .jit_triton import COMPILED, last_key

        start, count = self._started.pop((module, name, key), (None, None))
        line = {"t": round(time.time(), 3), "s": None if start is None else round(time.perf_counter() - start, 4),
                "pid": os.getpid(), "module": module, "name": name, "repr": str(kwargs.get("repr")), "key": key,
                "cache_key": last_key(), "compiled": None if count is None else len(COMPILED) > count}
        line |= _launch_parts(kwargs)
        self.write(line)
        return result

    def write(self, line: dict) -> None:
        """Append one line (a JSON object) to the log."""
        with self._lock:
            self._file.write(json.dumps(line) + "\n")

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


def key_parts(src, backend, options) -> dict:
    """The pieces of Triton's cache key for ``src`` compiled by ``backend`` with ``options`` (a
    parsed options object), each shortened to a digest: ``triton`` (the installation's key), ``src``
    (source, signature, constexprs, attributes), ``backend`` (the assembler's version, the target),
    ``options``, ``env`` (the cache-invalidating environment variables set); and ``cache_key``, the
    cache folder name they make (as ``triton.compile`` names it)."""
    import hashlib

    from triton.compiler.compiler import get_cache_invalidating_env_vars
    from triton.runtime.cache import _base32, triton_key

    digest = lambda text: hashlib.sha256(str(text).encode()).hexdigest()[:16]  # noqa: E731
    env = str(sorted(get_cache_invalidating_env_vars().items()))
    pieces = (triton_key(), src.hash(), backend.hash(), options.hash(), env)
    return {"triton": digest(pieces[0]), "src": digest(pieces[1]), "backend": digest(pieces[2]),
            "options": digest(pieces[3]), "env": env,
            "cache_key": _base32(hashlib.sha256("-".join(map(str, pieces)).encode()).hexdigest())}


def _launch_parts(kwargs: dict) -> dict:
    """``parts`` (the launch's own source and specialization; its options as the specialization
    data lists them) and ``plan_parts`` (after a plan's round trip) of the variant a post-compile
    hook reports (see the module doc); a ``parts_error`` instead when they cannot be computed (a
    diagnostic never fails a launch)."""
    try:
        from types import SimpleNamespace

        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver

        from .jit_compile import source
        from .jit_plans import decode

        fn, compiled = kwargs["fn"].jit_function, kwargs["compile"]
        backend = make_backend(driver.active.get_current_target())
        entry = {"module": fn.__module__, "name": getattr(fn, "fn", fn).__qualname__,
                 "data": compiled["specialization_data"]}
        spec = decode(entry, SimpleNamespace(cc=backend.target.arch))
        options = backend.parse_options(dict(spec.options))
        parts = key_parts(source(fn, compiled["signature"], compiled["constants"], compiled["configs"][0]), backend,
                          options)
        planned = key_parts(source(fn, spec.signature, spec.constexprs, spec.attrs), backend, options)
        return {"parts": parts, "plan_parts": planned}
    except Exception as exc:
        return {"parts_error": f"{type(exc).__name__}: {exc}"}


def active() -> JitLog | None:
    """This process's log, when ``FLASHRT_JIT_LOG`` names one and it was started here (None otherwise)."""
    path = os.environ.get(ENV, "").strip()
    return _INSTALLED.get((os.getpid(), os.path.abspath(path))) if path else None


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
