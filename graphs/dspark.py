"""DSpark draft layers (``mtp.{k}.``): load and forward; the speculative loop comes later.

The draft reads the mean over hc copies of the attention inputs of the target layers
(``dspark_target_layer_ids``), projected by ``main_proj`` + ``main_norm``. Each draft layer keeps a
window ring of that main stream's KV (seeded at prefill, one token per decode step); a decode
step drafts ``block_size`` tokens at once: the block attends to the ring and to every block
position (not causally), through the same mHC block as the backbone; the head adds a Markov bias
from the previously drafted token and samples one token at a time; a confidence head scores them.
"""
from __future__ import annotations

import torch

from flashrt import ops

from .block import Block
from .context import StepContext


class _DraftAttention:
    """A window-only attention whose KV comes from the main stream, queries from the draft block."""

    def __init__(self, attn):
        self.a = attn

    def main_kv(self, main_x: torch.Tensor, ctx: StepContext):
        return self.a.window_kv(main_x, ctx.rope_window, ctx.state.window_fmt)

    def forward(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        a, cfg = self.a, self.a.cfg
        W = cfg.window_size
        B, S, _ = h.shape
        f = ctx.rope_window
        q_latent, kv_latent = a.latents(h)
        _, q = a.query(h, f, q_latent)
        kv = a.window_kv(h, f, ctx.state.window_fmt, kv_latent)
        main_pos = ctx.positions[:, :1] - 1  # the main token this block continues
        ring = torch.arange(W, device=h.device).expand(B, W)
        ring = torch.where(ring <= main_pos, ring, -1)  # ring slots filled so far
        block = W + torch.arange(S, device=h.device).expand(B, S)
        idx = torch.cat([ring, block], dim=1).unsqueeze(1).expand(B, S, W + S).to(torch.int32).contiguous()
        o = ops.sparse_attention(q, (ctx.state.rings[a.layer], kv), idx, a.sink, cfg.head_dim ** -0.5)
        return a.output(o, f)


class Drafts:
    def __init__(self, model, w: dict):
        cfg = self.cfg = model.cfg
        self.model = model
        self.blocks = []
        for stage in range(cfg.n_mtp_layers):
            block = Block(cfg, cfg.n_layers + stage, w, f"mtp.{stage}.")
            block.attn = _DraftAttention(block.attn)
            self.blocks.append(block)
        self.main_proj, self.main_norm = w["mtp.0.main_proj.weight"], w["mtp.0.main_norm.weight"]
        last = f"mtp.{cfg.n_mtp_layers - 1}."
        self.norm = w[last + "norm.weight"]
        self.markov_embed, self.markov_head = w[last + "markov_head.embed.weight"], w[last + "markov_head.head.weight"]
        self.confidence = w[last + "confidence_head.proj.weight"]

    def main_stream(self, captured: dict) -> torch.Tensor:
        hidden = torch.cat([captured[l] for l in self.cfg.dspark_target_layer_ids], dim=-1)
        return ops.rms_norm(ops.linear(hidden, self.main_proj), self.main_norm, self.cfg.norm_eps)

    def seed(self, captured: dict, ctx: StepContext) -> None:
        """Prefill or decode: write the main stream's KV of this chunk into every draft ring."""
        main_x = self.main_stream(captured)
        for block in self.blocks:
            ctx.state.write_ring(block.layer, block.attn.main_kv(main_x, ctx), ctx.ring_slots)

    def draft(self, next_ids: torch.Tensor, state, temperature: float = 0.0, generator=None):
        """Draft ``block_size`` tokens after ``next_ids`` [B] (the token sampled at the last
        position run). Returns (ids [B, block_size + 1], logits [B, block_size, vocab] fp32,
        confidence [B, block_size] fp32). The rings must hold the main stream up to that position.
        """
        cfg, model = self.cfg, self.model
        B, K = next_ids.shape[0], cfg.dspark_block_size
        ids = torch.full((B, K), cfg.dspark_noise_token_id, dtype=torch.long, device=model.device)
        ids[:, 0] = next_ids
        x, pre = model.embed_tokens(ids)
        positions = state.positions.unsqueeze(1) + torch.arange(K, device=model.device)
        ctx = StepContext(positions, max(state.host_positions) + K, state, model.rope,  # reads the rings only
                          rope_window=model.rope.factors(False, positions), shared_route=model.shared_route(B * K))
        for block in self.blocks:
            x, pre = block.forward(x, pre, ctx)
        h = ops.hc_collapse(x, pre)
        normed = ops.rms_norm(h, self.norm, cfg.norm_eps).to(torch.float32)
        # the head is split by vocabulary rows under tensor parallelism: every rank gets the whole row
        par = model.parallel
        logits = ops.linear(normed, model.head) if par is None else par.head_logits(normed, model.head)
        out = torch.empty(B, K + 1, dtype=torch.long, device=model.device)
        out[:, 0] = next_ids
        embeds = []
        for i in range(K):
            embed = self.markov_embed[out[:, i]]  # [B, rank]
            logits[:, i] += ops.linear(embed.to(torch.float32), self.markov_head)
            embeds.append(embed)
            out[:, i + 1] = ops.sample(logits[:, i], temperature, generator)
        feats = torch.cat([h, torch.stack(embeds, dim=1)], dim=-1).to(torch.float32)
        confidence = ops.linear(feats, self.confidence)[..., 0]
        return out, logits, confidence
