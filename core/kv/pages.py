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
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from flashrt import dispatch, ops
from flashrt.dtypes import MAIN_KV_FORMAT
from flashrt.formats import QTensor
from .util import empty_qtensor, write_paged

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


class PagedMainKV:
    """The main KV of one source layer for a batch: one block table per row, pages from ``pool``."""

    def __init__(self, pool: PagePool, batch: int, entries: int = 1):
        """``entries``: the block-table buffers start wide enough for this many entries per row."""
        self.pool, self.tables = pool, [BlockTable() for _ in range(batch)]
        width = (batch, max(1, -(-entries // pool.P)))
        self._dev_ids = torch.full(width, -1, dtype=torch.long, device=pool.device)
        self._host_ids = torch.full_like(self._dev_ids, -1)  # on the device
        self._host_ids_cpu = torch.full(width, -1, dtype=torch.long)
        self._seen_edits = -1  # pool.edits when the buffers were last brought up to date

    def lock_from(self, row: int, first: int) -> None:
        """Keep ``row``'s device pages from entry ``first`` on (a partly filled last page the step
        writes into) on the device for this step: a spill would send the write to a page the row
        no longer owns."""
        for tier, page in self.tables[row].pages[first // self.pool.P:]:
            if tier == "dev":
                self.pool.locked.add(page)

    def lock_rows(self, firsts: list[int]) -> None:
        """:meth:`lock_from` of every row (``firsts[row]``: its first entry the step writes), applied
        only when a spill needs the locks (:meth:`PagePool.locked_pages`): most steps spill nothing.
        Nothing to do for a pool that never spills (no device limit)."""
        if self.pool.limit is not None:
            self.pool.pending_locks.append((list(self.tables), firsts))

    def reserve_rows(self, ends: list[int], firsts: list[int]) -> None:
        """:meth:`reserve` of every row in order (``ends[row]`` entries, ``firsts[row]`` the first
        entry the step writes), with the common case (no page to add, none on the host) skipped."""
        P = self.pool.P
        for row, (table, end, first) in enumerate(zip(self.tables, ends, firsts)):
            if table.cold or len(table.pages) * P < end:
                self.reserve(row, end, first)

    def reserve(self, row: int, entries: int, first: int | None = None) -> None:
        """Make room (device pages, locked for this step) for entries ``< entries`` of ``row``;
        ``first``: the first entry the step writes: a page from there on that was spilled to the
        host (a partly filled page of a row whose batch was prefilled apart) comes back first."""
        table, P = self.tables[row], self.pool.P
        for j in range(len(table.pages) if first is None else first // P, len(table.pages)):
            if table.pages[j][0] == "host":
                self._promote(table, j)
        while len(table.pages) * P < entries:
            table.pages.append(("dev", self.pool.alloc(table, len(table.pages))))
            table.changed.add(len(table.pages) - 1)
            self.pool.edits += 1

    def _promote(self, table: BlockTable, logical: int) -> None:
        """Move host page ``logical`` of ``table`` back to a (locked) device page."""
        pool, host = self.pool, table.pages[logical][1]
        page = pool.alloc(table, logical)
        u8 = torch.uint8
        pool.dev.data.view(u8)[page].copy_(pool.host.data.view(u8)[host].to(pool.device))
        pool.dev.scale.view(u8)[page].copy_(pool.host.scale.view(u8)[host].to(pool.device))
        pool.free_host.append(host)
        table.pages[logical] = ("dev", page)
        table.changed.add(logical)
        pool.edits += 1
        table.cold -= 1

    def has_cold(self) -> bool:
        """Whether any row has a page on the host tier."""
        return self.pool.has_cold and any(t.cold for t in self.tables)

    def detach_row(self, row: int) -> BlockTable:
        """Hand ``row``'s block table (and so its pages) to another owner; the row is left with no
        pages and its buffer row reads "no page"."""
        table, self.tables[row] = self.tables[row], BlockTable()
        if self._dev_ids.shape[0] == len(self.tables):
            self._dev_ids[row] = -1
            self._host_ids[row] = -1
            self._host_ids_cpu[row] = -1
        return table

    def clear_row(self, row: int) -> None:
        """Give ``row``'s pages back to the pool."""
        self.pool.release(self.detach_row(row))

    def trim_row(self, row: int, entries: int) -> None:
        """Give back ``row``'s pages past those holding entries ``< entries`` (a rolled-back step's)."""
        table, keep = self.tables[row], -(-entries // self.pool.P)
        if len(table.pages) <= keep:
            return
        self.pool.release(table, keep)
        if row < self._dev_ids.shape[0]:
            for ids in (self._dev_ids, self._host_ids, self._host_ids_cpu):
                ids[row, keep:] = -1

    def adopt_row(self, row: int, table: BlockTable) -> None:
        """``row`` takes over ``table`` (pages of the same pool, no copy); its own go back first."""
        self.clear_row(row)
        self.tables[row] = table
        table.changed.update(range(len(table.pages)))
        self.pool.edits += 1

    def _rebuild_ids(self) -> None:
        """Bring the block-table buffers up to date in place: only the changed entries are written
        (a page added or spilled: a few entries per step, not the whole table); a wider table
        reallocates them (doubling) and bumps ``pool.generation``."""
        fresh = self._dev_ids.shape[0] != len(self.tables)
        if not fresh and (self._seen_edits == self.pool.edits or not any(t.changed for t in self.tables)):
            self._seen_edits = self.pool.edits
            return
        self._seen_edits = self.pool.edits
        width = max(1, max(len(t.pages) for t in self.tables))
        if fresh or self._dev_ids.shape[1] < width:
            self._full_rebuild(max(width, 2 * self._dev_ids.shape[1]))
        else:
            cells = [(r, j, t.pages[j]) for r, t in enumerate(self.tables) for j in sorted(t.changed)]
            # rows, cols, device page, host page of each changed cell: one host->device copy
            # (pinned, non-blocking on CUDA)
            packed = torch.tensor([[r for r, _, _ in cells], [j for _, j, _ in cells],
                                   [p if tier == "dev" else -1 for _, _, (tier, p) in cells],
                                   [p if tier == "host" else -1 for _, _, (tier, p) in cells]], dtype=torch.long)
            self._host_ids_cpu[packed[0], packed[1]] = packed[3]
            if self.pool.device.type == "cuda":
                packed = packed.pin_memory()
            rows, cols, dev, host = packed.to(self.pool.device, non_blocking=True)
            self._dev_ids.index_put_((rows, cols), dev)
            self._host_ids.index_put_((rows, cols), host)
        for t in self.tables:
            t.changed.clear()

    def _full_rebuild(self, cols: int) -> None:
        self._dev_ids = torch.empty(len(self.tables), cols, dtype=torch.long, device=self.pool.device)
        self._host_ids = torch.empty_like(self._dev_ids)
        self.pool.generation += 1
        pad = lambda row: row + [-1] * (cols - len(row))
        dev = [pad([p if tier == "dev" else -1 for tier, p in t.pages]) for t in self.tables]
        host = [pad([p if tier == "host" else -1 for tier, p in t.pages]) for t in self.tables]
        self._dev_ids.copy_(torch.tensor(dev, dtype=torch.long), non_blocking=True)
        self._host_ids.copy_(torch.tensor(host, dtype=torch.long), non_blocking=True)
        self._host_ids_cpu = torch.tensor(host, dtype=torch.long)

    def dev_ids(self) -> torch.Tensor:
        """int64 [B, max_pages] on the device: device page of each logical page, -1 when on the
        host or absent (a persistent buffer, updated in place)."""
        self._rebuild_ids()
        return self._dev_ids

    def host_ids(self) -> torch.Tensor:
        """int64 [B, max_pages] on the CPU: host page of each logical page, -1 elsewhere."""
        self._rebuild_ids()
        return self._host_ids_cpu

    def host_ids_device(self) -> torch.Tensor:
        """:meth:`host_ids` as a persistent device buffer (for the sync-free cold gather)."""
        self._rebuild_ids()
        return self._host_ids

    def write(self, entry: torch.Tensor, mask: torch.Tensor, values: QTensor) -> None:
        """Store ``values`` [B, n, D] at logical entries ``entry`` [B, n] where ``mask``; the other
        rows go to the trash row (no host-side filtering, no device sync)."""
        write_paged(self.pool, self.dev_ids(), entry, mask, values)  # reserved pages are on the device

    def resolve(self, idx: torch.Tensor, offset: int = 0) -> tuple[list[QTensor], torch.Tensor]:
        """Segments and int32 indices into them for logical entries ``idx`` [B, S, K] (-1 empty);
        ``offset``: added to every index but -1 (the rows the attention reads before the segments)."""
        B, P = idx.shape[0], self.pool.P
        flat = idx.reshape(B, -1)
        out = ops.resolve_paged(self.dev_ids(), flat, P, offset)
        segments = [self.pool.segment()]
        if self.has_cold():
            if flat.numel() <= STAGING_MAX_ROWS:
                staging, out = ops.gather_cold_rows(self.pool.host, self.host_ids_device(), flat, out,
                                                    offset + segments[0].shape[1])
            else:
                staging, out = self._stage_cold(flat, out, offset + segments[0].shape[1])
            segments.append(staging)
        return segments, out.view(idx.shape)

    def _stage_cold(self, flat, out, offset):
        """The copy path (too many picks for a staging segment): the picks to the host, lookups and
        a gather there, one copy of the unique rows up."""
        P, D = self.pool.P, self.pool.D
        picks = flat.cpu().long()
        host_ids = self.host_ids()
        hp = host_ids.gather(1, (picks.clamp_min(0) // P).clamp_max(host_ids.shape[1] - 1))
        rows, cols = torch.nonzero((picks >= 0) & (hp >= 0), as_tuple=True)
        entries = picks[rows, cols]
        pairs, inverse = torch.unique(rows * (1 << 40) + entries, return_inverse=True)
        src = torch.empty(len(pairs), dtype=torch.long).scatter_(0, inverse, hp[rows, cols] * P + entries % P)
        host, dev = self.pool.host, self.pool.device
        data = host.data.view(-1, D // 2)[src]
        scale = host.scale.view(torch.uint8).view(-1, D // 16)[src]
        staging = QTensor(data.to(dev, non_blocking=True).view(1, -1, D // 2),
                          scale.to(dev, non_blocking=True).view(torch.float8_e4m3fn).view(1, -1, D // 16),
                          FMT, (1, len(pairs), D))
        out[rows.to(out.device), cols.to(out.device)] = (offset + inverse).to(out.device, torch.int32)
        return staging, out

    def read_row(self, row: int, entries: int) -> QTensor:
        """Entries ``[0, entries)`` of ``row`` as a CPU QTensor ``[entries, D]`` (from either tier)."""
        P, D = self.pool.P, self.pool.D
        datas, scales = [], []
        for j in range(-(-entries // P)):
            tier, page = self.tables[row].pages[j]
            src = self.pool.dev if tier == "dev" else self.pool.host
            datas.append(src.data[page].cpu())
            scales.append(src.scale.view(torch.uint8)[page].cpu())
        data = torch.cat(datas)[:entries] if datas else torch.zeros(0, D // 2, dtype=torch.uint8)
        scale = torch.cat(scales)[:entries] if scales else torch.zeros(0, D // 16, dtype=torch.uint8)
        return QTensor(data, scale.view(torch.float8_e4m3fn), FMT, (entries, D))

    def write_row(self, row: int, values: QTensor) -> None:
        """Store ``values`` [n, D] as entries ``[0, n)`` of ``row`` (pages reserved here)."""
        n = values.shape[0]
        self.reserve(row, n)
        B = len(self.tables)
        entry = torch.arange(n, device=self.pool.device).unsqueeze(0).expand(B, n)
        mask = torch.zeros(B, n, dtype=torch.bool, device=self.pool.device)
        mask[row] = True
        dev = values.to(self.pool.device)
        full = QTensor(dev.data.unsqueeze(0).expand(B, *dev.data.shape), dev.scale.unsqueeze(0).expand(B, *dev.scale.shape),
                       FMT, (B, n, values.shape[-1]))
        self.write(entry, mask, full)
