"""One block: mHC mixes around attention and MoE (docs/model.md, 3).

The attention input is collapsed with ``pre_mix`` (the previous block's FFN mix; one-hot for
block 0); the FFN input with the ``pre`` this block computed from its own input; the block hands
its FFN ``pre`` to the next block.
"""
from __future__ import annotations

import torch

from flashrt import ops

from .attention import Attention
from .context import StepContext
from .engram import Engram
from .moe import MoE


class Block:
    def __init__(self, cfg, layer: int, w: dict, prefix: str, parallel=None):
        self.cfg, self.layer = cfg, layer
        self.hc = {part: (w[f"{prefix}hc_{part}_fn"], w[f"{prefix}hc_{part}_scale"], w[f"{prefix}hc_{part}_base"])
                   for part in ("attn", "ffn")}
        self.attn_norm, self.ffn_norm = w[prefix + "attn_norm.weight"], w[prefix + "ffn_norm.weight"]
        parts = (Attention, Engram) if parallel is None else (parallel.attention, parallel.engram)  # this rank's shards
        self.engram = parts[1](cfg, layer, w, prefix) if layer in cfg.engram_layer_ids else None
        self.attn = parts[0](cfg, layer, w, prefix)
        self.ffn = MoE(cfg, layer, w, prefix, parallel)

    def mixes(self, x: torch.Tensor, part: str):
        fn, scale, base = self.hc[part]
        cfg = self.cfg
        return ops.hc_coefficients(x, fn, scale, base, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)

    def attention_input(self, x: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        return ops.hc_collapse_norm(x, pre_mix, self.attn_norm, self.cfg.norm_eps)

    def forward(self, x: torch.Tensor, pre_mix: torch.Tensor, ctx: StepContext):
        # each mix is started before the sublayer that does not read it and joined where it is read
        # (ctx.fork: on a second CUDA stream where the profile asks, else inline; graphs/mix_stream.py)
        eps = self.cfg.norm_eps
        attn_mix = ctx.fork(self.mixes, x, "attn")
        y = self.attn.forward(self.attention_input(x, pre_mix), ctx)
        attn_pre, attn_post, attn_comb = attn_mix.join()
        x = ops.hc_expand(y, x, attn_post, attn_comb)
        ffn_mix = ctx.fork(self.mixes, x, "ffn")
        h = ops.hc_collapse_norm(x, attn_pre, self.ffn_norm, eps)
        y = self.ffn.forward(h, ctx.shared_route, ctx.vl_mask)
        ffn_pre, ffn_post, ffn_comb = ffn_mix.join()
        x = ops.hc_expand(y, x, ffn_post, ffn_comb)
        return x, ffn_pre
