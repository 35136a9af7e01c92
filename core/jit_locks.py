"""Per-key lock files of the compile cache, and clearing the cache while other processes use it.

A key's lock is an fcntl lock on ``<root>/locks/<name>.lock``: held exclusively by the process
that compiles the key (from its miss until its entry is written) and shared by a process that
reads a Triton group (Triton reads the files after ``get_group`` returns). :func:`clear_cache`
removes a key's files and its lock file only while holding that lock itself, and keeps what is
in use. A lock file may thus be unlinked while another process waits on it, so :func:`lock_file`
checks after locking that the path still names the file it locked, and opens it again if not:
two processes never hold "the" lock of one key on two different files.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _flock(fd: int, mode: int, deadline: float | None) -> bool:
    """Lock ``fd``; wait until ``deadline`` (``time.monotonic()``; None: forever). False on timeout."""
    if deadline is None:
        fcntl.flock(fd, mode)
        return True
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def lock_file(path: Path, shared: bool = False, deadline: float | None = None) -> int | None:
    """A descriptor holding an fcntl lock on the file at ``path`` (created if missing), or None
    when ``deadline`` passes first. Closing the descriptor (or the process dying) releases it."""
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except (FileNotFoundError, FileExistsError):  # a clear removed the (empty) directory meanwhile
            continue  # (mkdir says FileExistsError when it goes between its mkdir and its check)
        try:
            if not _flock(fd, mode, deadline):
                os.close(fd)
                return None
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # unlinked by a clear while we waited: lock the file now at the path


@contextlib.contextmanager
def file_lock(path: Path, shared: bool = False):
    """An fcntl lock on ``path`` (created if missing) for the block; released on exit or death."""
    fd = lock_file(Path(path), shared)
    try:
        yield
    finally:
        os.close(fd)


class Tally:
    """What a clear removed and kept."""

    def __init__(self):
        self.files = self.bytes = self.kept = 0

    def unlink(self, path: str) -> None:
        """Remove one file or link (never what a link points to); one already gone is not counted."""
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return
        self.files += 1
        self.bytes += size


def remove_tree(path: str, tally: Tally) -> None:
    """Remove ``path`` (a file, a link or a directory tree), tolerating files that vanish meanwhile."""
    if os.path.islink(path) or not os.path.isdir(path):
        tally.unlink(path)
        return
    for top, dirs, files in os.walk(path, topdown=False):
        for name in files:
            tally.unlink(os.path.join(top, name))
        for name in dirs:
            sub = os.path.join(top, name)
            if os.path.islink(sub):
                tally.unlink(sub)
            else:
                _rmdir(sub)
    _rmdir(path)


def _rmdir(path: str) -> None:
    with contextlib.suppress(FileNotFoundError, OSError):  # gone, or refilled by a writer: kept
        os.rmdir(path)


def children(path: Path) -> list[Path]:
    """What ``path`` holds, sorted; nothing if it is not a readable directory (or vanished)."""
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


def _remove_locked(lock: Path, targets: list[Path], tally: Tally) -> None:
    """Remove ``targets`` and then ``lock`` while holding the lock; keep them if it is held. A
    lock file made here only to hold it is removed without being counted."""
    existed = os.path.lexists(lock)
    try:
        fd = lock_file(lock, deadline=0.0)
    except OSError:  # no lock can exist for this name (e.g. too long): nothing can be using it
        fd = -1
    if fd is None:
        tally.kept += 1
        return
    try:
        for target in targets:
            remove_tree(str(target), tally)
        if fd >= 0:
            (tally if existed else Tally()).unlink(str(lock))
    finally:
        if fd >= 0:
            os.close(fd)


def clear_cache(root: Path) -> Tally:
    """Remove everything under ``root`` (the JIT cache root) that no process is using.

    ``entries/<xx>/<key>.bin*`` go under the lock ``locks/<key>.lock``, ``triton/<key>/`` under
    ``locks/triton-<key>.lock``; idle lock files go last, anything else at once. ``root`` stays."""
    tally, locks = Tally(), root / "locks"
    for child in children(root):
        if child.name not in ("entries", "triton", "locks") or child.is_symlink() or not child.is_dir():
            remove_tree(str(child), tally)
    for shard in children(root / "entries"):
        if shard.is_symlink() or not shard.is_dir():
            remove_tree(str(shard), tally)
            continue
        for item in children(shard):
            _remove_locked(locks / f"{item.name.split('.', 1)[0]}.lock", [item], tally)
        _rmdir(str(shard))
    for key_dir in children(root / "triton"):
        _remove_locked(locks / f"triton-{key_dir.name}.lock", [key_dir], tally)
    for lock in children(locks):
        if lock.is_symlink() or not lock.is_file():
            remove_tree(str(lock), tally)
        else:
            _remove_locked(lock, [], tally)
    for sub in ("entries", "triton", "locks"):
        _rmdir(str(root / sub))
    return tally
