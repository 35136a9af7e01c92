"""The per-forward metadata every layer reads: positions, rotary factors, what sources published."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashrt import ops
from flashrt.rope import YaRN, rope_frequencies
from flashrt.kv.state import KVState


@dataclass(slots=True)
class StepContext:
    """One forward call over a chunk of ``S`` tokens per sequence.

    positions: [B, S] absolute positions (row b covers ``start[b] .. start[b] + S - 1``).
    state: the sequences' caches. shared: what source layers published this call (compressed
    top-k per index source, the candidate pool). engram_ids: [B, S, n_engram_layers, cols].
    compress_done: KV-source layers whose entries for this chunk were already written (CED).
    """

    positions: torch.Tensor
    end: int  # 1 + the largest position in the chunk (host-side, no device sync)
    state: KVState
    rope: "RopeCache"
    engram_ids: torch.Tensor | None = None
    shared: dict = field(default_factory=dict)
    compress_done: frozenset = frozenset()
    token_mask: torch.Tensor | None = None  # [B, S] bool, False: no Engram for that token
    entries: dict | None = None  # ratio -> compressed entries to read (a CUDA graph's static bucket)
    next_history: torch.Tensor | None = None  # Engram history after this chunk: committed with advance()
    vl_mask: torch.Tensor | None = None  # [B, S] bool, True inside an image span: the MoE gate uses bias_vl

    def entries_for(self, ratio: int) -> int:
        """Compressed entries a layer of this ``ratio`` reads: every complete group up to ``end``, or
        the static bucket a captured decode step reads (the extra entries are not visible)."""
        return self.entries[ratio] if self.entries is not None else self.end // ratio

    def visible(self, ratio: int) -> torch.Tensor:
        """int32 [B, S]: compressed entries of this ``ratio`` each query sees (its complete groups),
        computed once per call and shared by the layers of that ratio."""
        key = ("visible", ratio)
        if key not in self.shared:
            self.shared[key] = ((self.positions + 1) // ratio).to(torch.int32)
        return self.shared[key]

    def factors(self, compressed: bool) -> torch.Tensor:
        """Rotary factors of this chunk's positions, computed once per call and shared by layers."""
        key = ("rope", compressed)
        if key not in self.shared:
            self.shared[key] = self.rope.factors(compressed, self.positions)
        return self.shared[key]


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

    def factors(self, compressed: bool, positions: torch.Tensor) -> torch.Tensor:
        """complex64 ``[*positions.shape, R/2]``."""
        freqs = self.compressed if compressed else self.window
        angles = positions.to(torch.float32).unsqueeze(-1) * freqs
        return torch.polar(torch.ones_like(angles), angles)


def rope_tail(x: torch.Tensor, factors: torch.Tensor, rd: int, inverse: bool = False) -> torch.Tensor:
    """Rotary embedding on the last ``rd`` channels of ``x`` [B, S, (H,) D]."""
    return torch.cat([x[..., :-rd], ops.rope(x[..., -rd:], factors, inverse)], dim=-1)
