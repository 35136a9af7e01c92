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

from .context import StepContext, rope_tail


class Compressor:
    def __init__(self, cfg, layer: int, w: dict, p: str):
        self.cfg, self.layer, self.ratio = cfg, layer, cfg.ratio(layer)
        self.wkv, self.norm = w[p + "compressor.wkv.weight"], w[p + "compressor.norm.weight"]
        self.wgate = w[p + "compressor.wgate.weight"] if self.ratio > 1 else None
        self.wk, self.k_norm = w[p + "indexer.wk.weight"], w[p + "indexer.k_norm.weight"]

    def forward(self, h: torch.Tensor, ctx: StepContext) -> None:
        """Pool the groups this chunk completes and append them to the layer's caches."""
        if self.ratio == 1:
            latent = ops.rms_norm(ops.linear(h, self.wkv), self.norm, self.cfg.norm_eps)
            entry, mask = ctx.positions, torch.ones_like(ctx.positions, dtype=torch.bool)
        elif h.shape[1] == 1:
            latent, entry, mask = self._decode(h, ctx)
        else:
            latent, entry, mask = self._chunk(h, ctx)
            if latent is None:
                return
        self._store(latent, entry, mask, ctx)

    def _decode(self, h, ctx: StepContext):
        """One token per row at its own position: fill slot ``pos % r``; pool when complete. Written
        in place: a retried step writes the same slot again (no other slot is read until the group
        is complete), so a decode step stays a pure device function (CUDA-graph capturable)."""
        cache, r = ctx.state.compressed[self.layer], self.ratio
        x = h.to(torch.float32)
        pos = ctx.positions[:, 0]
        rows = torch.arange(h.shape[0], device=h.device)
        cache.kv_state[rows, pos % r] = ops.linear(x, self.wkv)[:, 0]
        cache.score_state[rows, pos % r] = ops.linear(x, self.wgate)[:, 0]
        pooled = ops.compress_pool(cache.kv_state.unsqueeze(1), cache.score_state.unsqueeze(1))
        latent = ops.rms_norm(pooled.to(h.dtype), self.norm, self.cfg.norm_eps)
        return latent, ((pos + 1) // r - 1).unsqueeze(1), ((pos + 1) % r == 0).unsqueeze(1)

    def _chunk(self, h, ctx: StepContext):
        """A chunk of S tokens starting at the same position in every row: reads the pending
        group, pools the groups the chunk completes; the new pending group is committed with the
        call (a failed call leaves the old one for its retry)."""
        cache, r = ctx.state.compressed[self.layer], self.ratio
        starts = set(ctx.state.host_positions)
        if len(starts) != 1:
            raise ValueError(f"input_ids: a multi-token chunk must start at the same position in every row, got {sorted(starts)}")
        p0 = starts.pop()
        pend = p0 % r
        x = h.to(torch.float32)
        kv = torch.cat([cache.kv_state[:, :pend], ops.linear(x, self.wkv)], dim=1)
        score = torch.cat([cache.score_state[:, :pend], ops.linear(x, self.wgate)], dim=1)
        B, L, D = kv.shape
        n, rem = divmod(L, r)
        ctx.state.write_partial(self.layer, kv[:, n * r:], score[:, n * r:])  # the next pending group
        if n == 0:
            return None, None, None
        pooled = ops.compress_pool(kv[:, : n * r].reshape(B, n, r, D), score[:, : n * r].reshape(B, n, r, D))
        latent = ops.rms_norm(pooled.to(h.dtype), self.norm, self.cfg.norm_eps)
        entry = (p0 // r + torch.arange(n, device=h.device)).unsqueeze(0).expand(B, n)
        return latent, entry, torch.ones_like(entry, dtype=torch.bool)

    def _store(self, latent, entry, mask, ctx: StepContext) -> None:
        cfg, rd = self.cfg, self.cfg.rope_head_dim
        f = ctx.rope.factors(True, entry * self.ratio)
        k = ops.rms_norm(ops.linear(latent, self.wk), self.k_norm, cfg.norm_eps)
        index_k = ops.quantize(rope_tail(k, f, rd), "fp4_b32")
        main = ops.quantize(rope_tail(latent, f, rd), MAIN_KV_FORMAT)
        ctx.state.append_entries(self.layer, main, index_k, entry, mask)
