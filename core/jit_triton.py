"""Triton's compile cache, kept in flashrt's (``flashrt.jit.install()`` selects it).

Triton loads a cache manager class from ``TRITON_CACHE_MANAGER="module:Class"`` (read on every
lookup through ``triton.knobs.cache.manager_class`` in Triton 3.4+, so setting the variable at run
time works) and asks it for files by path: ``CompiledKernel`` reads the paths a group lists. So
artifacts stay plain files, under ``<cache root>/triton/<Triton's key>/``, each written atomically
(temp + fsync + rename) with a ``.<name>.sha256`` sidecar written after it; a file whose checksum
fails, or that has no sidecar (a writer died between the two), is treated as absent, dropped and
recompiled. Triton's key already covers the source, constexprs and signature, the target
(``sm_90``), the compile options (warps, stages) and the Triton version.

Compiling one key once across processes: ``compile()`` calls ``get_group`` before it compiles and
``put_group`` after, then reads the group's files (``CompiledKernel``) and drops the manager. On a
miss, ``get_group`` takes the key's file lock exclusively and holds it until the manager is
collected (after that read; also after a compile error); the other processes wait in
``get_group`` and then find the group. On a hit it holds the lock shared until the manager is
collected (``compile()`` reads the group's files after ``get_group`` returns). So a concurrent
``flashrt jit clear`` never removes files that a compile is about to read (:mod:`flashrt.jit_locks`). The compiling process
removes the temporary files of writers that died under the key's lock. A forked child holds none
of its parent's locks: it drops the descriptors it inherited and takes its own.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
import weakref
from pathlib import Path

try:
    from triton.runtime.cache import CacheManager, FileCacheManager
except ImportError:  # no Triton: listing the cache still works, the manager is never selected
    CacheManager, FileCacheManager = object, None

from .jit import EntryInfo, atomic_write, cache_root
from .jit_locks import children, lock_file

log = logging.getLogger("flashrt")

MANAGER_SPEC = "flashrt.jit_triton:TritonCacheManager"
INTERPRET_ENV = "TRITON_INTERPRET"
_TEMP = re.compile(r"\.tmp\.\d+\.[0-9a-f]{8}$")  # the temporary name of flashrt.jit.atomic_write


def interpreted() -> bool:
    """Triton runs kernels in its interpreter (numpy on the CPU): ``TRITON_INTERPRET=1``, which
    must be set before Triton is imported. The one place flashrt asks."""
    return os.environ.get(INTERPRET_ENV) == "1"


_HELD: set[str] = set()  # keys whose lock this process holds (no waiting on ourselves)
COMPILED: list[str] = []  # kernels this process compiled (wrote a group for), in order: see compiled_here()
_MANAGERS: "weakref.WeakSet[TritonCacheManager]" = weakref.WeakSet()  # live managers (for fork)
_CACHED_ONLY = threading.local()  # .on: this thread's compiles may only load from the cache (cached_only)
_LOOKED_UP = threading.local()  # .key: the key this thread's last get_group asked for (see last_key())


class NotCached(Exception):
    """Under :func:`cached_only`: the variant is not in the compile cache, or a compile of it (or
    a clear) holds its lock now."""


@contextlib.contextmanager
def cached_only():
    """In this thread, inside the block, a ``triton.compile`` whose result is not in the cache
    raises :class:`NotCached` before any compile work (from ``get_group``), and never waits on the
    key's lock: what a background preload of cached variants needs (:mod:`flashrt.jit_preload`)."""
    _CACHED_ONLY.on = True
    try:
        yield
    finally:
        _CACHED_ONLY.on = False


