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
``put_group`` after. On a miss, ``get_group`` takes the key's file lock and holds it until
``put_group`` (or until the manager is collected, e.g. after a compile error); the other processes
wait in ``get_group`` and then find the group.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path

try:
    from triton.runtime.cache import CacheManager, FileCacheManager
except ImportError:  # no Triton: listing the cache still works, the manager is never selected
    CacheManager, FileCacheManager = object, None

from .jit import EntryInfo, atomic_write, cache_root

log = logging.getLogger("flashrt")

MANAGER_SPEC = "flashrt.jit_triton:TritonCacheManager"
INTERPRET_ENV = "TRITON_INTERPRET"


def interpreted() -> bool:
    """Triton runs kernels in its interpreter (numpy on the CPU): ``TRITON_INTERPRET=1``, which
    must be set before Triton is imported. The one place flashrt asks."""
    return os.environ.get(INTERPRET_ENV) == "1"

_HELD: set[str] = set()  # keys whose compile lock this process holds (no waiting on ourselves)


def _sidecar(path: str) -> str:
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.sha256")


class TritonCacheManager(CacheManager):
    """Triton's ``CacheManager`` over flashrt's cache directory, with checksums and compile locks."""

    def __init__(self, key, override=False, dump=False):
        self.key = key
        self._plain = FileCacheManager(key, override=override, dump=dump) if (override or dump) else None
        self.cache_dir = str(cache_root() / "triton" / key)
        os.makedirs(self.cache_dir, exist_ok=True)
        self._lock_fd: int | None = None

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
        group = self._read_group(filename)
        if group is None:
            self._acquire()  # a miss: this process compiles, others wait here until put_group
            group = self._read_group(filename)
            if group is not None:
                self._release()
        return group

    def put_group(self, filename, group):
        if self._plain is not None:
            return self._plain.put_group(filename, group)
        children = {name: os.path.basename(path) for name, path in group.items()}
        try:
            return self.put(json.dumps({"child_paths": children}), f"__grp__{filename}", binary=False)
        finally:
            self._release()

    def _acquire(self) -> None:
        if self._lock_fd is not None or self.key in _HELD:
            return
        lock = cache_root() / "locks" / f"triton-{self.key}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + float(os.environ.get("FLASHRT_JIT_LOCK_TIMEOUT", "600"))
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("flashrt.jit: waited too long for %s; compiling without the lock", lock)
                    os.close(fd)
                    return
                time.sleep(0.02)
        self._lock_fd = fd
        _HELD.add(self.key)

    def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
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
    """One line per Triton key directory: kernel, target architecture, size, age."""
    out = []
    for key_dir in sorted(root.glob("*")) if root.is_dir() else ():
        files = [p for p in key_dir.iterdir() if p.is_file() and not p.name.startswith(".")]
        if not files:
            continue
        groups = [p for p in files if p.name.startswith("__grp__")]
        kernel, arch = _group_info(key_dir, groups[0]) if groups else (files[0].name, "-")
        size = sum(p.stat().st_size for p in key_dir.iterdir() if p.is_file())
        mtime = max(p.stat().st_mtime for p in files)
        out.append(EntryInfo(key_dir.name, "triton", kernel, arch, size, mtime, str(key_dir)))
    return out


def install(force: bool = False) -> bool:
    current = os.environ.get("TRITON_CACHE_MANAGER")
    if current and current != MANAGER_SPEC and not force:
        log.warning("flashrt.jit: TRITON_CACHE_MANAGER=%s is set; not replacing it", current)
        return False
    os.environ["TRITON_CACHE_MANAGER"] = MANAGER_SPEC
    return True


def uninstall() -> None:
    if os.environ.get("TRITON_CACHE_MANAGER") == MANAGER_SPEC:
        del os.environ["TRITON_CACHE_MANAGER"]
