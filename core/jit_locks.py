"""Per-key lock files of the compile cache, and clearing the cache while other processes use it.

A key's lock is an fcntl lock on ``<root>/locks/<name>.lock``: held exclusively by the process
that compiles the key (from its miss until its artifacts are written) and shared by a process that
reads a Triton group (Triton reads the files after ``get_group`` returns).

Clearing (:func:`clear_cache`) follows three rules, so that a lock file is never removed while a
process holds it (a second compiler would then lock a new file of the same name and compile the
key at the same time):

- a key's files and its lock file are removed only while the clear holds that lock itself;
  a lock file may thus be unlinked while another process waits on it, so :func:`lock_file` checks
  after locking that the path still names the file it locked, and opens it again if not;
- what a clear removes without a lock (anything flashrt does not write) is chosen by one
  ``lstat`` and removed as what it was then: a path that has vanished meanwhile is skipped, a
  directory is emptied and removed but never unlinked as a file, a file is unlinked but never
  walked as a directory (a compile may have re-created ``locks/`` or a lock file at that name);
- clears run one at a time (an fcntl lock on the cache root directory, which a clear never
  removes), so between a clear's ``lstat`` and its removal only compiles act, and they only add.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from pathlib import Path


OPEN_ATTEMPTS = 50  # directory re-creations a lock tries while clears remove the directory


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
    when ``deadline`` passes first. Closing the descriptor (or the process dying) releases it.
    OSError if ``path`` cannot be a lock file (a link or a directory is there)."""
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    attempt = 0
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # never through a link
        except (FileNotFoundError, FileExistsError):  # a clear removed the (empty) directory meanwhile
            attempt += 1  # (mkdir says FileExistsError when it goes between its mkdir and its check,
            if attempt >= OPEN_ATTEMPTS:  # and for good when a file stands where the directory goes)
                raise
            time.sleep(0.001 * attempt)
            continue
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


class Tally:
    """What a clear removed and kept."""

    def __init__(self):
        self.files = self.bytes = self.kept = 0

    def unlink(self, path: str) -> None:
        """Remove one file or link (never what a link points to, never a directory); one already
        gone, or replaced by a directory meanwhile, is not counted."""
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
        except (FileNotFoundError, IsADirectoryError):
            return
        self.files += 1
        self.bytes += size


def remove_tree(path: str, tally: Tally, kind: str | None = "") -> None:
    """Remove ``path`` as what it was when looked at (``kind`` from :func:`_kind`; default: look
    now): a directory tree (emptied bottom-up, never unlinked as a file), else a file or link
    (never walked). Gone: nothing to do."""
    kind = _kind(Path(path)) if kind == "" else kind
    if kind is None:
        return
    if kind != "dir":
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
    with contextlib.suppress(FileNotFoundError, OSError):  # gone, refilled by a writer, or a file now: kept
        os.rmdir(path)


def children(path: Path) -> list[Path]:
    """What ``path`` holds, sorted; nothing if it is not a readable directory (or vanished)."""
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


def _kind(path: Path) -> str | None:
    """``dir``, ``file`` (regular), ``other`` (a link, a fifo, ...) or None (gone), by one lstat."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def _remove_locked(lock: Path, targets: list[Path], tally: Tally) -> None:
    """Remove ``targets`` and then ``lock`` while holding the lock; keep them if it is held (or
    cannot be taken: a link or a directory at the lock's path). A lock file made here only to
    hold it is removed without being counted."""
    existed = os.path.lexists(lock)
    try:
        fd = lock_file(lock, deadline=0.0)
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            fd = None
        else:  # no lock can exist for this name: nothing can be using it
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


@contextlib.contextmanager
def _one_clear_at_a_time(root: Path):
    """Hold an exclusive fcntl lock on the directory ``root`` (never removed by a clear) for the
    block; where the file system cannot lock a directory, go on without it."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        fd = None
    try:
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def clear_cache(root: Path) -> Tally:
    """Remove everything under ``root`` (the JIT cache root) that no process is using.

    ``triton/<key>/`` goes under the lock ``locks/triton-<key>.lock``; idle lock files go last,
    each under its own lock; anything else (flashrt writes nothing else here) at once. ``root``
    stays. Other clears wait; compiles and loads go on."""
    tally, locks = Tally(), root / "locks"
    with _one_clear_at_a_time(root):
        for child in children(root):
            kind = _kind(child)
            if child.name not in ("triton", "locks") or kind != "dir":
                remove_tree(str(child), tally, kind)
        for key_dir in children(root / "triton"):
            _remove_locked(locks / f"triton-{key_dir.name}.lock", [key_dir], tally)
        for lock in children(locks):
            kind = _kind(lock)
            if kind == "file":
                _remove_locked(lock, [], tally)
            else:  # never a lock (compiles cannot lock a link or a directory), or gone
                remove_tree(str(lock), tally, kind)
        for sub in ("triton", "locks"):
            _rmdir(str(root / sub))
    return tally
