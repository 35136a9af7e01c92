"""Per-sequence decode state: window rings, compressor partial groups, compressed caches, index K.

Stored as the published model stores them, quantized: window rings in ``fp8`` (528 B per
512-dim slot), compressed main KV in ``fp4_b16`` (288 B per entry) and index K in ``fp4_b32``
(68 B per 128-dim entry). The model reads and writes KV only through :class:`KVState`.

Layout: one contiguous buffer per layer and batch row with ``capacity`` token positions (HKCP's
paged and tiered caches replace this storage; the interface stays). Rows of a batch are
independent sequences at their own positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import QTensor, expected_layout, spec


def empty_qtensor(fmt: str, shape, device) -> QTensor:
    """A zero-filled QTensor of logical ``shape`` (scales zero too: unwritten entries read as 0)."""
    data_shape, scale_shape = expected_layout(fmt, shape)
    s = spec(fmt)
    data = torch.zeros(data_shape, dtype=torch.uint8, device=device).view(s.data_dtype)
    scale = torch.zeros(scale_shape, dtype=torch.uint8, device=device).view(s.scale_dtype)
    return QTensor(data, scale, fmt, shape)


def write_rows(dst: QTensor, batch: torch.Tensor, slot: torch.Tensor, src: QTensor) -> None:
    """``dst[batch[i], slot[i]] = src[i]`` on the stored bytes (``src`` is [n, D])."""
    u8 = torch.uint8  # index_put is not implemented for the float8 dtypes: write the bytes
    dst.data.view(u8)[batch, slot] = src.data.reshape(-1, src.data.shape[-1]).view(u8)
    dst.scale.view(u8)[batch, slot] = src.scale.reshape(-1, src.scale.shape[-1]).view(u8)


def qtensor_rows(q: QTensor, mask: torch.Tensor) -> QTensor:
    """The rows of a [B, S, D] QTensor where ``mask`` [B, S] is True, as [n, D]."""
    return QTensor(q.data[mask], q.scale[mask], q.fmt, (int(mask.sum()), q.shape[-1]))


def _grown(q: QTensor, entries: int) -> QTensor:
    out = empty_qtensor(q.fmt, (q.shape[0], entries, q.shape[2]), q.device)
    n = q.shape[1]
    out.data[:, :n] = q.data
    out.scale[:, :n] = q.scale
    return out


@dataclass
class CompressedCache:
    """One KV-source layer: main KV, index K and the partial group waiting to be pooled."""

    main: QTensor  # fp4_b16 [B, capacity // ratio, head_dim]
    index_k: QTensor  # fp4_b32 [B, capacity // ratio, index_head_dim]
    kv_state: torch.Tensor | None  # fp32 [B, ratio, head_dim] (ratio > 1)
    score_state: torch.Tensor | None


class KVState:
    """Everything a batch of sequences carries between forward calls."""

    def __init__(self, cfg, batch: int, capacity: int, device, layers=None):
        self.cfg, self.batch, self.capacity = cfg, batch, capacity
        self.device = torch.device(device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.host_positions = [0] * batch  # the same on the host: no device sync to read them
        layers = range(cfg.total_layers) if layers is None else layers
        hd = cfg.head_dim
        self.rings = {l: empty_qtensor("fp8", (batch, cfg.window_size, hd), self.device) for l in layers}
        # positions below ring_start[l] are not in layer l's ring (CED / bounded replay)
        self.ring_start = {l: torch.zeros(batch, dtype=torch.long, device=self.device) for l in layers}
        self.compressed: dict[int, CompressedCache] = {}
        for l in cfg.kv_source_layers:
            r = cfg.ratio(l)
            entries = -(-capacity // r)
            st = (batch, r, hd)
            self.compressed[l] = CompressedCache(
                empty_qtensor("fp4_b16", (batch, entries, hd), self.device),
                empty_qtensor("fp4_b32", (batch, entries, cfg.index_head_dim), self.device),
                torch.zeros(st, device=self.device) if r > 1 else None,
                torch.full(st, float("-inf"), device=self.device) if r > 1 else None,
            )
        n_hist = max(cfg.engram_max_ngram_size - 1, 0)
        self.engram_history = torch.full((batch, n_hist), -1, dtype=torch.long, device=self.device)

    def advance(self, tokens: int) -> None:
        """Every row has run ``tokens`` more positions."""
        self.positions += tokens
        self.host_positions = [p + tokens for p in self.host_positions]

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    def ensure_capacity(self, positions: int) -> None:
        """Grow the compressed caches (doubling, copying what is stored) to hold ``positions``."""
        if positions <= self.capacity:
            return
        capacity = max(positions, 2 * self.capacity)
        for l, c in self.compressed.items():
            entries = -(-capacity // self.cfg.ratio(l))
            c.main = _grown(c.main, entries)
            c.index_k = _grown(c.index_k, entries)
        self.capacity = capacity

    # ----- window rings ------------------------------------------------------------------------
    def write_ring(self, layer: int, kv: QTensor, positions: torch.Tensor) -> None:
        """Store the last ``window_size`` tokens of a chunk ``kv`` [B, S, D] at slot ``pos % W``."""
        if self.is_meta:  # shape-only tracing: nothing is stored
            return
        W = self.cfg.window_size
        keep = positions >= positions[:, -1:] - (W - 1)  # [B, S]
        b = torch.arange(self.batch, device=self.device).unsqueeze(1).expand_as(positions)[keep]
        write_rows(self.rings[layer], b, positions[keep] % W, qtensor_rows(kv, keep))

    # ----- compressed caches -------------------------------------------------------------------
    def append_entries(self, layer: int, main: QTensor, index_k: QTensor, entry: torch.Tensor, mask) -> None:
        """Write compressed entries ``main``/``index_k`` [B, n, *] at entry numbers ``entry``
        [B, n] where ``mask`` [B, n] is True."""
        if self.is_meta:
            return
        cache = self.compressed[layer]
        b = torch.arange(self.batch, device=self.device).unsqueeze(1).expand_as(entry)[mask]
        write_rows(cache.main, b, entry[mask], qtensor_rows(main, mask))
        write_rows(cache.index_k, b, entry[mask], qtensor_rows(index_k, mask))

    # ----- accounting --------------------------------------------------------------------------
    def global_kv_bytes_per_token(self) -> float:
        """Bytes the growing caches add per token (main KV + index K over all source layers)."""
        total = 0.0
        for l, c in self.compressed.items():
            per_entry = c.main.nbytes / (c.main.shape[0] * c.main.shape[1])
            per_entry += c.index_k.nbytes / (c.index_k.shape[0] * c.index_k.shape[1])
            total += per_entry / self.cfg.ratio(l)
        return total

    def window_bytes(self) -> int:
        """Fixed bytes per batch of the window rings."""
        return sum(r.nbytes for r in self.rings.values())

    @staticmethod
    def cat(states: list["KVState"]) -> "KVState":
        """One state holding the rows of ``states`` in order (same config and capacity)."""
        first = states[0]
        out = object.__new__(KVState)
        out.cfg, out.capacity, out.device = first.cfg, first.capacity, first.device
        out.batch = sum(s.batch for s in states)
        out.positions = torch.cat([s.positions for s in states])
        out.host_positions = [p for s in states for p in s.host_positions]
        cat_q = lambda qs: QTensor(torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs]),
                                   qs[0].fmt, (out.batch, *qs[0].shape[1:]))
        out.rings = {l: cat_q([s.rings[l] for s in states]) for l in first.rings}
        out.ring_start = {l: torch.cat([s.ring_start[l] for s in states]) for l in first.ring_start}
        out.compressed = {}
        for l, c in first.compressed.items():
            parts = [s.compressed[l] for s in states]
            st = None if c.kv_state is None else torch.cat([p.kv_state for p in parts])
            sc = None if c.score_state is None else torch.cat([p.score_state for p in parts])
            out.compressed[l] = CompressedCache(cat_q([p.main for p in parts]), cat_q([p.index_k for p in parts]), st, sc)
        out.engram_history = torch.cat([s.engram_history for s in states])
        return out
