"""HKCP persistent tier: a content-addressed store of KV payloads on disk.

An entry is one file ``<root>/<key[:2]>/<key>.kv``: a header line ``FRTKV1 <json>`` (payload
length, sha256, creation time, metadata) then the payload bytes. Writes go to a temporary file in
the same directory, are fsynced, then renamed into place, so a writer killed at any point leaves no
file under an entry's name; stale temporaries are swept later. Reads check the length and the
checksum (a corrupt entry is deleted and reported as a miss, never served) and the TTL (default
72 h; an expired entry is deleted). A size cap evicts least recently used entries (reads refresh
an entry's mtime).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("flashrt")
MAGIC = b"FRTKV1 "
SUFFIX = ".kv"
STALE_TMP_S = 3600


class PrefixCache:
    def __init__(self, root, ttl_hours: float = 72.0, max_bytes: int = 20 << 30):
        if ttl_hours <= 0 or max_bytes <= 0:
            raise ValueError(f"ttl_hours, max_bytes: expected positive values, got {ttl_hours}, {max_bytes}")
        self.root, self.ttl_s, self.max_bytes = Path(root), ttl_hours * 3600.0, int(max_bytes)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = self.corrupt = 0

    @classmethod
    def for_profile(cls, root, profile=None) -> "PrefixCache":
        """A cache at ``root`` with the hardware profile's TTL (``hkcp_prefix_ttl_hours``) and size
        cap (``hkcp_persistent_disk_gib``); default: the active profile."""
        from flashrt import profiles

        p = profile or profiles.active_profile()
        return cls(root, ttl_hours=p.hkcp_prefix_ttl_hours, max_bytes=p.persistent_disk_bytes)

    def path(self, key: str) -> Path:
        if len(key) < 8 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"key: expected a lowercase hex digest, got {key!r}")
        return self.root / key[:2] / (key + SUFFIX)

    # ----- write -----------------------------------------------------------------------------------
    def put(self, key: str, payload: bytes, meta: dict | None = None) -> Path:
        """Store ``payload`` under ``key`` atomically (an existing entry is replaced)."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {"length": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                  "created": time.time(), "meta": meta or {}}
        tmp = path.parent / f".tmp-{os.getpid()}-{os.urandom(4).hex()}"
        with open(tmp, "wb") as f:
            f.write(MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._sweep()
        return path

    # ----- read ------------------------------------------------------------------------------------
    def get(self, key: str) -> tuple[bytes, dict] | None:
        """``(payload, meta)`` for ``key``, or None on a miss (absent, expired or corrupt)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                line = f.readline()
                payload = f.read()
        except FileNotFoundError:
            self.misses += 1
            return None
        header = self._header(line)
        if header is None or len(payload) != header["length"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
            log.warning("flashrt: prefix cache entry %s is corrupt; dropped", path.name)
            self.corrupt += 1
            self.misses += 1
            self._unlink(path)
            return None
        if time.time() - header["created"] > self.ttl_s:
            self.misses += 1
            self._unlink(path)
            return None
        os.utime(path)  # LRU: a read makes the entry recent
        self.hits += 1
        return payload, header["meta"]

    @staticmethod
    def _header(line: bytes) -> dict | None:
        if not line.startswith(MAGIC):
            return None
        try:
            header = json.loads(line[len(MAGIC):])
        except ValueError:
            return None
        ok = isinstance(header, dict) and {"length", "sha256", "created"} <= set(header)
        return header if ok else None

    def contains(self, key: str) -> bool:
        return self.path(key).exists()

    # ----- housekeeping ----------------------------------------------------------------------------
    def entries(self) -> list[tuple[Path, int, float]]:
        """(path, size, mtime) of every entry."""
        out = []
        for p in self.root.glob(f"*/*{SUFFIX}"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out.append((p, st.st_size, st.st_mtime))
        return out

    def _sweep(self) -> None:
        """Drop stale temporaries, expired entries, then the least recently used above the cap."""
        now = time.time()
        for tmp in self.root.glob("*/.tmp-*"):
            try:
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
            except FileNotFoundError:
                pass
        entries = sorted(self.entries(), key=lambda e: e[2])
        total = sum(size for _, size, _ in entries)
        for path, size, mtime in entries:
            if total <= self.max_bytes and now - mtime <= self.ttl_s:
                continue
            self._unlink(path)
            total -= size

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
