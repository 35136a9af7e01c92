"""The per-call integers and rotary factors the layers read, in a fixed number of launches.

Every such integer is ``(positions + 1) // d * m - c`` for one row ``(d, m, c)`` of a small
constant table:

- the compressed entries a query sees at ratio ``r`` (an index source's ``visible``): ``(r, 1, 0)``;
- a rotary position (the window layers' and the compressed layers' factors): ``(1, 1, 1)``;
- in a decode step, the position of the entry a ratio-``r`` compressor completes,
  ``((p + 1) // r - 1) * r`` (``compress_decode``'s entry times ``r``): ``(r, r, r)``.

All rows come from one add, one floor division and one ``addcmul`` over ``[rows, B, S]``; the
visible rows are cast to int32 in one launch and the rotary rows, times their frequencies
(promoted to fp32 inside the multiply), go through one ``polar``: each factor is bit-identical to
``RopeCache.factors`` of the same position.
"""
from __future__ import annotations

import torch


class StepRows:
    """The constant table of one :class:`~flashrt.graphs.context.StepNeeds`, a chunk of one token
    (decode: with the compressors' entry rows) or of more."""

    def __init__(self, needs, window_freqs: torch.Tensor, compressed_freqs: torch.Tensor, decode: bool):
        device = window_freqs.device
        self.visible = tuple(needs.index_ratios)
        rows = [(r, 1, 0) for r in self.visible]
        self.rotary, freqs = [], []  # rotary row names: "window", "compressed" or an entry ratio
        if needs.window_rope:
            self.rotary.append("window")
            rows.append((1, 1, 1))
            freqs.append(window_freqs)
        if needs.ratios:
            self.rotary.append("compressed")
            rows.append((1, 1, 1))
            freqs.append(compressed_freqs)
        for r in needs.entry_ratios if decode else ():
            self.rotary.append(r)
            rows.append((r, r, r))
            freqs.append(compressed_freqs)
        dmc = torch.tensor(rows, dtype=torch.long, device=device).reshape(-1, 3).T.reshape(3, -1, 1, 1)
        self.d, self.m, self.neg_c = dmc[0], dmc[1], -dmc[2]  # each [rows, 1, 1]
        self.freqs = torch.stack(freqs).unsqueeze(1).unsqueeze(1) if freqs else None  # [rotary, 1, 1, R/2]
        self.one = torch.ones((), dtype=torch.float32, device=device)

    def __call__(self, positions: torch.Tensor) -> tuple[dict, dict]:
        """(ratio -> int32 [B, S] visible entries, rotary name -> complex64 [B, S, R/2] factors)."""
        if self.d.shape[0] == 0:
            return {}, {}
        table = torch.addcmul(self.neg_c, (positions + 1) // self.d, self.m)  # int64 [rows, B, S]
        nv = len(self.visible)
        visible = table[:nv].to(torch.int32) if nv else None
        factors = {}
        if self.rotary:
            angles = table[nv:].unsqueeze(-1) * self.freqs
            both = torch.polar(self.one.expand_as(angles), angles)  # a stride-0 view of 1: no fill launch
            factors = {name: both[i] for i, name in enumerate(self.rotary)}
        return {r: visible[i] for i, r in enumerate(self.visible)}, factors
