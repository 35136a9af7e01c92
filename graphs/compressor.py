"""CSA2 compressor of a KV-source layer: groups of ``ratio`` tokens -> one compressed entry.

Ratio 1: ``norm(wkv(h))`` in bf16. Ratio > 1: ``wkv(h)`` and ``wgate(h)`` in fp32, a softmax over
the group per channel (``compress_pool``), cast to bf16, then ``norm``. Group ``j`` stands for
position ``j * ratio``. Tokens of an unfinished group wait in the layer's partial-group state.
From each entry the index key is made before rope (``k_norm(wk(entry))``, rope, ``fp4_b32``);
then the entry is roped and stored as ``fp4_b16``.
"""
from __future__ import annotations

import torch

from flashrt import ops
from flashrt.formats import MAIN_KV_FORMAT

from .context import StepContext, quantized_rope_tail
from .fused_weights import fuse_in_place


class Compressor:
    def __init__(self, cfg, layer: int, w: dict, p: str):
        self.cfg, self.layer, self.ratio = cfg, layer, cfg.ratio(layer)
        # wkv and wgate read the same input: one GEMM over their concatenated rows where they allow
        self.fused = fuse_in_place(w, [p + "compressor.wkv.weight", p + "compressor.wgate.weight"]) \
            if self.ratio > 1 else None
        self.wkv, self.norm = w[p + "compressor.wkv.weight"], w[p + "compressor.norm.weight"]
        self.wgate = w[p + "compressor.wgate.weight"] if self.ratio > 1 else None
        self.wk, self.k_norm = w[p + "indexer.wk.weight"], w[p + "indexer.k_norm.weight"]
        # ratio 1: every entry counts; a decode step's mask is a view of rows made once
        self.true = torch.ones(cfg.max_batch_size, 1, dtype=torch.bool, device=self.norm.device)

    def forward(self, h: torch.Tensor, ctx: StepContext, kv: torch.Tensor | None = None) -> None:
        """Pool the groups this chunk completes and append them to the layer's caches; ``kv``: a
        ratio-1 compressor's ``wkv(h)`` when computed already."""
        # entry j is rotated as position j * ratio: at ratio 1 the entries are the chunk's positions
        # and in a decode step the step context holds the factors of the entry it may complete
        if self.ratio == 1:
            latent = ops.rms_norm(ops.linear(h, self.wkv) if kv is None else kv, self.norm, self.cfg.norm_eps)
            entry, mask = ctx.positions, self._all(ctx.positions)
            f = ctx.rope_compressed
        elif h.shape[1] == 1:
            latent, entry, mask = self._decode(h, ctx)
            f = ctx.entry_rope.get(self.ratio)
        else:
            latent, entry, mask = self._chunk(h, ctx)
            if latent is None:
                return
            f = None
        self._store(latent, entry, mask, ctx, ctx.rope.factors(True, entry * self.ratio) if f is None else f)

    def _all(self, positions: torch.Tensor) -> torch.Tensor:
        """bool ``[B, S]``, every entry kept: rows of :attr:`true` for a decode step."""
        B, S = positions.shape
        return self.true[:B] if S == 1 and B <= self.true.shape[0] else torch.ones_like(positions, dtype=torch.bool)

    def _decode(self, h, ctx: StepContext):
        """One token per row at its own position: fill slot ``pos % r``; pool when complete
        (``ops.compress_decode``). Written in place: a retried step writes the same slot again (no
        other slot is read until the group is complete), so a decode step stays a pure device
        function (CUDA-graph capturable)."""
        cache = ctx.state.compressed[self.layer]
        kv, score = self._project(h)
        return ops.compress_decode(kv[:, 0], score[:, 0], cache.kv_state, cache.score_state, ctx.positions[:, 0],
                                   self.norm, self.cfg.norm_eps, h.dtype)

    def _project(self, h):
        """(``wkv(h)``, ``wgate(h)``) in fp32 (``h`` exact in fp32: the sums rounded once to fp32, no
        cast before): one ``linear`` over the fused weight (split into views) or two."""
        f32 = torch.float32
        if self.fused is None:
            return ops.linear(h, self.wkv, f32), ops.linear(h, self.wgate, f32)
        fused, widths = self.fused
        return ops.linear(h, fused, f32).split(widths, dim=-1)

    def _chunk(self, h, ctx: StepContext):
        """A chunk of S tokens per row, each row from its own position: row ``b``'s inputs are its
        pending group (``pos % r`` slots) followed by the chunk, laid out from its group start (rows
        of one start share the layout; other rows are padded and their extra groups masked). Pools
        the groups each row completes; the inputs of the new pending group are staged with the
        call (a failed call leaves the old one for its retry)."""
        cache, r = ctx.state.compressed[self.layer], self.ratio
        new_kv, new_score = self._project(h)
        B, S, D = new_kv.shape
        pos = ctx.positions[:, 0]
        pend = pos % r
        if ctx.static_chunk:
            return self._static_chunk(h, ctx, new_kv, new_score)
        starts = ctx.state.host_positions
        pends = [p % r for p in starts]
        if len(set(pends)) == 1:  # one layout: the pending slots, then the chunk
            kv = torch.cat([cache.kv_state[:, :pends[0]], new_kv], dim=1)
            score = torch.cat([cache.score_state[:, :pends[0]], new_score], dim=1)
            ends = [pends[0] + S] * B
        else:
            width = max(pends) + S
            j = torch.arange(width, device=h.device).unsqueeze(0)
            src = torch.where(j < pend.unsqueeze(1), j, (j - pend.unsqueeze(1)).clamp(0, S - 1) + r)
            take = lambda old, new: torch.cat([old, new], dim=1).gather(1, src.unsqueeze(-1).expand(-1, -1, D))
            kv, score = take(cache.kv_state, new_kv), take(cache.score_state, new_score)
            ends = [p + S for p in pends]
        first = pos - pend
        groups = [e // r for e in ends]
        # the next pending group; a chunk longer than the window is only ever kept whole: its tail
        off = 0 if S <= self.cfg.window_size else min(groups) * r
        ctx.state.write_partial(self.layer, kv[:, off:], score[:, off:], first + off, pos + S)
        n = max(groups)
        if n == 0:
            return None, None, None
        pooled = ops.compress_pool(kv[:, : n * r].reshape(B, n, r, D), score[:, : n * r].reshape(B, n, r, D))
        latent = ops.rms_norm(pooled.to(h.dtype), self.norm, self.cfg.norm_eps)
        j = torch.arange(n, device=h.device).unsqueeze(0)
        entry = first.unsqueeze(1) // r + j
        return latent, entry, j < ((pend + S) // r).unsqueeze(1)  # each row's groups, from device values

    def _static_chunk(self, h, ctx: StepContext, new_kv, new_score):
        """:meth:`_chunk` from device values only (a captured verify step): every row's inputs are
        laid out in ``r - 1 + S`` slots from its group start, whatever its position; groups past a
        row's end are masked. Each group is pooled on its own, so the entries equal :meth:`_chunk`'s."""
        cache, r = ctx.state.compressed[self.layer], self.ratio
        B, S, D = new_kv.shape
        if S > self.cfg.window_size:
            raise ValueError(f"static_chunk: expected a chunk of at most window_size ({self.cfg.window_size}) "
                             f"tokens, got {S}")
        pos = ctx.positions[:, 0]
        pend = pos % r
        width = r - 1 + S
        j = torch.arange(width, device=h.device).unsqueeze(0)
        src = torch.where(j < pend.unsqueeze(1), j, (j - pend.unsqueeze(1)).clamp(0, S - 1) + r)
        take = lambda old, new: torch.cat([old, new], dim=1).gather(1, src.unsqueeze(-1).expand(-1, -1, D))
        kv, score = take(cache.kv_state, new_kv), take(cache.score_state, new_score)
        first = pos - pend
        ctx.state.write_partial(self.layer, kv, score, first, pos + S)
        n = width // r
        pooled = ops.compress_pool(kv[:, : n * r].reshape(B, n, r, D), score[:, : n * r].reshape(B, n, r, D))
        latent = ops.rms_norm(pooled.to(h.dtype), self.norm, self.cfg.norm_eps)
        g = torch.arange(n, device=h.device).unsqueeze(0)
        return latent, first.unsqueeze(1) // r + g, g < ((pend + S) // r).unsqueeze(1)

    def _store(self, latent, entry, mask, ctx: StepContext, f: torch.Tensor) -> None:
        cfg, rd = self.cfg, self.cfg.rope_head_dim
        index_k = quantized_rope_tail(ops.linear(latent, self.wk), self.k_norm, cfg.norm_eps, f, rd, "fp4_b32")
        main = quantized_rope_tail(latent, None, 0.0, f, rd, MAIN_KV_FORMAT)
        ctx.state.append_entries(self.layer, main, index_k, entry, mask)
