"""The query heads of an attention layer are RMS-normalized after ``wq_b``, over the whole head
(the official reference: ``q *= rsqrt(mean(q**2, -1) + eps)`` before the rope): on random weights
and inputs, every roped head has unit RMS (the rope rotates channel pairs, which keeps a head's
sum of squares), and so has every head with the rope undone."""
import torch

from flashrt.graphs.attention import Attention
from flashrt.graphs.context import rope_tail


def _layer(model):
    return next(b.attn for b in model.blocks if isinstance(getattr(b, "attn", None), Attention))


def test_query_heads_have_unit_rms(model, cfg, rng):
    attn = _layer(model)
    h = torch.randn(2, 5, cfg.dim, generator=rng).to(attn.wq_a.dtype if hasattr(attn.wq_a, "dtype") else torch.float32)
    f = torch.randn(2, 5, cfg.rope_head_dim // 2, 2, generator=rng)
    f = f / f.norm(dim=-1, keepdim=True)  # unit rotations
    f = torch.view_as_complex(f.contiguous())
    _, q = attn.query(h, f)
    rms = q.float().square().mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=2e-2), rms
    back = rope_tail(q, f, cfg.rope_head_dim, inverse=True).float()
    assert torch.allclose(back.square().mean(-1).sqrt(), torch.ones_like(rms), atol=2e-2)
