"""The per-forward metadata every layer reads (computed once per call) and what source layers publish."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from flashrt import ops
from flashrt.rope import YaRN, rope_frequencies
from flashrt.kv.state import KVState

from .mix_stream import run_inline
from .step_rows import StepRows

STEP_ROWS = 256  # chunks of at most this many query rows (B * S) build every layer's window indices at once


@dataclass(slots=True)
class Selection:
    """What one index source's top-k resolves to, shared by the layers that reuse its top-k."""

    segments: list  # main-KV segments holding the picked entries
    indices: torch.Tensor | None  # int32 [B, S, K] into [ring (W) ‖ chunk (S) ‖ segments]; -1: no pick
    # every visible entry picked (a prompt chunk while the top-k takes them all): instead of indices,
    # where each entry lies (int32 [B, T], as indices) and how many each query sees (int32 [B, S])
    entries: torch.Tensor | None = None
    visible: torch.Tensor | None = None


@dataclass(slots=True)
class StepContext:
    """One forward call over a chunk of ``S`` tokens per sequence (row b covers positions
    ``start[b] .. start[b] + S - 1``): built once per call by :meth:`build`, read by every layer.
    The layers publish into ``selections`` and ``candidates``; nothing else changes during a call."""

    positions: torch.Tensor  # [B, S] absolute positions
    end: int  # 1 + the largest position in the chunk (host-side, no device sync)
    state: KVState
    rope: "RopeCache"
    rope_window: torch.Tensor | None = None  # complex64 [B, S, R/2]: window-only and draft layers
    rope_compressed: torch.Tensor | None = None  # the same for the compressed layers
    entry_rope: dict = field(default_factory=dict)  # ratio -> factors of the entry a decode compressor completes
    window_index: dict | None = None  # layer -> its window_indices (decode-sized chunks: step_window_indices)
    ring_slots: tuple | None = None  # KVState.ring_slots(positions): where every layer writes its ring
    visible: dict = field(default_factory=dict)  # ratio -> int32 [B, S]: entries each query sees
    entries: dict = field(default_factory=dict)  # ratio -> compressed entries a layer reads
    shared_route: tuple | None = None  # (weights, experts) of the shared expert for the B * S tokens
    engram_ids: torch.Tensor | None = None  # [B, S, n_engram_layers, cols]
    engram_rows: dict = field(default_factory=dict)  # Engram slot -> (staged rows, copy event or None)
    token_mask: torch.Tensor | None = None  # [B, S] bool, False: no Engram for that token
    compress_done: frozenset = frozenset()  # KV sources whose entries for this chunk exist (CED)
    next_history: torch.Tensor | None = None  # Engram history after this chunk: committed with advance()
    vl_mask: torch.Tensor | None = None  # [B, S] bool, True inside an image span: the MoE gate uses bias_vl
    static_chunk: bool = False  # a chunk laid out from device values only (captured verify steps)
    selections: dict = field(default_factory=dict)  # index-source layer -> Selection (published)
    candidates: torch.Tensor | None = None  # the candidate source's blocks (published)
    fork: Callable = run_inline  # starts a block's mHC coefficients (graphs/mix_stream.py)
    fork_select: Callable = run_inline  # starts an attention layer's compressor and indexer (the same)

    @classmethod
    def build(cls, needs: "StepNeeds", rope: "RopeCache", state: KVState, positions: torch.Tensor, end: int,
              routes=None, entries: dict | None = None, **fields) -> "StepContext":
        """Everything the layers read, computed once for this call. ``routes(n, device)``: the shared
        expert's routes (None: no shared expert). ``entries``: ratio -> compressed entries to read
        (a captured step's static bucket; default: every complete group up to ``end``; the extra
        entries of a bucket are visible to no query)."""
        B, S = positions.shape
        visible, factors = rope.rows(needs, S == 1)(positions)
        return cls(
            positions, end, state, rope,
            rope_window=factors.get("window"), rope_compressed=factors.get("compressed"),
            entry_rope={r: f for r, f in factors.items() if isinstance(r, int)},
            window_index=step_window_indices(positions, state, needs.window) if B * S <= STEP_ROWS else None,
            ring_slots=state.ring_slots(positions),
            visible=visible,
            entries=dict(entries) if entries is not None else {r: end // r for r in needs.ratios},
            shared_route=None if routes is None else routes(B * S, positions.device),
            **fields)


@dataclass(frozen=True, slots=True)
class StepNeeds:
    """What the layers of a config read every call (fixed per model, so worked out once)."""

    window: int  # window_size
    ratios: tuple  # compress ratios of the compressed layers
    index_ratios: tuple  # compress ratios of the index sources (their queries' visible counts)
    window_rope: bool  # window-only or draft layers exist
    entry_ratios: tuple = ()  # compress ratios > 1 of the KV sources (a decode step's entry factors)

    @classmethod
    def of(cls, cfg) -> "StepNeeds":
        return cls(cfg.window_size, tuple(sorted({cfg.ratio(l) for l in range(cfg.n_layers)} - {0})),
                   tuple(sorted({cfg.ratio(l) for l in cfg.index_source_layers})),
                   any(cfg.ratio(l) == 0 for l in range(cfg.total_layers)),
                   tuple(sorted({cfg.ratio(l) for l in cfg.kv_source_layers} - {0, 1})))


def window_indices(positions: torch.Tensor, ring_start: torch.Tensor, window: int) -> torch.Tensor:
    """int32 [B, S, W] indices into [ring (W slots) ‖ chunk (S)] of the W most recent positions of
    one layer (``ring_start`` int64 [B]): ``ops.window_indices`` of that layer alone."""
    return ops.window_indices(positions, ring_start.view(1, -1), window)[0]


def step_window_indices(positions: torch.Tensor, state: KVState, window: int) -> dict:
    """:func:`window_indices` of every ring layer of ``state`` in one ``ops.window_indices`` call:
    layer -> int32 [B, S, W] (a view of the [L, B, S, W] result)."""
    layers, starts = state.ring_starts()
    if not layers:
        return {}
    out = ops.window_indices(positions, starts, window)
    return {l: out[i] for i, l in enumerate(layers)}


class RopeCache:
    """Rotary factors ``exp(i * pos * f)`` for the window-only and the compressed layers.

    Computed per call from the frequencies (no max-length table), bit-identical to a table row.
    """

    def __init__(self, cfg, device):
        self.window = rope_frequencies(cfg.rope_head_dim, cfg.rope_theta).to(device)
        yarn = None
        if cfg.original_seq_len > 0:
            yarn = YaRN(cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
        self.compressed = rope_frequencies(cfg.rope_head_dim, cfg.compress_rope_theta, yarn).to(device)
        self.one = torch.ones((), dtype=torch.float32, device=device)
        # the model's step tables are made here, not at a call (a captured step cannot copy to the device)
        needs = StepNeeds.of(cfg)
        self._rows = {(needs, decode): StepRows(needs, self.window, self.compressed, decode) for decode in (False, True)}

    def rows(self, needs: "StepNeeds", decode: bool) -> StepRows:
        """The :class:`StepRows` of ``needs`` for a one-token (``decode``) or a longer chunk."""
        key = (needs, decode)
        if key not in self._rows:
            self._rows[key] = StepRows(needs, self.window, self.compressed, decode)
        return self._rows[key]

    def factors(self, compressed: bool, positions: torch.Tensor) -> torch.Tensor:
        """complex64 ``[*positions.shape, R/2]``."""
        freqs = self.compressed if compressed else self.window
        angles = positions.unsqueeze(-1) * freqs  # promoted to fp32 inside the multiply (one launch)
        return torch.polar(self.one.expand_as(angles), angles)  # a stride-0 view of 1: no fill launch


def quantized_rope_tail(x: torch.Tensor, norm, eps: float, factors: torch.Tensor, rd: int, fmt: str,
                        dequantize_to: torch.dtype | None = None):
    """``quantize(rope_tail(rms_norm(x, norm, eps)), fmt)`` (no norm when ``norm`` is None, no
    quantization when ``fmt`` is None) as one op, ``ops.norm_rope_quantize``: a KV row on its way
    into a cache, the attention's query heads (``fmt`` None), or (``dequantize_to``) the values it
    stands for (the indexer's fake-quantized queries)."""
    if factors.shape[-1] * 2 != rd:
        raise ValueError(f"factors: expected rd/2 = {rd // 2} pairs, got shape {tuple(factors.shape)}")
    return ops.norm_rope_quantize(x, norm, eps, factors, fmt, dequantize_to)


def rope_tail(x: torch.Tensor, factors: torch.Tensor, rd: int, inverse: bool = False) -> torch.Tensor:
    """Rotary embedding on the last ``rd`` channels of ``x`` [B, S, (H,) D] (``factors`` [.., rd/2]:
    ``ops.rope`` copies the other channels in the same call)."""
    if factors.shape[-1] * 2 != rd:
        raise ValueError(f"factors: expected rd/2 = {rd // 2} pairs, got shape {tuple(factors.shape)}")
    return ops.rope(x, factors, inverse)
