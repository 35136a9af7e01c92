"""HKCP main-KV pages: fixed-size pages of ``MAIN_KV_FORMAT`` (``fp4_b16``) entries on two tiers.

Every KV-source layer stores its compressed main KV in pages of ``page_entries`` entries drawn
from one :class:`PagePool`: device pages (hot and warm) up to a byte budget, and host pages (cold,
pinned when CUDA is present) that grow on demand. Each (layer, sequence) has a block table: logical
page ``j`` -> (tier, physical page). When the device pool is full, the oldest device page not in use
by the current step is copied to a host page, then freed (a copy before a free: nothing is lost).

Attention never copies hot data: the device pool is one ``[1, pages * P, D]`` QTensor segment
shared by every row, and a row's logical entry ``e`` maps to ``phys(e // P) * P + e % P``. Only the
selected entries that live on cold pages are gathered into a staging segment (one row per pick)
by the op ``flashrt.ops.gather_cold_rows`` (on CUDA a kernel that reads them straight from pinned
host memory, with no host sync: the block tables are device buffers); with too many picks for a
staging segment (long prefill chunks), by a host gather of the unique rows and one copy up.

This module holds the pool (:class:`PagePool`, with the page locks of a step) and the block tables;
the main KV of one source layer, :class:`PagedMainKV`, lives in :mod:`flashrt.kv.main_kv` and is
named here too.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from flashrt import dispatch
from flashrt.dtypes import MAIN_KV_FORMAT
from flashrt.formats import QTensor
from .util import empty_qtensor

FMT = MAIN_KV_FORMAT
TRASH_PAGE = 0


STAGING_MAX_ROWS = 1 << 16  # picks per resolve that the zero-copy gather stages (about 18 MB at D=512)


class PagePool:
    """Device and host pages of main-KV entries for every source layer of a batch."""

    def __init__(self, head_dim: int, page_entries: int, device, device_pages: int | None,
                 host_pages: int | None = None):
        self.D, self.P, self.device = head_dim, page_entries, torch.device(device)
        # device pages: grown by doubling up to ``device_pages`` (None: no limit, never spill)
        self.limit, self.host_limit = device_pages, host_pages  # host_pages None: no cold-tier limit
        n = min(max(device_pages or 16, 1), 16) + 1  # + the trash page (TRASH_PAGE, never handed out)
        self.dev = empty_qtensor(FMT, (n, page_entries, head_dim), self.device)
        self.free_dev = list(range(n - 1, TRASH_PAGE, -1))
        self.generation = 0  # bumped whenever the device pool or a block-table buffer is reallocated
        self.index_pool = None  # the batch's IndexPool (flashrt.kv.index), drawn from the same budget
        self.host = empty_qtensor(FMT, (0, page_entries, head_dim), "cpu")
        self.host_pinned = False  # known here: is_pinned() asks the driver (not inside a graph capture)
        self.free_host: list[int] = []
        self.fifo: OrderedDict[int, tuple] = OrderedDict()  # device page -> (table, logical page)
        self.locked: set[int] = set()  # device pages written by the current step
        self.pending_locks: list = []  # (block tables, first entries) of PagedMainKV.lock_rows, not applied yet
        self.spilled = 0  # pages moved to the host so far
        self.edits = 0  # bumped whenever a block table gains a changed page (PagedMainKV._rebuild_ids skips otherwise)

    @property
    def page_bytes(self) -> int:
        return self.P * (self.D // 2 + self.D // 16)

    @property
    def device_pages(self) -> int:
        """Device pages that can hold entries (the trash page excluded)."""
        return self.dev.shape[0] - 1

    @property
    def trash_row(self) -> int:
        """First row of the trash page in :meth:`segment`: where masked writes go."""
        return TRASH_PAGE * self.P

    # ----- allocation ----------------------------------------------------------------------------
    def alloc(self, table: "BlockTable", logical: int) -> int:
        if not self.free_dev:
            if self.limit is None or self.device_pages < self.limit:
                self._grow_device()
            else:
                self._spill_one()
        page = self.free_dev.pop()
        self.fifo[page] = (table, logical)
        self.locked.add(page)
        return page

    def unlock(self) -> None:
        self.locked.clear()
        self.pending_locks.clear()

    def locked_pages(self) -> set[int]:
        """The device pages the current step keeps on the device, with the row locks of
        :meth:`PagedMainKV.lock_rows` applied: the same pages as locking them when they were asked
        for (until a spill, a page only leaves a table by a release, which unlocks it anyway, and
        pages added since are locked by :meth:`alloc`)."""
        P = self.P
        for tables, firsts in self.pending_locks:
            for table, first in zip(tables, firsts):
                for tier, page in table.pages[first // P:]:
                    if tier == "dev":
                        self.locked.add(page)
        self.pending_locks.clear()
        return self.locked

    @property
    def has_cold(self) -> bool:
        """Whether any host page is in use (else no block table has a cold page)."""
        return len(self.free_host) != self.host.shape[0]

    @property
    def pages_in_use(self) -> int:
        """Pages held by sequences on either tier (the trash page excluded)."""
        return self.device_pages - len(self.free_dev) + self.host.shape[0] - len(self.free_host)

    def release(self, table: "BlockTable", keep: int = 0) -> None:
        """Give the pages of ``table`` past its first ``keep`` back (device and host tier)."""
        for tier, page in table.pages[keep:]:
            if tier == "dev":
                self.fifo.pop(page, None)
                self.locked.discard(page)
                self.free_dev.append(page)
            else:
                self.free_host.append(page)
                table.cold -= 1
        table.pages = table.pages[:keep]
        table.changed = {j for j in table.changed if j < keep}

    def grow_device_to(self, pages: int) -> None:
        """Allocate up to ``pages`` device pages now (capped at the limit), so the pool need not be
        reallocated later: a reallocation moves it, and every captured step reading it is recaptured."""
        if self.limit is not None:
            pages = min(pages, self.limit)
        if pages > self.device_pages:
            self._grow_device(pages + 1)

    def _grow_device(self, rows: int | None = None) -> None:
        """Double the device pool (``rows``: to this many pages, the trash page included)."""
        n = self.dev.shape[0]
        m = 2 * n if self.limit is None else min(2 * n, self.limit + 1)
        m = max(m, rows or 0)
        grown = empty_qtensor(FMT, (m, self.P, self.D), self.device)
        grown.data[:n], grown.scale[:n] = self.dev.data, self.dev.scale
        self.dev = grown
        self.free_dev = list(range(m - 1, n - 1, -1)) + self.free_dev  # pages still free are handed out first
        self.generation += 1

    def _spill_one(self) -> None:
        """Copy the oldest unlocked device page to a host page, then free it."""
        locked = self.locked_pages()
        victim = next((p for p in self.fifo if p not in locked), None)
        if victim is None:
            raise ValueError(f"kv_budget: {self.device_pages} device pages of main KV cannot hold one step's "
                             f"new entries; raise the budget or shorten the prefill chunk")
        table, logical = self.fifo.pop(victim)
        host = self._host_page()
        u8 = torch.uint8
        self.host.data.view(u8)[host].copy_(self.dev.data.view(u8)[victim])
        self.host.scale.view(u8)[host].copy_(self.dev.scale.view(u8)[victim])
        table.pages[logical] = ("host", host)
        table.changed.add(logical)
        self.edits += 1
        table.cold += 1
        self.free_dev.append(victim)
        self.spilled += 1

    def _host_page(self) -> int:
        if not self.free_host:
            n = self.host.shape[0]
            m = max(2 * n, 16) if self.host_limit is None else min(max(2 * n, 16), self.host_limit)
            if m <= n:
                raise ValueError(f"kv_budget: the cold tier is full ({n} host pages = {n * self.page_bytes:,} bytes, the "
                                 f"profile's hkcp_cold_host_gib); raise it, the device budget, or shorten the context")
            grown = empty_qtensor(FMT, (m, self.P, self.D), "cpu")
            pin = torch.cuda.is_available() and self.device.type == "cuda"
            if pin:
                grown = QTensor(grown.data.pin_memory(), grown.scale.pin_memory(), FMT, grown.shape)
            grown.data[:n], grown.scale[:n] = self.host.data, self.host.scale
            self.host, self.host_pinned = grown, pin
            if pin:
                self.zero_copy(0)  # a backend's one-time self-check runs here, not inside a decode step
            self.free_host = list(range(grown.shape[0] - 1, n - 1, -1))
        return self.free_host.pop()

    def zero_copy(self, picks: int) -> bool:
        """Whether ``picks`` cold picks are fetched without a host sync (a CUDA-graph step may hold
        the fetch): at most ``STAGING_MAX_ROWS`` of them, host pages pinned on CUDA, and the
        backend serving ``gather_cold_rows`` here reads host memory in place."""
        if picks > STAGING_MAX_ROWS or (self.device.type == "cuda" and not self.host_pinned):
            return False
        return dispatch.zero_copy("gather_cold_rows", self.device)

    def segment(self) -> QTensor:
        """The device pool as one ``[1, pages * P, D]`` segment (a view, no copy)."""
        n = self.dev.shape[0] * self.P
        return QTensor(self.dev.data.view(1, n, -1), self.dev.scale.view(1, n, -1), FMT, (1, n, self.D))


class BlockTable:
    """Logical pages of one (layer, sequence): ``pages[j] = (tier, physical page)``; ``changed``:
    the logical pages not yet copied into the batch's block-table buffers."""

    def __init__(self):
        self.pages: list[tuple[str, int]] = []
        self.changed: set[int] = set()
        self.cold = 0  # pages on the host tier, counted as they spill (a page only ever moves there)
