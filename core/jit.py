"""The JIT compile cache: Triton's compiled kernels kept on disk, built once per key across processes.

Layout under ``FLASHRT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flashrt``, i.e. ``~/.cache/flashrt``)::

    jit/triton/<key>/...            Triton's artifacts, each with a sha256 sidecar
                                    (see :mod:`flashrt.jit_triton`)
    jit/locks/triton-<key>.lock     fcntl lock files, one per key (see :mod:`flashrt.jit_locks`)

``install()`` routes Triton's compiles through this cache; ``JitCache`` lists it (``flashrt jit
ls``) and empties it (``flashrt jit clear``) safely while other processes compile. Files here are
written with :func:`atomic_write`, so a reader sees a whole file or none.
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .jit_locks import clear_cache


def cache_root() -> Path:
    """``$FLASHRT_CACHE_DIR/jit`` (default ``~/.cache/flashrt/jit``)."""
    base = os.environ.get("FLASHRT_CACHE_DIR")
    if not base:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashrt"
    return Path(base).expanduser() / "jit"


WRITE_ATTEMPTS = 50  # directory re-creations a write tries while concurrent clears remove it


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see all of it or nothing (temp + fsync + rename).
    A directory removed meanwhile (a concurrent ``jit clear`` removes empty ones) is made again."""
    for attempt in range(WRITE_ATTEMPTS):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_replace(path, data)
            break
        except (FileNotFoundError, FileExistsError):  # FileExistsError: mkdir met a vanishing parent
            if attempt == WRITE_ATTEMPTS - 1:
                raise
            time.sleep(0.001 * attempt)  # a clear sweeping empty directories: let it pass
    with contextlib.suppress(FileNotFoundError):  # the directory went with the file: nothing to sync
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _write_replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@dataclass
class EntryInfo:
    """One line of ``flashrt jit ls``: one Triton key directory."""

    key: str
    kind: str          # the compiler that made it: "triton"
    kernel: str
    arch: str
    size: int
    mtime: float
    path: str


class JitCache:
    """The compile cache under ``root`` (default :func:`cache_root`): list it, empty it."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else cache_root()

    def entries(self) -> list[EntryInfo]:
        """Every compiled kernel in the cache, newest first."""
        from .jit_triton import triton_entries

        return sorted(triton_entries(self.root / "triton"), key=lambda e: -e.mtime)

    def clear(self) -> tuple[int, int, int]:
        """Remove everything under the cache root (and nothing else) that no process is using:
        (files removed, bytes freed, items kept because a compile or a load holds their lock).
        Safe while other processes compile, load or clear (:func:`flashrt.jit_locks.clear_cache`)."""
        if not self.root.is_dir():
            return 0, 0, 0
        tally = clear_cache(self.root)
        return tally.files, tally.bytes, tally.kept


def install(force: bool = False) -> bool:
    """Route Triton's compile cache through ours (sets ``TRITON_CACHE_MANAGER``; children inherit
    it); True if installed. A user's own ``TRITON_CACHE_MANAGER`` is kept unless ``force``."""
    from .jit_log import install_from_env
    from .jit_triton import install as _install

    install_from_env()  # FLASHRT_JIT_LOG: a line per variant built (a diagnostic; off by default)
    return _install(force)


def uninstall() -> None:
    from .jit_triton import uninstall as _uninstall

    _uninstall()


def warmup(profile=None, targets=None, progress=None) -> dict:
    """Compile every kernel ``profile`` needs ahead of time; see :func:`flashrt.jit_warmup.warmup`."""
    from .jit_warmup import warmup as _warmup

    return _warmup(profile, targets, progress)
