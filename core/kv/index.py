"""HKCP index-K pages: fixed-size pages of ``fp4_b32`` index keys, device only.

Every KV-source layer stores its index K in pages of ``page_entries`` entries drawn from one
:class:`IndexPool`. Index pages never leave the device: the indexer scores every position. Each
(layer, sequence) has a row of an int32 block table (a persistent device tensor, updated in place
when pages are added); the indexer reads the keys in place through a
:class:`flashrt.kv.paged.PagedKeys` view of the pool.

Page 0 of the pool is a trash page that is never handed out: masked writes are redirected to
its first row (``trash_row``) instead of being filtered on the host, and block-table slots with no
page point at it. Reallocating the pool (doubling) or a block table bumps ``pool.generation``, so
code that caches device pointers (CUDA graphs) can tell they are stale.
"""
from __future__ import annotations

import torch

from flashrt.formats import QTensor
from .util import empty_qtensor, to_device, write_paged, write_rows
from .paged import PagedKeys

FMT = "fp4_b32"
TRASH_PAGE = 0


class IndexPool:
    """Device pages of index-K entries (``[pages, P, D]``) for every source layer of a batch."""

    def __init__(self, dim: int, page_entries: int, device, pages: int):
        self.D, self.P, self.device = dim, page_entries, torch.device(device)
        n = max(pages, 1) + 1  # + the trash page
        self.dev = empty_qtensor(FMT, (n, page_entries, dim), self.device)
        self.free = list(range(n - 1, TRASH_PAGE, -1))
        self.generation = 0  # bumped whenever the pool or a block table is reallocated

    @property
    def page_bytes(self) -> int:
        return self.P * (self.D // 2 + self.D // 32)

    @property
    def trash_row(self) -> int:
        """First pool row of the trash page: where masked writes go."""
        return TRASH_PAGE * self.P

    @property
    def pages_in_use(self) -> int:
        return self.dev.shape[0] - 1 - len(self.free)

    def alloc(self) -> int:
        if not self.free:
            self._grow()
        return self.free.pop()

    def release(self, pages: list[int]) -> None:
        """Give ``pages`` back to the pool."""
        self.free.extend(pages)

    def grow_to(self, pages: int) -> None:
        """Allocate ``pages`` pages now, so the pool need not be reallocated (moved) later."""
        if pages + 1 > self.dev.shape[0]:
            self._grow(pages + 1)

    def _grow(self, rows: int | None = None) -> None:
        """Double the pool (``rows``: to this many pages, the trash page included)."""
        n = self.dev.shape[0]
        m = max(2 * n, rows or 0)
        grown = empty_qtensor(FMT, (m, self.P, self.D), self.device)
        grown.data[:n], grown.scale[:n] = self.dev.data, self.dev.scale
        self.dev = grown
        self.free = list(range(m - 1, n - 1, -1)) + self.free
        self.generation += 1

    def segment(self) -> QTensor:
        """The pool as one ``[1, pages * P, D]`` QTensor (a view, no copy)."""
        n = self.dev.shape[0] * self.P
        return QTensor(self.dev.data.view(1, n, -1), self.dev.scale.view(1, n, -1), FMT, (1, n, self.D))


class PagedIndexK:
    """The index K of one source layer for a batch: a block-table row per sequence."""

    def __init__(self, pool: IndexPool, batch: int, entries: int):
        self.pool = pool
        self.pages: list[list[int]] = [[] for _ in range(batch)]  # host mirror of the table
        width = max(1, -(-entries // pool.P))
        self.table = torch.full((batch, width), TRASH_PAGE, dtype=torch.int32, device=pool.device)

    @property
    def batch(self) -> int:
        return len(self.pages)

    def ensure_pages(self, pages: int) -> None:
        """Room for ``pages`` pages per row: reallocate the table with doubling (a new buffer)."""
        width = self.table.shape[1]
        if pages <= width:
            return
        table = torch.full((self.batch, max(pages, 2 * width)), TRASH_PAGE, dtype=torch.int32, device=self.pool.device)
        table[:, :width] = self.table
        self.table = table
        self.pool.generation += 1

    def reserve(self, row: int, entries: int) -> None:
        """Pages for entries ``< entries`` of ``row``; new ones are written into the table in place."""
        have, need = len(self.pages[row]), -(-entries // self.pool.P)
        if need <= have:
            return
        self.ensure_pages(need)
        new = [self.pool.alloc() for _ in range(need - have)]
        self.pages[row] += new
        self.table[row, have:need] = to_device(new, self.pool.device, torch.int32)

    def reserve_rows(self, ends: list[int]) -> None:
        """:meth:`reserve` of every row in order (``ends[row]`` entries); rows with room are skipped
        and the new pages go into the table in one copy."""
        P, cells = self.pool.P, []
        try:
            for row, (pages, end) in enumerate(zip(self.pages, ends)):
                need = -(-end // P)
                if need > len(pages):
                    self.ensure_pages(need)
                    while len(pages) < need:
                        pages.append(self.pool.alloc())
                        cells.append((row, len(pages) - 1, pages[-1]))
        finally:  # pages handed out before a failure are in the table too
            if cells:
                rows, cols, ids = to_device(cells, self.pool.device).T
                self.table[rows, cols] = ids.to(torch.int32)

    def detach_row(self, row: int) -> list[int]:
        """Hand ``row``'s pages to another owner; the row is left with none (its table row reads
        the trash page)."""
        pages, self.pages[row] = self.pages[row], []
        if pages:  # a row with no pages reads the trash page already (see :meth:`trim_row`)
            self.table[row] = TRASH_PAGE
        return pages

    def clear_row(self, row: int) -> None:
        """Give ``row``'s pages back to the pool."""
        self.pool.release(self.detach_row(row))

    def trim_row(self, row: int, entries: int) -> None:
        """Give back ``row``'s pages past those holding entries ``< entries`` (a rolled-back step's)."""
        keep = -(-entries // self.pool.P)
        if len(self.pages[row]) > keep:
            self.pool.release(self.pages[row][keep:])
            self.pages[row] = self.pages[row][:keep]
            self.table[row, keep:] = TRASH_PAGE

    def adopt_row(self, row: int, pages: list[int]) -> None:
        """``row`` takes over ``pages`` (of the same pool, no copy); its own go back first."""
        self.clear_row(row)
        self.ensure_pages(len(pages))
        self.pages[row] = list(pages)
        if pages:
            self.table[row, :len(pages)] = to_device(pages, self.pool.device, torch.int32)

    def keys(self, entries: int) -> PagedKeys:
        """The first ``entries`` entries of every row, read in place."""
        self.ensure_pages(-(-entries // self.pool.P))
        return PagedKeys(self.pool.segment(), self.table, self.pool.P, entries)

    def write(self, entry: torch.Tensor, mask: torch.Tensor, values: QTensor) -> None:
        """Store ``values`` [B, n, D] at entries ``entry`` [B, n] where ``mask`` (pages reserved);
        the other rows go to the trash row, so nothing is filtered on the host."""
        write_paged(*self.target(), entry, mask, values)

    def target(self) -> tuple:
        """(pool, block table) of a write (``kv.util.write_paged``)."""
        return self.pool, self.table

    def _rows(self, row: int, lo: int, hi: int) -> torch.Tensor:
        """Pool rows of entries ``[lo, hi)`` of ``row``, computed on the pool's device: only the
        row's page list crosses (no wait on the device's queue), not one index per entry."""
        P, dev = self.pool.P, self.pool.device
        pages = to_device(self.pages[row][lo // P:-(-hi // P)], dev)
        t = torch.arange(lo - lo // P * P, hi - lo // P * P, device=dev)
        return pages[t // P] * P + t % P

    def gather_row(self, row: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries ``[lo, hi)`` of ``row`` as uint8 (data, scale) rows on the pool's device (new tensors)."""
        seg, rows, u8 = self.pool.segment(), self._rows(row, lo, hi), torch.uint8
        return seg.data.view(u8)[0, rows], seg.scale.view(u8)[0, rows]

    def read_row(self, row: int, lo: int, hi: int) -> QTensor:
        """Entries ``[lo, hi)`` of ``row`` as a CPU QTensor ``[hi - lo, D]``."""
        data, scale = (t.cpu() for t in self.gather_row(row, lo, hi))
        seg = self.pool.segment()
        return QTensor(data.view(seg.data.dtype), scale.view(seg.scale.dtype), FMT, (hi - lo, self.pool.D))

    def write_row(self, row: int, lo: int, values: QTensor) -> None:
        """Store ``values`` [n, D] as entries ``[lo, lo + n)`` of ``row`` (pages reserved here)."""
        hi = lo + values.shape[0]
        self.reserve(row, hi)
        rows = self._rows(row, lo, hi)
        write_rows(self.pool.segment(), torch.zeros_like(rows), rows, values.to(self.pool.device))

    @staticmethod
    def cat(parts: list["PagedIndexK"]) -> "PagedIndexK":
        """One batch holding the rows of ``parts`` (drawn from one pool) in order."""
        out = PagedIndexK(parts[0].pool, 0, 1)
        out.pages = [list(p) for part in parts for p in part.pages]
        width = max(p.table.shape[1] for p in parts)
        out.table = torch.full((len(out.pages), width), TRASH_PAGE, dtype=torch.int32, device=out.pool.device)
        b = 0
        for part in parts:
            out.table[b:b + part.batch, :part.table.shape[1]] = part.table
            b += part.batch
        return out
