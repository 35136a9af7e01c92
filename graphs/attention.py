"""CSA2 attention of one layer: window KV ring + compressed KV chosen by the DSA indexer.

Layer roles (v41-model.md, 2): ``window`` (ring only), ``full`` (own compressor, index keys and
indexer), ``reindex`` (own indexer over the source's keys, inside the candidate pool) and
``reuse`` (the source's KV and the nearest index source's top-k). Written only against
``flashrt.ops``; caches are read and written through :class:`flashrt.kv.state.KVState`.
"""
from __future__ import annotations

import torch

from flashrt import ops

from .compressor import Compressor
from .context import StepContext, rope_tail


_BIG = 1 << 62  # a key every ring start accepts (chunk slots); -_BIG: none does (before the sequence)


def window_parts(positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`window_indices` needs that does not depend on the layer's ring start, computed once
    per call: (slot int32 [B, S, W], key int64 [B, S, W]). Position ``p - w`` is slot
    ``window + p - w - start`` of the chunk when it is >= the chunk start, else ring slot
    ``(p - w) % W``; its key is ``_BIG`` in the chunk, the position itself when >= 0, else ``-_BIG``."""
    start = positions[:, :1].unsqueeze(-1)  # [B, 1, 1]
    pos = positions.unsqueeze(-1) - torch.arange(window, device=positions.device)  # [B, S, W]
    in_chunk = pos >= start
    slot = torch.where(in_chunk, window + pos - start, pos % window).to(torch.int32)
    key = torch.where(in_chunk, _BIG, torch.where(pos >= 0, pos, -_BIG))
    return slot, key


def window_indices(positions: torch.Tensor, ring_start: torch.Tensor, window: int, parts=None) -> torch.Tensor:
    """int32 [B, S, W] indices into [ring (W slots) ‖ chunk (S)] of the W most recent positions.

    Position ``p - w`` lives in the chunk when it is >= the chunk start, else in ring slot
    ``(p - w) % W`` if the ring holds it (>= ``ring_start``); -1 before the sequence start.
    ``parts``: :func:`window_parts` of these positions (shared by the layers of one call).
    """
    slot, key = parts if parts is not None else window_parts(positions, window)
    return slot.masked_fill(key < ring_start.view(-1, 1, 1), -1)


class Attention:
    def __init__(self, cfg, layer: int, w: dict, prefix: str):
        self.cfg, self.layer, self.role = cfg, layer, cfg.role(layer)
        self.ratio = cfg.ratio(layer)
        self.source, self.index_source = cfg.kv_source(layer), cfg.index_source(layer)
        p = prefix + "attn."
        self.sink = w[p + "attn_sink"]
        self.wq_a, self.q_norm = w[p + "wq_a.weight"], w[p + "q_norm.weight"]
        self.wq_b, self.wkv, self.kv_norm = w[p + "wq_b.weight"], w[p + "wkv.weight"], w[p + "kv_norm.weight"]
        G = cfg.o_groups
        wo_a = w[p + "wo_a.weight"]  # [G * o_lora, H * hd / G]
        self.wo_a = [wo_a[g * cfg.o_lora_rank:(g + 1) * cfg.o_lora_rank] for g in range(G)]
        self.wo_b = w[p + "wo_b.weight"]
        self.compressor = Compressor(cfg, layer, w, p) if self.role == "full" else None
        if self.role in ("full", "reindex"):
            self.idx_wq_b = w[p + "indexer.wq_b.weight"]
            self.idx_weights = w[p + "indexer.weights_proj.weight"]

    def query(self, h: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed query latent ``qr``, the roped heads ``q`` [B, S, H, head_dim]) of ``h``."""
        cfg = self.cfg
        qr = ops.rms_norm(ops.linear(h, self.wq_a), self.q_norm, cfg.norm_eps)
        q = ops.linear(qr, self.wq_b).view(*h.shape[:2], cfg.n_heads, cfg.head_dim)
        return qr, rope_tail(q, f, cfg.rope_head_dim)

    def window_kv(self, h: torch.Tensor, f: torch.Tensor, fmt: str):
        """The roped KV latent of ``h`` [B, S, dim], quantized to the window ring's ``fmt``."""
        cfg = self.cfg
        kv = ops.rms_norm(ops.linear(h, self.wkv), self.kv_norm, cfg.norm_eps)
        return ops.quantize(rope_tail(kv, f, cfg.rope_head_dim), fmt)

    def output(self, o: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """Attention output [B, S, H, head_dim] -> [B, S, dim]: inverse rope, grouped ``wo_a``, ``wo_b``."""
        cfg = self.cfg
        o = rope_tail(o, f, cfg.rope_head_dim, inverse=True).view(*o.shape[:2], cfg.o_groups, -1)
        o = torch.cat([ops.linear(o[:, :, g], self.wo_a[g]) for g in range(cfg.o_groups)], dim=-1)
        return self.out_proj(o)

    def out_proj(self, o: torch.Tensor) -> torch.Tensor:
        """``wo_b`` (a tensor-parallel rank overrides it to sum its partial over its group)."""
        return ops.linear(o, self.wo_b)

    def forward(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        cfg = self.cfg
        S = h.shape[1]
        f = ctx.factors(self.ratio > 0)
        qr, q = self.query(h, f)
        kv = self.window_kv(h, f, ctx.state.window_fmt)
        W = cfg.window_size
        segments = [ctx.state.rings[self.layer], kv]
        if ("window", W) not in ctx.shared:
            ctx.shared[("window", W)] = window_parts(ctx.positions, W)
        indices = window_indices(ctx.positions, ctx.state.ring_start[self.layer], W, ctx.shared[("window", W)])
        if self.ratio:
            main, topk = self._compressed(h, qr, ctx)
            segments += main
            own = self.role in ("full", "reindex")  # else the index source's top-k (reuse layers share it)
            key = ("topk+window", self.layer if own else self.index_source)
            if key not in ctx.shared:
                ctx.shared[key] = torch.where(topk >= 0, topk + W + S, topk)
            indices = torch.cat([indices, ctx.shared[key]], dim=-1)
        o = ops.sparse_attention(q, tuple(segments), indices, self.sink, cfg.head_dim ** -0.5)
        ctx.state.write_ring(self.layer, kv, ctx.positions)
        return self.output(o, f)

    # ----- compressed KV and its top-k ---------------------------------------------------------
    def _compressed(self, h, qr, ctx: StepContext):
        source = self.source
        if self.compressor is not None and self.layer not in ctx.compress_done:
            self.compressor.forward(h, ctx)
        T = ctx.entries_for(self.ratio)
        if self.role in ("full", "reindex"):
            topk = self._indexer(h, qr, ctx.state.index_keys(source, T), ctx.visible(self.ratio), ctx)
            ctx.shared[("topk", self.layer)] = topk
        else:
            topk = ctx.shared[("topk", self.index_source)]
        key = ("main", source, self.index_source)  # reuse layers share the resolved segments
        if key not in ctx.shared:
            ctx.shared[key] = ctx.state.main_segments(source, topk, T)
        return ctx.shared[key]

    def _indexer(self, h, qr, index_k, visible, ctx: StepContext) -> torch.Tensor:
        cfg = self.cfg
        B, S, _ = h.shape
        T = index_k.shape[1]
        if T == 0:
            return torch.empty(B, S, 0, dtype=torch.int32, device=h.device)
        f = ctx.factors(True)
        q = ops.linear(qr, self.idx_wq_b).view(B, S, cfg.index_n_heads, cfg.index_head_dim)
        q = rope_tail(q, f, cfg.rope_head_dim)
        q = ops.dequantize(ops.quantize(q, "fp4_b32"), q.dtype)  # the published fake-quant
        scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        weights = ops.linear(h, self.idx_weights).to(torch.float32) * scale
        scores = ops.index_scores(q, index_k, weights, visible)
        if self.layer == cfg.candidate_source_layer:
            ctx.shared["candidates"] = ops.candidate_blocks(
                scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
        candidates = ctx.shared.get("candidates") if cfg.uses_candidates(self.layer) else None
        return ops.topk_positions(scores, min(cfg.index_topk, T), candidates)
