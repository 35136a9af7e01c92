"""HKCP window-KV pool: host-memory snapshots of paused sessions with a short TTL (minutes).

A paused session's global KV goes to the persistent prefix cache; its window rings, compressor
and Engram state and unaligned tail wait here, so a session resumed within the TTL continues
exactly. Least recently stored snapshots go first when the pool exceeds ``max_bytes``. Nothing
is written to disk.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch


class WindowPool:
    def __init__(self, ttl_minutes: float = 10.0, max_bytes: int = 4 << 30):
        if ttl_minutes <= 0 or max_bytes <= 0:
            raise ValueError(f"ttl_minutes, max_bytes: expected positive values, got {ttl_minutes}, {max_bytes}")
        self.ttl_s, self.max_bytes = ttl_minutes * 60.0, int(max_bytes)
        self._items: OrderedDict[str, tuple[float, dict, int]] = OrderedDict()

    @classmethod
    def for_profile(cls, profile=None, max_bytes: int = 4 << 30) -> "WindowPool":
        """A pool with the hardware profile's TTL (``hkcp_window_pool_ttl_minutes``); default: the
        active profile."""
        from flashrt import profiles

        p = profile or profiles.active_profile()
        return cls(ttl_minutes=p.hkcp_window_pool_ttl_minutes, max_bytes=max_bytes)

    @staticmethod
    def _nbytes(snapshot: dict) -> int:
        return sum(t.numel() * t.element_size() for t in snapshot.values() if isinstance(t, torch.Tensor))

    def put(self, session_id: str, snapshot: dict) -> None:
        """Keep ``snapshot`` (tensors are copied to host memory) for ``session_id``."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id: expected a non-empty str, got {session_id!r}")
        host = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in snapshot.items()}
        self._items.pop(session_id, None)
        self._items[session_id] = (time.time(), host, self._nbytes(host))
        self._evict()

    def take(self, session_id: str) -> dict | None:
        """The snapshot of ``session_id`` (removed from the pool), or None if absent or expired."""
        item = self._items.pop(session_id, None)
        if item is None or time.time() - item[0] > self.ttl_s:
            return None
        return item[1]

    def __len__(self) -> int:
        self._evict()
        return len(self._items)

    def nbytes(self) -> int:
        return sum(n for _, _, n in self._items.values())

    def _evict(self) -> None:
        now = time.time()
        for sid in [s for s, (t, _, _) in self._items.items() if now - t > self.ttl_s]:
            del self._items[sid]
        while self._items and self.nbytes() > self.max_bytes:
            self._items.popitem(last=False)
