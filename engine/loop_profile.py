"""``FLASHRT_PROFILE_ENGINE=FILE``: profile the engine's loop thread (``cProfile``) while it runs
and write the statistics to ``FILE`` (``pstats`` format) when it stops. A diagnostic for serving
(where the loop thread shares the interpreter with the HTTP event loop): read the file with
``python -m pstats FILE``. The file must not exist yet (nothing is overwritten)."""
from __future__ import annotations

import contextlib
import cProfile
import os

ENV = "FLASHRT_PROFILE_ENGINE"


def new_file_from_env(env: str) -> str | None:
    """The path in environment variable ``env``, checked to be a new file in an existing folder;
    None when it is unset or empty."""
    path = os.environ.get(env)
    if not path:
        return None
    if os.path.exists(path):
        raise ValueError(f"{env}: expected a path that does not exist yet, got {path!r} (it exists)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{env}: expected a file in an existing folder, got {path!r}")
    return path


def profile_path() -> str | None:
    """The file to write, checked; None when profiling is off."""
    return new_file_from_env(ENV)


@contextlib.contextmanager
def profiled(path: str | None):
    """Profile the calling thread inside the block when ``path`` is set; write the statistics after."""
    if path is None:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        if not os.path.exists(path):
            prof.dump_stats(path)
