"""The paged main KV of one KV-source layer for a batch (:class:`PagedMainKV`): one block table per
row over the pages of a :class:`flashrt.kv.pages.PagePool`, the device buffers of those tables, the
writes of a step, and the reads that resolve logical entries to pool rows, with the picks that live
on cold (host) pages staged on the device (see :mod:`flashrt.kv.pages` for the tiers).
"""
from __future__ import annotations

import torch

from flashrt import ops
from flashrt.formats import QTensor
from . import pages
from .pages import FMT, BlockTable, PagePool
from .util import write_paged


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
        # a row with no pages reads "no page" in the buffers already (every write of a page id
        # comes from a table's pages, and a detach or trim writes -1 back)
        if table.pages and self._dev_ids.shape[0] == len(self.tables):
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
        write_paged(*self.target(), entry, mask, values)

    def target(self) -> tuple:
        """(pool, block table) of a write (``kv.util.write_paged``): reserved pages are on the device."""
        return self.pool, self.dev_ids()

    def resolve(self, idx: torch.Tensor, offset: int = 0) -> tuple[list[QTensor], torch.Tensor]:
        """Segments and int32 indices into them for logical entries ``idx`` [B, S, K] (-1 empty);
        ``offset``: added to every index but -1 (the rows the attention reads before the segments)."""
        B, P = idx.shape[0], self.pool.P
        flat = idx.reshape(B, -1)
        out = ops.resolve_paged(self.dev_ids(), flat, P, offset)
        segments = [self.pool.segment()]
        if self.has_cold():
            if flat.numel() <= pages.STAGING_MAX_ROWS:  # read there: the pool's zero_copy shares the limit
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
