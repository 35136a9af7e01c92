"""CSA2 attention of one layer: window KV ring + compressed KV chosen by the DSA indexer.

Layer roles (docs/model.md, 2): ``window`` (ring only), ``full`` (own compressor, index keys and
indexer), ``reindex`` (own indexer over the source's keys, inside the candidate pool) and
``reuse`` (the source's KV and the nearest index source's top-k). Written only against
``flashrt.ops``; caches are read and written through :class:`flashrt.kv.state.KVState`.
"""
from __future__ import annotations

import torch

from flashrt import ops, profiles

from .compressor import Compressor
from .fused_weights import fuse_in_place
from .mix_stream import run_inline
from .context import Selection, StepContext, quantized_rope_tail, rope_tail, window_indices  # noqa: F401 (re-exported)


class Attention:
    def __init__(self, cfg, layer: int, w: dict, prefix: str):
        self.cfg, self.layer, self.role = cfg, layer, cfg.role(layer)
        self.ratio = cfg.ratio(layer)
        self.source, self.index_source = cfg.kv_source(layer), cfg.index_source(layer)
        p = prefix + "attn."
        self.sink = w[p + "attn_sink"]
        # wq_a and wkv read the same h: one GEMM over their concatenated rows where the formats allow
        self.latent_w = fuse_in_place(w, [p + "wq_a.weight", p + "wkv.weight"])
        self.wq_a, self.q_norm = w[p + "wq_a.weight"], w[p + "q_norm.weight"]
        self.wq_b, self.wkv, self.kv_norm = w[p + "wq_b.weight"], w[p + "wkv.weight"], w[p + "kv_norm.weight"]
        # each head of q is RMS-normalized after wq_b, with no weight (the reference multiplies by
        # rsqrt(mean(q**2) + eps)): rms_norm with a unit weight, in the norm weights' dtype (exact in
        # any), so the kernel variants of kv_norm (the same width) serve it
        self.head_unit = torch.ones(cfg.head_dim, dtype=self.kv_norm.dtype, device=self.kv_norm.device)
        self.wo_a = w[p + "wo_a.weight"]  # [G * o_lora, H * hd / G]: ops.grouped_linear
        self.wo_b = w[p + "wo_b.weight"]
        # a ratio-1 compressor's wkv and the indexer's head weights read the same h (plain weights
        # of one dtype): one GEMM over their concatenated rows
        self.h_rows = fuse_in_place(w, [p + "compressor.wkv.weight", p + "indexer.weights_proj.weight"]) \
            if self.role == "full" and self.ratio == 1 else None
        self.compressor = Compressor(cfg, layer, w, p) if self.role == "full" else None
        if self.role in ("full", "reindex"):
            self.idx_wq_b = w[p + "indexer.wq_b.weight"]
            self.idx_weights = w[p + "indexer.weights_proj.weight"]

    def latents(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``wq_a(h)``, ``wkv(h)``): one ``linear`` over the fused weight (split into views) or two."""
        if self.latent_w is None:
            return ops.linear(h, self.wq_a), ops.linear(h, self.wkv)
        fused, widths = self.latent_w
        return ops.linear(h, fused).split(widths, dim=-1)

    def query(self, h: torch.Tensor, f: torch.Tensor, latent: torch.Tensor | None = None):
        """(the normed query latent ``qr``, the heads ``q`` [B, S, H, head_dim], each RMS-normalized
        over its whole head_dim, then roped) of ``h``; ``latent``: ``wq_a(h)`` when computed already."""
        qr = self.query_latent(h, latent)
        return qr, self.query_heads(h, qr, f)

    def query_latent(self, h: torch.Tensor, latent: torch.Tensor | None = None) -> torch.Tensor:
        """``qr``: the normed ``wq_a(h)`` (``latent``: ``wq_a(h)`` when computed already)."""
        return ops.rms_norm(ops.linear(h, self.wq_a) if latent is None else latent, self.q_norm, self.cfg.norm_eps)

    def query_heads(self, h: torch.Tensor, qr: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """The heads ``q`` [B, S, H, head_dim] of ``qr``: ``wq_b``, each head's unit-weight RMS norm
        and its rope in one op (no quantization)."""
        cfg = self.cfg
        q = ops.linear(qr, self.wq_b).view(*h.shape[:2], cfg.n_heads, cfg.head_dim)
        return quantized_rope_tail(q, self.head_unit, cfg.norm_eps, f, cfg.rope_head_dim, None)

    def window_kv(self, h: torch.Tensor, f: torch.Tensor, fmt: str, latent: torch.Tensor | None = None):
        """The roped KV latent of ``h`` [B, S, dim], quantized to the window ring's ``fmt``;
        ``latent``: ``wkv(h)`` when computed already."""
        cfg = self.cfg
        kv = ops.linear(h, self.wkv) if latent is None else latent
        return quantized_rope_tail(kv, self.kv_norm, cfg.norm_eps, f, cfg.rope_head_dim, fmt)

    def output(self, o: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """Attention output [B, S, H, head_dim] -> [B, S, dim]: inverse rope, grouped ``wo_a``, ``wo_b``."""
        cfg = self.cfg
        o = rope_tail(o, f, cfg.rope_head_dim, inverse=True).view(*o.shape[:2], cfg.o_groups, -1)
        o = ops.grouped_linear(o, self.wo_a)
        return self.out_proj(o)

    def out_proj(self, o: torch.Tensor) -> torch.Tensor:
        """``wo_b`` (a tensor-parallel rank overrides it to sum its partial over its group)."""
        return ops.linear(o, self.wo_b)

    def forward(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        cfg = self.cfg
        f = ctx.rope_compressed if self.ratio else ctx.rope_window
        q_latent, kv_latent = self.latents(h)
        qr = self.query_latent(h, q_latent)
        # the selection reads h, qr and the caches, and nothing below reads it before the join
        # (ctx.fork_select: on a stream of its own where the profile asks, else inline); a reuse
        # layer's selection only looks up its source's picks: no fork
        fork = ctx.fork_select if self.role in ("full", "reindex") else run_inline
        selection = fork(self._selection, h, qr, ctx) if self.ratio else None
        q = self.query_heads(h, qr, f)
        kv = self.window_kv(h, f, ctx.state.window_fmt, kv_latent)
        segments = [ctx.state.rings[self.layer], kv]
        picked = selection.join() if selection is not None else None
        if not self._sparse_chunk(h.shape[1]) and (picked is None or picked.indices is None):
            # a prompt chunk that sees its whole window and every visible entry: indices implied
            entries = visible = None
            if picked is not None:
                segments += picked.segments
                entries, visible = picked.entries, picked.visible
            o = ops.prefix_attention(q, tuple(segments), ctx.positions, ctx.state.ring_start[self.layer],
                                     cfg.window_size, entries, visible, self.sink, cfg.head_dim ** -0.5)
        else:
            if ctx.window_index is not None and self.layer in ctx.window_index:
                indices = ctx.window_index[self.layer]
            else:
                indices = window_indices(ctx.positions, ctx.state.ring_start[self.layer], cfg.window_size)
            if picked is not None:
                segments += picked.segments
                indices = (indices, picked.indices)  # read as their concatenation: no copy
            o = ops.sparse_attention(q, tuple(segments), indices, self.sink, cfg.head_dim ** -0.5)
        ctx.state.write_ring(self.layer, kv, ctx.ring_slots)
        return self.output(o, f)

    # ----- compressed KV and its top-k ---------------------------------------------------------
    def _selection(self, h, qr, ctx: StepContext) -> Selection:
        """The compressed entries this layer attends to: its own top-k (``full`` / ``reindex``,
        published for the ``reuse`` layers after it) or its index source's."""
        kv_rows = head_w = None
        if self.h_rows is not None:
            fused, widths = self.h_rows
            kv_rows, head_w = ops.linear(h, fused).split(widths, dim=-1)
        if self.compressor is not None and self.layer not in ctx.compress_done:
            self.compressor.forward(h, ctx, kv_rows)
        if self.role in ("full", "reindex"):
            T = ctx.entries[self.ratio]
            offset = self.cfg.window_size + h.shape[1]  # past the ring and the chunk
            if self._takes_every_entry(h.shape[1], T):
                every = torch.arange(T, dtype=torch.int32, device=h.device).expand(h.shape[0], 1, T)
                segments, where = ctx.state.main_segments(self.source, every, T, offset)
                ctx.selections[self.layer] = Selection(segments, None, where[:, 0], ctx.visible[self.ratio])
            else:
                topk = self._indexer(h, qr, ctx.state.index_keys(self.source, T), ctx.visible[self.ratio], ctx, head_w)
                ctx.selections[self.layer] = Selection(*ctx.state.main_segments(self.source, topk, T, offset))
        return ctx.selections[self.index_source]

    @staticmethod
    def _sparse_chunk(S: int) -> bool:
        """Whether a chunk of ``S`` queries a sequence takes the decode path: the indexer's picks (a
        layer with compressed entries) and ``sparse_attention`` over explicit window and entry
        indices. Decode steps do; so do chunks of up to the profile's ``sparse_max_queries`` (a
        speculative verify's), where ``prefix_attention`` would compute the same attention with a
        kernel made for long chunks."""
        return S <= max(1, profiles.active_profile().sparse_max_queries)

    def _takes_every_entry(self, S: int, T: int) -> bool:
        """Whether the top-k of a chunk of ``S`` > 1 queries over ``T`` entries picks every visible one:
        ``T <= index_topk`` and, where candidate blocks restrict it (or this layer makes them), all of
        ``T``'s blocks fit the candidate count. Then the indexer is skipped and the attention reads
        the entries each query sees (``ops.prefix_attention``): the same picks whenever the visible
        entries' scores are finite. A candidate source that skips leaves ``ctx.candidates`` None;
        its users have the same ``T``, so they skip too (and would be unrestricted anyway)."""
        cfg = self.cfg
        if self._sparse_chunk(S) or T > cfg.index_topk:
            return False
        if self.layer == cfg.candidate_source_layer or cfg.uses_candidates(self.layer):
            return -(-T // cfg.candidate_block_size) <= cfg.candidate_topk_blocks
        return True

    def _indexer(self, h, qr, index_k, visible, ctx: StepContext, head_w=None) -> torch.Tensor:
        """The top-k entries of this layer's queries; ``head_w``: ``weights_proj(h)`` when computed already."""
        cfg = self.cfg
        B, S, _ = h.shape
        T = index_k.shape[1]
        if T == 0:
            return torch.empty(B, S, 0, dtype=torch.int32, device=h.device)
        q = ops.linear(qr, self.idx_wq_b).view(B, S, cfg.index_n_heads, cfg.index_head_dim)
        # rope, then the published fake quantization through fp4_b32, in one op
        q = quantized_rope_tail(q, None, 0.0, ctx.rope_compressed, cfg.rope_head_dim, "fp4_b32", q.dtype)
        scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        head_w = ops.linear(h, self.idx_weights) if head_w is None else head_w
        scores = ops.index_scores(q, index_k, head_w, visible, scale)
        if self.layer == cfg.candidate_source_layer:
            ctx.candidates = ops.candidate_blocks(scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
        candidates = ctx.candidates if cfg.uses_candidates(self.layer) else None
        return ops.topk_positions(scores, cfg.index_topk, candidates)  # min(k, T) wide; k whole: one kernel variant