def _forget_inherited_locks() -> None:
    """In a forked child: the parent's lock descriptors are the parent's (closing the child's copy
    leaves the parent's lock held); the child takes its own locks, waiting like any process."""
    for manager in list(_MANAGERS):
        for attr in ("_lock_fd", "_read_fd"):
            fd = getattr(manager, attr, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(manager, attr, None)
    _HELD.clear()
    COMPILED.clear()


os.register_at_fork(after_in_child=_forget_inherited_locks)


def _sidecar(path: str) -> str:
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.sha256")


class TritonCacheManager(CacheManager):
    """Triton's ``CacheManager`` over flashrt's cache directory, with checksums and compile locks."""

    def __init__(self, key, override=False, dump=False):
        self.key = key
        self._plain = FileCacheManager(key, override=override, dump=dump) if (override or dump) else None
        self.cache_dir = str(cache_root() / "triton" / key)  # made by the first put (a clear may remove it)
        self._lock_fd: int | None = None   # the key's lock, exclusive: this process compiles it
        self._read_fd: int | None = None   # the key's lock, shared: Triton reads the group's files
        _MANAGERS.add(self)

    def _path(self, filename: str) -> str:
        return os.path.join(self.cache_dir, filename)

    def _verified(self, filename: str) -> str | None:
        path = self._path(filename)
        try:
            with open(_sidecar(path)) as f:
                want = f.read().strip()
            with open(path, "rb") as f:
                have = hashlib.sha256(f.read()).hexdigest()
        except FileNotFoundError:
            return None
        if have != want:
            log.warning("flashrt.jit: dropping corrupt Triton artifact %s (checksum mismatch)", path)
            for p in (path, _sidecar(path)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            return None
        return path

    def get_file(self, filename):
        if self._plain is not None:
            return self._plain.get_file(filename)
        return self._verified(filename)

    def put(self, data, filename, binary=True) -> str:
        if self._plain is not None:
            return self._plain.put(data, filename, binary)
        data = data if isinstance(data, bytes) else str(data).encode()
        path = self._path(filename)
        atomic_write(Path(path), data)
        atomic_write(Path(_sidecar(path)), hashlib.sha256(data).hexdigest().encode())
        return path

    def _read_group(self, filename: str) -> dict | None:
        grp = self._verified(f"__grp__{filename}")
        if grp is None:
            return None
        try:
            with open(grp) as f:
                children = json.load(f)["child_paths"]
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(children, dict) or not all(isinstance(v, str) for v in children.values()):
            return None  # a group of another layout: a miss, compiled again
        result = {}
        for name, stored in children.items():
            path = self._verified(os.path.basename(stored))
            if path is None:
                return None
            result[name] = path
        return result

    def get_group(self, filename):
        if self._plain is not None:
            return self._plain.get_group(filename)
        _LOOKED_UP.key = self.key
        if getattr(_CACHED_ONLY, "on", False):
            return self._cached_group(filename)
        self._acquire(shared=True)
        group = self._read_group(filename)
        if group is None:
            self._release()
            self._acquire()  # a miss: this process compiles, others wait here until it is done
            group = self._read_group(filename)  # (found: compiled meanwhile; held until collected)
            if group is None and self._lock_fd is not None:
                self._sweep_dead_writes()
        return group

    def _cached_group(self, filename):
        """``get_group`` under :func:`cached_only`: the group read under the key's shared lock
        taken without waiting, else :class:`NotCached` (nothing held)."""
        if self.key in _HELD or not self._acquire(shared=True, wait=False):
            raise NotCached(self.key)
        group = self._read_group(filename)
        if group is None:
            self._release()
            raise NotCached(self.key)
        return group

    def _sweep_dead_writes(self) -> None:
        """Remove temporary files of writes that never finished: only the holder of the key's
        exclusive lock writes here, so with it held, any there is a dead writer's."""
        for path in children(Path(self.cache_dir)):
            if _TEMP.search(path.name) and path.is_file():
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def put_group(self, filename, group):
        COMPILED.append(filename.removesuffix(".json"))  # a group is put after a compile, never on a hit
        if self._plain is not None:
            return self._plain.put_group(filename, group)
        children = {name: os.path.basename(path) for name, path in group.items()}
        # the key's lock stays held: compile() reads these files next (CompiledKernel), then drops us
        return self.put(json.dumps({"child_paths": children}), f"__grp__{filename}", binary=False)

    def _acquire(self, shared: bool = False, wait: bool = True) -> bool:
        """Take the key's lock (``wait`` False: only if it is free now); whether it is held after
        (a lock that cannot be taken while waiting is logged and gone on without)."""
        if self._lock_fd is not None or self._read_fd is not None or self.key in _HELD:
            return True
        lock = cache_root() / "locks" / f"triton-{self.key}.lock"
        limit = float(os.environ.get("FLASHRT_JIT_LOCK_TIMEOUT", "600")) if wait else 0.0
        try:
            fd = lock_file(lock, shared, time.monotonic() + limit)
        except OSError as exc:  # e.g. a link or a directory where the lock file goes
            log.warning("flashrt.jit: cannot lock %s (%s); going on without the lock", lock, exc)
            return False
        if fd is None:
            if wait:
                log.warning("flashrt.jit: waited too long for %s; going on without the lock", lock)
            return False
        if shared:
            self._read_fd = fd
        else:
            self._lock_fd = fd
        _HELD.add(self.key)
        return True

    def _release(self) -> None:
        for attr in ("_lock_fd", "_read_fd"):
            fd = getattr(self, attr, None)
            if fd is not None:
                os.close(fd)
                setattr(self, attr, None)
                _HELD.discard(self.key)

    def __del__(self):
        self._release()


def _group_info(key_dir: Path, grp: Path) -> tuple[str, str]:
    kernel = grp.name[len("__grp__"):].removesuffix(".json")
    try:
        target = json.loads((key_dir / f"{kernel}.json").read_text()).get("target", {})
        arch = target.get("arch")
        arch = f"sm_{arch}" if target.get("backend") == "cuda" else f"{target.get('backend')}:{arch}"
    except (OSError, ValueError, AttributeError):
        arch = "?"
    return kernel, arch


def triton_entries(root: Path) -> list[EntryInfo]:
    """One line per Triton key directory: kernel, target architecture, size, age. Anything else
    under ``root`` (stray files, empty or unreadable directories, files removed meanwhile) is skipped."""
    return [e for e in map(_key_entry, children(root)) if e is not None]


def _key_entry(key_dir: Path) -> EntryInfo | None:
    try:
        if key_dir.is_symlink() or not key_dir.is_dir():
            return None
        stats = {}
        for p in key_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                st = p.lstat()
                if stat.S_ISREG(st.st_mode):
                    stats[p.name] = st
    except OSError:
        return None
    files = {name: st for name, st in stats.items() if not name.startswith(".")}
    if not files:
        return None
    groups = sorted(name for name in files if name.startswith("__grp__"))
    kernel, arch = _group_info(key_dir, key_dir / groups[0]) if groups else (min(files), "-")
    return EntryInfo(key_dir.name, "triton", kernel, arch, sum(st.st_size for st in stats.values()),
                     max(st.st_mtime for st in files.values()), str(key_dir))


def last_key() -> str | None:
    """Triton's cache key of the variant this thread's last ``triton.compile`` looked up (compiled or
    loaded) through flashrt's cache; None before any. A diagnostic (:mod:`flashrt.jit_log`): it
    names the variant across processes, where Triton's in-memory key names it in one."""
    return getattr(_LOOKED_UP, "key", None)


def compiled_here() -> list[str]:
    """The kernels this process compiled itself through flashrt's cache (not found there), in order."""
    return list(COMPILED)


def stable_hashes() -> bool:
    """Make Triton's hash of a ``triton.jit`` function independent of the order functions are first
    hashed in; whether the hook is in place.

    A function's hash (``JITFunction.cache_key``, part of every compile's cache key) covers the
    constexpr globals used by it and by the functions it calls. Some Triton releases (3.6, the GPU
    image's) merge a callee's globals into the caller's before they hash the callee, so a callee
    hashed for the first time then contributes none: the caller's hash depends on whether another
    kernel had hashed that callee before. Two processes that compile in different orders (a run and
    its compile pool) then name one variant by two keys, and the run compiles again what the pool
    compiled. Hashing the callee first makes every hash cover all its callees' globals, whatever the
    order."""
    try:
        from triton.runtime import jit as triton_jit
    except ImportError:
        return False
    finder = getattr(triton_jit, "DependenciesFinder", None)
    update = getattr(finder, "_update_hash", None)
    if update is None:
        return False
    if getattr(update, "flashrt_stable", False):
        return True

    def _update_hash(self, func):
        func.cache_key  # noqa: B018 - the callee's hash first: it fills in the globals the merge reads
        return update(self, func)

    _update_hash.flashrt_stable = True
    finder._update_hash = _update_hash
    return True


def install(force: bool = False) -> bool:
    stable_hashes()  # every process using the cache names a variant by one key (see stable_hashes)
    current = os.environ.get("TRITON_CACHE_MANAGER")
    if current and current != MANAGER_SPEC and not force:
        log.warning("flashrt.jit: TRITON_CACHE_MANAGER=%s is set; not replacing it", current)
        return False
    os.environ["TRITON_CACHE_MANAGER"] = MANAGER_SPEC
    return True


def uninstall() -> None:
    if os.environ.get("TRITON_CACHE_MANAGER") == MANAGER_SPEC:
        del os.environ["TRITON_CACHE_MANAGER"]
