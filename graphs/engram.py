"""Engram block: n-gram hash lookups gated into the residual stream (v41-model.md, 5).

``kv = wkv(concat(engram_lookup(table, ids)))`` gives one key per hc copy and one shared value;
``engram_gate`` mixes the value into each copy by how well the key matches it. Positions where the
token mask is False (image tokens) pass through unchanged.
"""
from __future__ import annotations

import torch

from flashrt import ops

from .context import StepContext


class Engram:
    def __init__(self, cfg, layer: int, w: dict, prefix: str):
        p = prefix + "engram."
        self.cfg, self.slot = cfg, cfg.engram_layer_ids.index(layer)
        self.table = w[p + "embed.weight"]
        self.wkv = w[p + "wkv.weight"]
        self.weight = w[p + "q_weight"].to(torch.float32) * w[p + "k_weight"].to(torch.float32)

    def forward(self, x: torch.Tensor, ctx: StepContext, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        B, S, hc, D = x.shape
        ids = ctx.engram_ids[:, :, self.slot]  # [B, S, cols]
        rows = ops.engram_lookup(self.table, ids).flatten(-2)  # [B, S, cols * head_dim] bf16
        kv = ops.linear(rows.to(x.dtype), self.wkv)
        key = kv[..., : hc * D].reshape(B, S, hc, D)
        value = kv[..., hc * D:]
        out = ops.engram_gate(x, key, value, self.weight, cfg.norm_eps)
        if token_mask is not None:
            out = torch.where(token_mask.view(B, S, 1, 1), out, x)
        return out
