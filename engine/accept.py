"""Acceptance of drafted tokens against the target's logits of one verify step.

A verify step runs ``[next, d_1 .. d_k]`` per row; ``target[:, i]`` is the target's distribution of
the token after the ``i``-th of them, so ``target[:, i]`` judges ``d_{i+1}`` and ``target[:, k]``
gives the bonus token when every draft is accepted. Both rules return, per row, the number of
accepted drafts ``a`` (``0 .. k``) and the token that follows them (the correction at the first
rejected position, or the bonus), so a row emits ``d_1 .. d_a`` and that token.

- Greedy (temperature 0): ``d_{i+1}`` is accepted while it equals ``argmax target[:, i]`` (ties to
  the lower id, as :func:`flashrt.ops.sample`); the output is exactly the target's greedy output.
- Sampling: the standard speculative-sampling rule (Leviathan et al., Chen et al.): accept
  ``d_{i+1}`` with probability ``min(1, p(d) / q(d))`` where ``p`` / ``q`` are the target's and the
  draft's distributions at temperature ``T``; at the first rejection draw from the normalized
  ``max(p - q, 0)``; after ``k`` acceptances draw the bonus from ``p``. Every emitted token is then
  distributed exactly as the target's (lossless).
"""
from __future__ import annotations

import torch

from flashrt import ops


def greedy(drafts: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``drafts`` int64 [B, k], ``target`` fp32 [B, k + 1, V] -> (accepted int64 [B], next int64 [B])."""
    B, k1, V = target.shape
    best = ops.sample(target.reshape(B * k1, V), 0.0).view(B, k1)
    accepted = leading_true(best[:, :-1] == drafts)
    return accepted, best.gather(1, accepted.unsqueeze(1))[:, 0]


def rejection(drafts: torch.Tensor, draft_logits: torch.Tensor, target: torch.Tensor, temperature: float,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The lossless sampling rule at ``temperature`` > 0; ``draft_logits`` fp32 [B, k, V] are the
    logits the drafts were sampled from (at the same temperature). Same returns as :func:`greedy`."""
    B, k = drafts.shape
    p = torch.softmax(target.to(torch.float32) / temperature, dim=-1)  # [B, k + 1, V]
    q = torch.softmax(draft_logits.to(torch.float32) / temperature, dim=-1)  # [B, k, V]
    pick = lambda t: t.gather(2, drafts.unsqueeze(-1))[..., 0]
    u = torch.rand(B, k, generator=generator, device=generator.device if generator is not None else p.device).to(p.device)
    accepted = leading_true(u * pick(q) < pick(p[:, :k]))
    at = accepted.view(B, 1, 1).expand(B, 1, p.shape[-1])
    p_at = p.gather(1, at)[:, 0]
    q_at = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1).gather(1, at)[:, 0]  # no draft at the bonus
    residual = (p_at - q_at).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)  # p == q: any draw from p
    return accepted, ops.sample(residual.log(), 1.0, generator)


def forced(drafts: torch.Tensor, target: torch.Tensor, temperature: float,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Benchmark-only: accept every draft, then the bonus from the target (not lossless)."""
    B, k = drafts.shape
    return torch.full((B,), k, dtype=torch.long, device=drafts.device), ops.sample(target[:, k], temperature, generator)


def leading_true(ok: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading entries of the bool ``ok`` [B, k] are True."""
    return ok.to(torch.long).cumprod(dim=1).sum(dim=1)


def engram_history(model, history: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
    """The Engram history of rows that ran ``ids`` [B, S] from ``history`` and keep the first
    ``counts[b]`` tokens: the compressed ids of the last tokens up to there (None: no Engram)."""
    if model.hasher is None:
        return None
    n = history.shape[1]
    seq = torch.cat([history, model.hasher.token_map(ids, "tokens").to(history.device)], dim=1)
    idx = counts.to(history.device).unsqueeze(1) + torch.arange(n, device=history.device)
    return seq.gather(1, idx)
