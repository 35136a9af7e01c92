"""Per-sequence decode state: window rings, compressor partial groups, compressed caches, index K.

Stored as the published model stores them, quantized: window rings in ``fp8`` (528 B per 512-dim
slot), compressed main KV in ``fp4_b16`` (288 B per entry) and index K in ``fp4_b32`` (68 B per
128-dim entry). The model reads and writes KV only through :class:`KVState`.

HKCP tiers: main KV lives in pages (:mod:`flashrt.kv.pages`) — device pages up to ``kv_budget``
bytes, older pages spilled to (pinned) host memory; index K lives in device pages
(:mod:`flashrt.kv.index`) for every entry, never spilled, so the indexer scores every position
(reading the pages in place); after top-k only the selected cold entries are fetched.
Budget split: ``kv_budget`` = fixed state (rings, compressor partial groups, index-K pages for
``capacity`` positions, one trash page per pool) + main-KV device pages (the rest).
Rows of a batch are independent sequences at their own positions.

Steps are transactional: a forward call that fails part-way leaves the state as it was, so the
same call can be retried bit-exactly. A one-token step writes in place (rings, partial groups,
entries: a retry writes the same bytes to the same slots and no query reads a slot before the step
writes it), so a decode step stays a pure device function. A chunk of S >= 2 tokens would overwrite
ring slots and the pending group that its own queries read: those writes are staged and land in
:meth:`KVState.commit` (from :meth:`KVState.advance`); its compressed entries are new slots, written
in place. Positions and the Engram history move in :meth:`KVState.advance` only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrt.formats import MAIN_KV_FORMAT, QTensor
from .util import empty_qtensor, grown, to_device, write_paged_many
from .index import IndexPool, PagedIndexK
from .main_kv import PagedMainKV
from .pages import PagePool
from .paged import PagedKeys
from .rows import RowMoves
from .staged import Staged
from .window_writes import StagedWrites
from .sizes import DEFAULT_PAGE_ENTRIES, entry_bytes, fixed_bytes_for, index_pages_for  # noqa: F401 (named here too)

WINDOW_FORMATS = ("fp8", "int8")  # int8 (per-32, UE8M0) on devices with no FP8, e.g. Ascend 910B


@dataclass
class CompressedCache:
    """One KV-source layer: paged main KV, index K and the partial group waiting to be pooled."""

    main: PagedMainKV | QTensor  # QTensor [B, T, D] only on the meta device (shape tracing)
    index_k: PagedIndexK | QTensor  # device pages; QTensor [B, capacity // ratio, Di] only on meta
    kv_state: torch.Tensor | None  # fp32 [B, ratio, head_dim] (ratio > 1)
    score_state: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class StepBuffers:
    """What a static one-token step (a captured CUDA graph) reads and writes in place."""

    tensors: tuple  # every state tensor the step reads or writes
    cold: tuple  # per KV source: whether main-KV pages live on the host tier (the resolve differs)

    def layout(self) -> tuple:
        """Address and shape of each tensor: a graph recorded for another layout reads stale memory."""
        return tuple((t.data_ptr(), tuple(t.shape)) for t in self.tensors)


class KVState(RowMoves, StagedWrites):
    """Everything a batch of sequences carries between forward calls."""

    def __init__(self, cfg, batch: int, capacity: int, device, kv_budget: int | None = None,
                 page_entries: int = DEFAULT_PAGE_ENTRIES, pool: PagePool | None = None, window_fmt: str = "fp8"):
        if window_fmt not in WINDOW_FORMATS:
            raise ValueError(f"window_fmt: expected one of {list(WINDOW_FORMATS)}, got {window_fmt!r}")
        self.cfg, self.batch, self.capacity, self.window_fmt = cfg, batch, capacity, window_fmt
        self.device = torch.device(device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.row_ids = torch.arange(batch, device=self.device)  # the rows' numbers (ring writes)
        self.host_positions = [0] * batch  # the same on the host: no device sync to read them
        hd, L, W = cfg.head_dim, cfg.total_layers, cfg.window_size
        # every layer's ring is a view of one [layers, batch, W, hd] store (and ring_start of one
        # [layers, batch] tensor), so moving or clearing a row is one copy, not one per layer
        self._ring_store = empty_qtensor(window_fmt, (L, batch, W, hd), self.device)
        self.rings = {l: QTensor(self._ring_store.data[l], self._ring_store.scale[l], window_fmt, (batch, W, hd))
                      for l in range(L)}
        # positions below ring_start[l] are not in layer l's ring (CED / bounded replay)
        self._ring_start_store = torch.zeros(L, batch, dtype=torch.long, device=self.device)
        self.ring_start = {l: self._ring_start_store[l] for l in self.rings}
        self._staged = Staged()  # a chunk's ring and partial-group writes, until commit()
        self._chunk_len = 0  # tokens per row of the current call (begin_step)
        n_hist = max(cfg.engram_max_ngram_size - 1, 0)
        self.engram_history = torch.full((batch, n_hist), -1, dtype=torch.long, device=self.device)
        self.pool = pool or (None if self.is_meta else self._pool(kv_budget, page_entries))
        if self.pool is not None and self.pool.index_pool is None:
            self.pool.index_pool = IndexPool(cfg.index_head_dim, self.pool.P, self.device,
                                             index_pages_for(cfg, batch, capacity, self.pool.P))
        self.index_pool = None if self.pool is None else self.pool.index_pool
        self.compressed: dict[int, CompressedCache] = {}
        for l in cfg.kv_source_layers:
            r, entries = cfg.ratio(l), -(-capacity // cfg.ratio(l))
            st = (batch, r, hd)
            meta = lambda fmt, dim: empty_qtensor(fmt, (batch, entries, dim), self.device)
            self.compressed[l] = CompressedCache(
                meta(MAIN_KV_FORMAT, hd) if self.is_meta else PagedMainKV(self.pool, batch, entries),
                meta("fp4_b32", cfg.index_head_dim) if self.is_meta else PagedIndexK(self.index_pool, batch, entries),
                torch.zeros(st, device=self.device) if r > 1 else None,
                torch.full(st, float("-inf"), device=self.device) if r > 1 else None)

    def _pool(self, kv_budget: int | None, page_entries: int) -> PagePool:
        return KVState.pool_for(self.cfg, self.batch, self.capacity, self.device, kv_budget, page_entries)

    @staticmethod
    def pool_for(cfg, batch: int, capacity: int, device, kv_budget: int | None,
                 page_entries: int = DEFAULT_PAGE_ENTRIES, cold_bytes: int | None = None) -> PagePool | None:
        """The page pools of a batch: main KV (the returned :class:`PagePool`) and index K (its
        ``index_pool``, pages for ``capacity`` positions, device only). Without ``kv_budget`` both
        grow on demand; with it the main pool may grow (doubling) to the device pages left after the
        fixed state (:func:`fixed_bytes_for`), then spills older pages to host memory, at most
        ``cold_bytes`` of them (None: no limit)."""
        if torch.device(device).type == "meta":
            return None
        index = IndexPool(cfg.index_head_dim, page_entries, device, index_pages_for(cfg, batch, capacity, page_entries))
        if kv_budget is None:
            pool = PagePool(cfg.head_dim, page_entries, device, None)
        else:
            fixed = fixed_bytes_for(cfg, batch, capacity, page_entries)
            pages = (kv_budget - fixed) // (page_entries * entry_bytes(cfg.head_dim, MAIN_KV_FORMAT))
            if pages < 2 * len(cfg.kv_source_layers):
                raise ValueError(f"kv_budget: {kv_budget:,} bytes leave room for {max(pages, 0)} main-KV pages after "
                                 f"the fixed state ({fixed:,} bytes: rings, index-K pages, compressor state)")
            page = page_entries * entry_bytes(cfg.head_dim, MAIN_KV_FORMAT)
            pool = PagePool(cfg.head_dim, page_entries, device, int(pages),
                            None if cold_bytes is None else max(cold_bytes // page, 1))
        pool.index_pool = index
        return pool

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    @property
    def generation(self) -> int:
        """Grows whenever a pool's storage or a block-table buffer is reallocated (device
        pointers cached from an older generation, e.g. by a CUDA graph, are stale)."""
        return 0 if self.pool is None else self.pool.generation + self.index_pool.generation

    # ----- steps -------------------------------------------------------------------------------
    def advance(self, tokens, engram_history: torch.Tensor | None = None, committed: bool = False) -> None:
        """Every row has run ``tokens`` more positions (and its Engram history is now
        ``engram_history``, when given); what the step staged is committed first (``committed``:
        the caller already wrote it, e.g. :meth:`commit_kept` replayed from a CUDA graph). Until
        then a failed step leaves the state as it was for a retry.

        ``tokens`` a list (one count per row, each at most the chunk's length): row ``b`` keeps only
        the first ``tokens[b]`` tokens of the chunk just run (speculative verification): rings and
        the pending group take only those, and main-KV / index-K pages reserved past them go back
        to the pools. Entries the chunk wrote past them are never read before they are rewritten."""
        counts = [tokens] * self.batch if isinstance(tokens, int) else list(tokens)
        if len(counts) != self.batch:
            raise ValueError(f"tokens: expected one count per row ({self.batch}), got {len(counts)}")
        if committed:
            self._staged = Staged()
        else:
            self.commit(counts)
        if engram_history is not None:
            self.engram_history = engram_history
        if isinstance(tokens, int):
            self.positions += tokens
        else:
            self.positions += to_device(counts, self.device)
            self.trim_rows([p + c for p, c in zip(self.host_positions, counts)])
        self.host_positions = [p + c for p, c in zip(self.host_positions, counts)]

    def trim_rows(self, positions: list[int]) -> None:
        """Give back main-KV and index-K pages past the entries of ``positions[b]`` tokens."""
        if self.is_meta:
            return
        for l, c in self.compressed.items():
            for row, pos in enumerate(positions):
                c.main.trim_row(row, pos // self.cfg.ratio(l))
                c.index_k.trim_row(row, pos // self.cfg.ratio(l))

    def begin_step(self, tokens: int) -> None:
        """Before a chunk of ``tokens`` per row: room for its index K and main-KV pages; what a
        failed call staged is dropped."""
        if self._staged:
            self._staged = Staged()
        self._chunk_len = tokens
        self.ensure_capacity(max(self.host_positions) + tokens)
        if self.is_meta:
            return
        self.pool.unlock()
        positions = self.host_positions
        ratios = {l: self.cfg.ratio(l) for l in self.compressed}
        firsts = {l: [p // r for p in positions] for l, r in ratios.items()}
        for l, c in self.compressed.items():  # before any page is allocated (an allocation may spill)
            c.main.lock_rows(firsts[l])
        for l, c in self.compressed.items():  # rows whose pages already hold the chunk are skipped
            r = ratios[l]
            ends = [(p + tokens) // r for p in positions]
            c.main.reserve_rows(ends, firsts[l])
            c.index_k.reserve_rows(ends)

    def ensure_capacity(self, positions: int) -> None:
        """Room (doubling) for ``positions`` positions: wider index block tables (index pages come
        on demand in :meth:`begin_step`); on meta, grown contiguous caches."""
        if positions <= self.capacity:
            return
        capacity = max(positions, 2 * self.capacity)
        for l, c in self.compressed.items():
            entries = -(-capacity // self.cfg.ratio(l))
            if self.is_meta:
                c.index_k, c.main = grown(c.index_k, entries), grown(c.main, entries)
            else:
                c.index_k.ensure_pages(-(-entries // self.index_pool.P))
        self.capacity = capacity

    def step_buffers(self, entries: dict[int, int]) -> StepBuffers:
        """Ready the caches for a static one-token step that reads ``entries`` compressed entries
        per ratio (room for them, block tables brought up to date in place) and return the
        buffers it reads and writes; call after :meth:`begin_step`."""
        self.ensure_capacity(max([max(self.host_positions) + 1] + [t * r for r, t in entries.items()]))
        tensors = [self.positions]
        for q in (self.pool.dev, self.pool.host, self.index_pool.dev):  # the host pool: pinned, read by the gather
            tensors += [q.data, q.scale]
        for c in self.compressed.values():
            tensors += [c.index_k.table, c.kv_state, c.score_state, c.main.dev_ids(), c.main.host_ids_device()]
        for l, ring in self.rings.items():
            tensors += [ring.data, ring.scale, self.ring_start[l]]
        cold = tuple(c.main.has_cold() for c in self.compressed.values())
        return StepBuffers(tuple(t for t in tensors if t is not None), cold)

    def ring_starts(self) -> tuple[tuple, torch.Tensor]:
        """(ring layers, int64 [L, B] their ring starts): the one store when the rings share it."""
        layers = tuple(self.ring_start)
        if self._ring_start_store is not None and layers == tuple(range(self._ring_start_store.shape[0])):
            return layers, self._ring_start_store
        empty = torch.zeros(0, self.batch, dtype=torch.long, device=self.device)
        return layers, torch.stack([self.ring_start[l] for l in layers]) if layers else empty

    # ----- compressed caches -------------------------------------------------------------------
    def append_entries(self, layer: int, main: QTensor, index_k: QTensor, entry: torch.Tensor, mask) -> None:
        """Write compressed entries ``main``/``index_k`` [B, n, *] at entry numbers ``entry``
        [B, n] where ``mask`` [B, n] is True (their pages were reserved by :meth:`begin_step`)."""
        if self.is_meta:
            return
        cache = self.compressed[layer]
        write_paged_many(((*cache.index_k.target(), index_k), (*cache.main.target(), main)), entry, mask)

    def index_keys(self, layer: int, entries: int) -> PagedKeys | QTensor:
        """Index K of source ``layer``: the first ``entries`` entries of every row, as a paged
        view read in place by ``ops.index_scores`` (a QTensor on meta)."""
        index_k = self.compressed[layer].index_k
        return index_k.narrow(1, 0, entries) if self.is_meta else index_k.keys(entries)

    def main_segments(self, layer: int, topk: torch.Tensor, entries: int, offset: int = 0) -> tuple[list, torch.Tensor]:
        """KV segments holding the entries ``topk`` [B, S, K] picks, and indices into them, each
        but -1 plus ``offset`` (the rows the attention reads before the segments)."""
        main = self.compressed[layer].main
        if self.is_meta:
            return [main.narrow(1, 0, entries)], torch.where(topk >= 0, topk + offset, topk)
        return main.resolve(topk, offset)

    # ----- accounting --------------------------------------------------------------------------
    def global_kv_bytes_per_token(self) -> float:
        """Bytes the growing caches add per token (main KV + index K over all source layers)."""
        per = entry_bytes(self.cfg.head_dim, MAIN_KV_FORMAT) + entry_bytes(self.cfg.index_head_dim, "fp4_b32")
        return sum(per / self.cfg.ratio(l) for l in self.compressed)

    def window_bytes(self) -> int:
        """Fixed bytes of the window rings of the batch."""
        return sum(r.nbytes for r in self.rings.values())

    def tier_stats(self) -> dict:
        """Pages of main KV per tier (device pool size, cold pages in use, spills so far)."""
        if self.pool is None:
            return {}
        cold = sum(t.cold for c in self.compressed.values() for t in c.main.tables)
        return {"device_pages": self.pool.device_pages, "device_page_limit": self.pool.limit,
                "page_entries": self.pool.P, "cold_pages": cold,
                "spilled_pages": self.pool.spilled, "page_bytes": self.pool.page_bytes,
                "index_pages": self.index_pool.pages_in_use, "index_page_bytes": self.index_pool.page_bytes}

    @staticmethod
    def cat(states: list["KVState"]) -> "KVState":
        """One state holding the rows of ``states`` in order (same config, capacity and pool)."""
        first = states[0]
        if any(s.pool is not first.pool for s in states):
            raise ValueError("states: KVState.cat needs states drawn from one page pool")
        out = object.__new__(KVState)
        out.cfg, out.capacity, out.device, out.pool = first.cfg, first.capacity, first.device, first.pool
        out.index_pool = first.index_pool
        out.window_fmt = first.window_fmt
        out.batch = sum(s.batch for s in states)
        out.positions = torch.cat([s.positions for s in states])
        out.row_ids = torch.arange(out.batch, device=out.device)
        out.host_positions = [p for s in states for p in s.host_positions]
        cat_q = lambda qs: QTensor(torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs]),
                                   qs[0].fmt, (out.batch, *qs[0].shape[1:]))
        out.rings = {l: cat_q([s.rings[l] for s in states]) for l in first.rings}
        out.ring_start = {l: torch.cat([s.ring_start[l] for s in states]) for l in first.ring_start}
        out._ring_store = out._ring_start_store = None  # separate tensors per layer
        out._staged, out._chunk_len = Staged(), 0
        out.compressed = {}
        for l, c in first.compressed.items():
            parts = [s.compressed[l] for s in states]
            main = PagedMainKV(first.pool, 0)
            main.tables = [t for p in parts for t in p.main.tables]
            st = None if c.kv_state is None else torch.cat([p.kv_state for p in parts])
            sc = None if c.score_state is None else torch.cat([p.score_state for p in parts])
            out.compressed[l] = CompressedCache(main, PagedIndexK.cat([p.index_k for p in parts]), st, sc)
        out.engram_history = torch.cat([s.engram_history for s in states])
        return out
