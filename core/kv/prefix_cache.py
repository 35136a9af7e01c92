"""HKCP persistent tier: a content-addressed store of KV payloads on disk.

Ownership: the cache creates, reads, evicts and sweeps only files it can prove it wrote. Its root
holds the marker file ``FLASHRT-PREFIX-CACHE``, written when the cache claims a new or empty
directory (a non-empty directory without a valid marker is refused); an entry is
``<root>/<key[:2]>/<key>.kv`` (``key``: 64 lowercase hex digits) whose first bytes are the magic
``FRTKV``; a temporary file is ``<root>/<key[:2]>/.frtkv-tmp-<host>-<pid>-<hex>``. Nothing else
under the root is ever opened for writing, renamed over or deleted.

An entry is a header line ``FRTKV<version> <json>`` (payload length, the sha256 of each
``chunk``-byte piece of the payload, creation time, metadata) then the payload bytes. Pieces are
hashed on a thread pool (hashlib releases the GIL), so checking a 20 MB entry on read takes a
fraction of one sequential sha256. Writes go to a temporary file in the entry's directory, are
fsynced, then renamed into place, so a writer killed at any point leaves no file under an entry's
name; temporaries of dead writers are swept when a cache opens the directory (and any older than
an hour later). Reads check the version, the length and the checksum (an entry of another
version or a corrupt one is deleted and reported as a miss, never served) and the TTL (an expired
entry is deleted). A size cap evicts least recently used entries (reads refresh an entry's mtime).

Every I/O failure (the root is a file, a read-only file system, a full disk, an entry removed by
another process) is logged once per cache and kind, and becomes a miss or a skipped store.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("flashrt")
MAGIC = b"FRTKV"
VERSION = 3
CHUNK = 4 << 20  # payload bytes per sha256 digest
HEADER = MAGIC + b"%d " % VERSION
SUFFIX = ".kv"
MARKER = "FLASHRT-PREFIX-CACHE"
MARKER_FORMAT = "flashrt-prefix-cache"
TMP_PREFIX = ".frtkv-tmp-"
STALE_TMP_S = 3600
MAX_HEADER = 1 << 20
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_SHARD = re.compile(r"[0-9a-f]{2}")
_ENTRY = re.compile(r"[0-9a-f]{64}\.kv")
_TMP = re.compile(r"\.frtkv-tmp-([0-9a-f]{8})-(\d+)-[0-9a-f]{8}")


class PrefixCache:
    def __init__(self, root, ttl_hours: float = 72.0, max_bytes: int = 20 << 30):
        if not isinstance(root, (str, os.PathLike)) or not str(os.fspath(root)).strip():
            raise ValueError(f"prefix_cache root: expected a directory path, got {root!r} (an empty path would "
                             f"mean the current directory)")
        if not ttl_hours > 0 or not max_bytes > 0:  # NaN fails too
            raise ValueError(f"ttl_hours, max_bytes: expected positive values, got {ttl_hours}, {max_bytes}")
        self.root, self.ttl_s, self.max_bytes = Path(root), ttl_hours * 3600.0, int(max_bytes)
        self.hits = self.misses = self.corrupt = self.errors = 0
        self._logged: set = set()
        self.owned = self._claim()  # False: an I/O error; every read is a miss, every store skipped
        if self.owned:
            self._sweep()

    @classmethod
    def for_profile(cls, root, profile=None) -> "PrefixCache":
        """A cache at ``root`` with the hardware profile's TTL (``hkcp_prefix_ttl_hours``) and size
        cap (``hkcp_persistent_disk_gib``); default: the active profile."""
        from flashrt import profiles

        p = profile or profiles.active_profile()
        return cls(root, ttl_hours=p.hkcp_prefix_ttl_hours, max_bytes=p.persistent_disk_bytes)

    def path(self, key: str) -> Path:
        if not isinstance(key, str) or len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"key: expected a sha256 hex digest (64 lowercase hex digits), got {key!r}")
        return self.root / key[:2] / (key + SUFFIX)

    # ----- ownership -------------------------------------------------------------------------------
    def _claim(self) -> bool:
        """Open the root as a cache: adopt it if it has the marker, claim it if new or empty."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            marker = self.root / MARKER
            if self._marker_ok(marker):
                return True
            others = sorted(p.name for p in self.root.iterdir() if p.name != MARKER)
            if others or (marker.exists() and marker.stat().st_size):
                shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
                raise ValueError(f"prefix_cache root: {str(self.root)!r} is not empty and is not a flashrt prefix "
                                 f"cache (no valid {MARKER} file; found {shown or MARKER}); give a new or empty "
                                 f"directory")
            with open(marker, "wb") as f:
                f.write(json.dumps({"format": MARKER_FORMAT, "created": time.time()}).encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            return True
        except OSError as exc:
            self._fail("open", exc)
            return False

    @staticmethod
    def _marker_ok(marker: Path) -> bool:
        try:
            with open(marker, "rb") as f:
                doc = json.loads(f.read(4096))
        except (OSError, ValueError):
            return False
        return isinstance(doc, dict) and doc.get("format") == MARKER_FORMAT

    def _fail(self, op: str, exc: BaseException, detail: str = "") -> None:
        """Log a failed operation: a warning the first time per (operation, error kind)."""
        self.errors += 1
        kind = (op, getattr(exc, "errno", None) or type(exc).__name__)
        level = logging.DEBUG if kind in self._logged else logging.WARNING
        self._logged.add(kind)
        log.log(level, "flashrt: prefix cache %s: %s failed%s (%s); generation goes on without it",
                self.root, op, detail, exc)

    # ----- write -----------------------------------------------------------------------------------
    def put(self, key: str, payload: bytes, meta: dict | None = None) -> Path | None:
        """Store ``payload`` under ``key`` atomically (an entry of the cache's own is replaced);
        the entry's path, or None when the store was skipped (logged)."""
        path = self.path(key)
        if not self.owned:
            return None
        header = {"version": VERSION, "length": len(payload), "chunk": CHUNK, "sha256": digests(payload, CHUNK),
                  "created": time.time(), "meta": meta or {}}
        tmp = None
        try:
            path.parent.mkdir(exist_ok=True)  # the root itself is never re-created here
            name = path.parent / f"{TMP_PREFIX}{HOST}-{os.getpid()}-{os.urandom(4).hex()}"
            with open(name, "xb") as f:
                tmp = name  # created: removed below unless it becomes the entry
                self._write(f, HEADER + json.dumps(header, sort_keys=True).encode() + b"\n", payload)
                f.flush()
                os.fsync(f.fileno())
            if path.exists() and self._magic(path) is False:
                raise FileExistsError(errno.EEXIST, "a file the cache did not write has the entry's name", str(path))
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            self._fail("store", exc, f" for entry {key[:12]}")
            return None
        finally:
            if tmp is not None:
                self._unlink(tmp)
        self._sweep()
        return path

    @staticmethod
    def _write(f, header: bytes, payload: bytes) -> None:
        f.write(header)
        f.write(payload)

    # ----- read ------------------------------------------------------------------------------------
    def get(self, key: str) -> tuple[bytes, dict] | None:
        """``(payload, meta)`` for ``key``, or None on a miss (absent, expired, corrupt, another
        format version, or unreadable)."""
        found = self._load(self.path(key))
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def _load(self, path: Path) -> tuple[bytes, dict] | None:
        if not self.owned:
            return None
        try:
            line, payload = _read_entry(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._fail("read", exc, f" of {path.name}")
            return None
        if not line.startswith(MAGIC):
            self._fail("read", ValueError("not written by the cache; left in place"), f" of {path.name}")
            return None
        header = self._header(line)
        if header is None or len(payload) != header["length"] or digests(payload, header["chunk"]) != header["sha256"]:
            self._fail("check", ValueError("corrupt or of another format version; dropped"), f" of {path.name}")
            self.corrupt += 1
            self._unlink(path)
            return None
        if time.time() - header["created"] > self.ttl_s:
            self._unlink(path)
            return None
        try:
            os.utime(path)  # LRU: a read makes the entry recent
        except FileNotFoundError:
            pass  # evicted by another process after the read: the bytes read are still valid
        except OSError as exc:
            self._fail("touch", exc)
        return payload, header["meta"]

    @staticmethod
    def _header(line: bytes) -> dict | None:
        if not line.startswith(HEADER):
            return None
        try:
            header = json.loads(line[len(HEADER):])
        except ValueError:
            return None
        ok = isinstance(header, dict) and header.get("version") == VERSION and \
            {"length", "chunk", "sha256", "created"} <= set(header)
        ok = ok and isinstance(header["chunk"], int) and header["chunk"] > 0 and isinstance(header["sha256"], list)
        return header if ok and isinstance(header.get("meta", {}), dict) else None

    def contains(self, key: str) -> bool:
        try:
            return self.owned and self.path(key).is_file()
        except OSError:
            return False

    def discard(self, key: str, reason: str) -> None:
        """Drop the entry ``key`` that :meth:`get` just returned but its reader cannot use
        (``reason``): the read counts as a miss; logged once per cache."""
        self._fail("load", ValueError(reason), f" of entry {key[:12]}")
        if self.hits:
            self.hits, self.misses = self.hits - 1, self.misses + 1
        path = self.path(key)
        if self.owned and self._magic(path):
            self._unlink(path)

    # ----- housekeeping ----------------------------------------------------------------------------
    @staticmethod
    def _magic(path: Path) -> bool | None:
        """True: the file starts with the cache's magic; False: it does not; None: unreadable."""
        try:
            with open(path, "rb") as f:
                return f.read(len(MAGIC)) == MAGIC
        except OSError:
            return None

    def _files(self):
        """(kind, path, stat) of the cache's own files: "entry" or "tmp" (empty or with the magic)."""
        if not self._marker_ok(self.root / MARKER):
            return  # no longer (or never) a cache root: touch nothing
        for shard in self.root.iterdir():
            if not _SHARD.fullmatch(shard.name) or not shard.is_dir() or shard.is_symlink():
                continue
            for p in shard.iterdir():
                kind = "entry" if _ENTRY.fullmatch(p.name) and p.name[:2] == shard.name else (
                    "tmp" if _TMP.fullmatch(p.name) else None)
                if kind is None:
                    continue
                try:
                    st = p.lstat()
                except FileNotFoundError:
                    continue
                if not p.is_symlink() and p.is_file() and ((kind == "tmp" and st.st_size == 0) or self._magic(p)):
                    yield kind, p, st

    def entries(self) -> list[tuple[Path, int, float]]:
        """(path, size, mtime) of every entry."""
        try:
            return [(p, st.st_size, st.st_mtime) for kind, p, st in self._files() if kind == "entry"]
        except OSError as exc:
            self._fail("list", exc)
            return []

    def _sweep(self) -> None:
        """Drop temporaries of dead or long-gone writers, expired entries, then the least recently
        used entries above the size cap."""
        now = time.time()
        try:
            files = list(self._files())
        except OSError as exc:
            self._fail("sweep", exc)
            return
        for kind, p, st in files:
            if kind == "tmp" and (now - st.st_mtime > STALE_TMP_S or _writer_dead(p.name)):
                self._unlink(p)
        entries = sorted(((p, st.st_size, st.st_mtime) for kind, p, st in files if kind == "entry"), key=lambda e: e[2])
        total = sum(size for _, size, _ in entries)
        for path, size, mtime in entries:
            if total <= self.max_bytes and now - mtime <= self.ttl_s:
                continue
            self._unlink(path)
            total -= size

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._fail("delete", exc)


_HASHERS: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool): a fork makes a new one
_HASHERS_LOCK = threading.Lock()


def _hashers() -> ThreadPoolExecutor:
    global _HASHERS
    with _HASHERS_LOCK:
        if _HASHERS is None or _HASHERS[0] != os.getpid():
            n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            _HASHERS = (os.getpid(), ThreadPoolExecutor(max(1, min(8, n)), thread_name_prefix="flashrt-kv-hash"))
        return _HASHERS[1]


def digests(payload: bytes, chunk: int) -> list[str]:
    """sha256 hex digests of the ``chunk``-byte pieces of ``payload`` (one for an empty payload),
    several pieces at once on a thread pool."""
    view = memoryview(payload)
    pieces = [view[i:i + chunk] for i in range(0, len(view), chunk)] or [view]
    if len(pieces) == 1:
        return [hashlib.sha256(pieces[0]).hexdigest()]
    return list(_hashers().map(lambda piece: hashlib.sha256(piece).hexdigest(), pieces))


def _read_entry(path: Path) -> tuple[bytes, bytes]:
    """(header line with its newline, payload) of an entry file, read unbuffered: the payload in one
    ``readall`` into its own bytes object (no copy to split it off the header); a file with no
    newline in its first ``MAX_HEADER`` bytes gives those bytes and an empty payload (rejected by
    the header check)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(min(size, 1 << 16))
        end = head.find(b"\n")
        if end < 0 and len(head) < min(size, MAX_HEADER):
            head += f.read(min(size, MAX_HEADER) - len(head))
            end = head.find(b"\n")
        if end < 0:
            return head[:MAX_HEADER], b""
        f.seek(end + 1)
        return head[:end + 1], f.readall()


def _writer_dead(name: str) -> bool:
    """True when a temporary file's writer was a process of this host that no longer runs."""
    host, pid = _TMP.fullmatch(name).groups()
    if host != HOST or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
