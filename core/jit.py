"""JIT compile-and-cache: compiled kernels kept on disk, built once per key across processes.

Layout under ``FLASHRT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flashrt``, i.e. ``~/.cache/flashrt``)::

    jit/entries/<k[:2]>/<key>.bin   one artifact: MAGIC, sha256(header + payload), header length,
                                    header JSON (key parts, metadata, payload sha256), payload
    jit/locks/<key>.lock            fcntl lock files (one per key; never deleted while in use:
                                    see :mod:`flashrt.jit_locks`)
    jit/triton/<key>/...            Triton's artifacts (see :mod:`flashrt.jit_triton`)

The key is the sha256 of the key parts: kernel source hash, backend, device architecture
(``sm_90``, ``ascend910b``, ``cpu-interpreter``), toolchain versions and the specialisation
(constexprs, tile parameters). Writers hold the key's lock, write a temp file in the entry's
directory, fsync and ``os.replace`` it, so a reader sees a whole entry or none; an entry whose
checksum fails is dropped and rebuilt.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .jit_locks import children, clear_cache, file_lock

log = logging.getLogger("flashrt")

MAGIC = b"FLRTJIT1"
_PREFIX = struct.Struct(">8s32sQ")  # magic, sha256(header + payload), header length


class CorruptEntry(Exception):
    """A cache entry failed its checks (internal: the entry is dropped and rebuilt)."""


def cache_root() -> Path:
    """``$FLASHRT_CACHE_DIR/jit`` (default ``~/.cache/flashrt/jit``)."""
    base = os.environ.get("FLASHRT_CACHE_DIR")
    if not base:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashrt"
    return Path(base).expanduser() / "jit"


# ---- keys ------------------------------------------------------------------------------------

def toolchain_versions() -> dict[str, str | None]:
    """Versions that change compiled code: torch, triton, CUDA, torch_npu / CANN."""
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    import torch

    return {"torch": torch.__version__, "triton": version("triton"), "cuda": torch.version.cuda,
            "torch_npu": version("torch-npu") or version("torch_npu"),
            "cann": os.environ.get("ASCEND_CANN_VERSION") or os.environ.get("ASCEND_TOOLKIT_VERSION")}


def device_arch(device=None) -> str:
    """``sm_90`` for a CUDA device, the SoC (``ascend910b``) for an NPU, else ``cpu-interpreter``
    (Triton's interpreter) or ``cpu``."""
    from .profile_match import detect_device

    facts = detect_device(device)
    if facts.device_type == "cuda":
        return "sm_" + facts.capability.replace(".", "")
    if facts.device_type == "npu":
        return (facts.soc or facts.name).lower().rstrip("0123456789") or "npu"
    from .jit_triton import interpreted

    return "cpu-interpreter" if interpreted() else "cpu"


def source_hash(source) -> str:
    """sha256 of a kernel's source: text, bytes, or a module / function (its module's file)."""
    if isinstance(source, str):
        source = source.encode()
    if not isinstance(source, bytes):
        import inspect

        module = inspect.getmodule(source) or source
        source = Path(inspect.getsourcefile(module)).read_bytes()
    return hashlib.sha256(source).hexdigest()


def key_parts(kernel: str, source, backend: str, spec: dict | None = None, arch: str | None = None,
              toolchain: dict | None = None) -> dict:
    """The parts a kernel's key is made of; ``arch`` and ``toolchain`` default to this machine's."""
    return {"kernel": kernel, "source": source_hash(source), "backend": backend,
            "arch": arch or device_arch(), "toolchain": toolchain or toolchain_versions(),
            "spec": spec or {}}


def cache_key(parts: dict) -> str:
    """sha256 of the parts as canonical JSON (sorted keys): equal parts, equal key."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


# ---- entries ---------------------------------------------------------------------------------

def encode_entry(payload: bytes, header: dict) -> bytes:
    head = json.dumps({**header, "payload_sha256": hashlib.sha256(payload).hexdigest(),
                       "size": len(payload)}, sort_keys=True).encode()
    digest = hashlib.sha256(head + payload).digest()
    return _PREFIX.pack(MAGIC, digest, len(head)) + head + payload


def decode_entry(blob: bytes, header_only: bool = False) -> tuple[dict, bytes]:
    """(header, payload); raises CorruptEntry for a bad magic, length, checksum or header."""
    if len(blob) < _PREFIX.size:
        raise CorruptEntry(f"truncated: {len(blob)} bytes")
    magic, digest, head_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC or _PREFIX.size + head_len > len(blob):
        raise CorruptEntry("bad magic or header length")
    head = blob[_PREFIX.size:_PREFIX.size + head_len]
    payload = blob[_PREFIX.size + head_len:]
    if not header_only and hashlib.sha256(head + payload).digest() != digest:
        raise CorruptEntry("checksum mismatch")
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise CorruptEntry(f"header: {exc}") from None
    if not header_only and header.get("size") != len(payload):
        raise CorruptEntry("payload size mismatch")
    return header, payload


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
    """One line of ``flashrt jit ls``."""

    key: str
    kind: str          # "flashrt" or "triton"
    kernel: str
    arch: str
    size: int
    mtime: float
    path: str


class JitCache:
    """Compiled artifacts on disk, one entry per key, built at most once at a time per key."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else cache_root()
        self.builds = self.hits = self.dropped = 0

    def entry_path(self, key: str) -> Path:
        return self.root / "entries" / key[:2] / f"{key}.bin"

    def lock(self, key: str):
        return file_lock(self.root / "locks" / f"{key}.lock")

    def read(self, key: str, drop: bool = True) -> bytes | None:
        """The payload of a valid entry, else None; ``drop`` removes a corrupt one (hold the lock)."""
        path = self.entry_path(key)
        try:
            header, payload = decode_entry(path.read_bytes())
            if header.get("key") != key:
                raise CorruptEntry(f"entry holds key {header.get('key')!r}")
            return payload
        except FileNotFoundError:
            return None
        except CorruptEntry as exc:
            if drop:
                log.warning("flashrt.jit: dropping corrupt entry %s (%s)", path, exc)
                self.dropped += 1
                path.unlink(missing_ok=True)
            return None

    def get_or_build(self, key_parts: dict, build: Callable[[], bytes], meta: dict | None = None) -> bytes:
        """The cached payload for ``key_parts``, else ``build()`` once (other processes wait) and store it."""
        key = cache_key(key_parts)
        path = self.entry_path(key)
        # fast path without the lock: entries only ever appear whole (os.replace); a corrupt one is
        # left for the locked path to drop
        payload = self.read(key, drop=False)
        if payload is None:
            with self.lock(key):
                payload = self.read(key)  # someone else may have built it while we waited
                if payload is None:
                    for stale in children(path.parent):  # a writer died: it held this lock while writing
                        if stale.name.startswith(f"{key}.bin.tmp."):
                            stale.unlink(missing_ok=True)
                    return self._build(key, key_parts, build, meta)
        self.hits += 1
        return payload

    def _build(self, key: str, key_parts: dict, build: Callable[[], bytes], meta: dict | None) -> bytes:
        payload = build()
        if not isinstance(payload, (bytes, bytearray)):
            raise TypeError(f"build() must return bytes, got {type(payload).__name__}")
        payload = bytes(payload)
        header = {"key": key, "parts": key_parts, "meta": meta or {}, "created": time.time()}
        atomic_write(self.entry_path(key), encode_entry(payload, header))
        self.builds += 1
        return payload

    def entries(self) -> list[EntryInfo]:
        """Every entry (flashrt's and Triton's), newest first; headers only, payloads unchecked."""
        from .jit_triton import triton_entries

        files = [p for shard in children(self.root / "entries") for p in children(shard) if p.suffix == ".bin"]
        out = [self._info(p) for p in files]
        out = [e for e in out if e is not None] + triton_entries(self.root / "triton")
        return sorted(out, key=lambda e: -e.mtime)

    def _info(self, path: Path) -> EntryInfo | None:
        try:
            with open(path, "rb") as f:
                prefix = f.read(_PREFIX.size)
                head_len = _PREFIX.unpack(prefix)[2] if len(prefix) == _PREFIX.size else 0
                header, _ = decode_entry(prefix + f.read(head_len), header_only=True)
            st = path.stat()
        except (OSError, CorruptEntry, struct.error):
            return None
        parts, meta = header.get("parts", {}), header.get("meta", {})
        return EntryInfo(path.stem, "flashrt", str(meta.get("kernel") or parts.get("kernel", "?")),
                         str(meta.get("arch") or parts.get("arch", "?")), st.st_size, st.st_mtime, str(path))

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
    from .jit_triton import install as _install

    return _install(force)


def uninstall() -> None:
    from .jit_triton import uninstall as _uninstall

    _uninstall()


def warmup(profile=None, targets=None, progress=None) -> dict:
    """Compile every kernel ``profile`` needs ahead of time; see :func:`flashrt.jit_warmup.warmup`."""
    from .jit_warmup import warmup as _warmup

    return _warmup(profile, targets, progress)
