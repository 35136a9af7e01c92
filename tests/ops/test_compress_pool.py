"""``flashrt.ops.compress_pool`` against an independent float64 loop.

``kv, score [B, G, r, D]`` fp32 -> fp32 ``[B, G, D]``: per channel ``sum_r softmax_r(score) * kv``.
"""
from __future__ import annotations

import math

import pytest
import torch

from flashrt import ops
from kernel_check import assert_error


def expected_pool(kv, score) -> torch.Tensor:
    """float64 [B, G, D]: one (b, g, channel) softmax at a time, in Python floats."""
    B, G, r, D = kv.shape
    kvl, sl = kv.double().tolist(), score.double().tolist()
    out = torch.zeros(B, G, D, dtype=torch.float64)
    for b in range(B):
        for g in range(G):
            for d in range(D):
                col = [sl[b][g][i][d] for i in range(r)]
                m = max(col)
                w = [math.exp(x - m) for x in col]
                total = sum(w)
                out[b, g, d] = sum(wi * kvl[b][g][i][d] for i, wi in enumerate(w)) / total
    return out



SHAPES = [  # B, G, r, D
    (1, 1, 1, 16),
    (1, 3, 2, 32),
    (2, 5, 4, 64),
    (3, 2, 5, 96),
    (2, 4, 3, 7),
    (3, 1, 8, 16),
]


@pytest.mark.parametrize("B,G,r,D", SHAPES)
@pytest.mark.parametrize("spread", [1.0, 30.0])
def test_matches_loop(B, G, r, D, spread, rng):
    kv = torch.randn(B, G, r, D, generator=rng)
    score = torch.randn(B, G, r, D, generator=rng) * spread  # 30: exp would overflow unshifted
    out = ops.compress_pool(kv, score)
    assert out.dtype == torch.float32 and out.shape == (B, G, D)
    # large spreads make the fp32 score rounding matter more: exp(x) of |x| ~ 100 carries ~1e-5
    tol = 1e-5 if spread == 1.0 else 5e-5
    torch.testing.assert_close(out.double(), expected_pool(kv, score), rtol=tol, atol=tol)


def test_special_cases(rng):
    B, G, r, D = 2, 3, 4, 16
    kv = torch.randn(B, G, r, D, generator=rng)
    # r == 1 is the identity, whatever the score
    one = ops.compress_pool(kv[:, :, :1], torch.randn(B, G, 1, D, generator=rng) * 100)
    torch.testing.assert_close(one, kv[:, :, 0], rtol=0, atol=0)
    # equal scores: the plain mean over r
    flat = ops.compress_pool(kv, torch.full((B, G, r, D), 3.5))
    torch.testing.assert_close(flat.double(), kv.double().mean(2), rtol=1e-6, atol=1e-6)
    # one dominant score per channel picks that token's value
    score = torch.zeros(B, G, r, D)
    pick = torch.randint(0, r, (B, G, 1, D), generator=rng)
    score.scatter_(2, pick, 1e4)
    torch.testing.assert_close(ops.compress_pool(kv, score), kv.gather(2, pick).squeeze(2), rtol=0, atol=0)
    # a -inf score drops that token (a masked slot), the rest renormalise
    score = torch.randn(B, G, r, D, generator=rng)
    score[:, :, 0] = -math.inf
    torch.testing.assert_close(ops.compress_pool(kv, score), ops.compress_pool(kv[:, :, 1:], score[:, :, 1:]),
                               rtol=1e-6, atol=1e-6)


def test_channels_independent_noncontiguous_no_mutation(rng):
    B, G, r, D = 2, 3, 4, 32
    kv = torch.randn(B, D, G, r, generator=rng).permute(0, 2, 3, 1)  # [B, G, r, D] views
    score = torch.randn(B, r, G, D, generator=rng).transpose(1, 2)
    kv0, s0 = kv.clone(), score.clone()
    out = ops.compress_pool(kv, score)
    assert torch.equal(kv, kv0) and torch.equal(score, s0)
    torch.testing.assert_close(out.double(), expected_pool(kv, score), rtol=1e-5, atol=1e-5)
    # permuting channels permutes the output the same way
    perm = torch.randperm(D, generator=rng)
    torch.testing.assert_close(ops.compress_pool(kv[..., perm], score[..., perm]), out[..., perm], rtol=0, atol=0)
    # permuting the r tokens changes nothing (up to summation order)
    rp = torch.randperm(r, generator=rng)
    torch.testing.assert_close(ops.compress_pool(kv[:, :, rp], score[:, :, rp]), out, rtol=1e-6, atol=1e-6)


def test_bad_inputs():
    kv = torch.randn(2, 3, 4, 16)
    score = torch.randn(2, 3, 4, 16)
    ops.compress_pool(kv, score)
    assert_error(lambda: ops.compress_pool(kv.to(torch.bfloat16), score), "kv", "torch.float32", "torch.bfloat16")
    assert_error(lambda: ops.compress_pool(kv.double(), score), "kv", "torch.float64")
    assert_error(lambda: ops.compress_pool(kv, score.to(torch.bfloat16)), "score", "torch.float32", "torch.bfloat16")
    assert_error(lambda: ops.compress_pool(kv, score.half()), "score", "torch.float16")
    assert_error(lambda: ops.compress_pool(kv[0], score), "kv", "4 dims", "(3, 4, 16)")
    assert_error(lambda: ops.compress_pool(kv, score[0]), "score", "4 dims", "(3, 4, 16)")
    assert_error(lambda: ops.compress_pool(kv, score[..., :8]), "score", "D=16", "(2, 3, 4, 8)")
    assert_error(lambda: ops.compress_pool(kv, score[:, :, :3]), "score", "r=4", "(2, 3, 3, 16)")
    assert_error(lambda: ops.compress_pool(kv, score[:, :2]), "score", "G=3", "(2, 2, 4, 16)")
    assert_error(lambda: ops.compress_pool(kv, score[:1]), "score", "B=2", "(1, 3, 4, 16)")
    assert_error(lambda: ops.compress_pool(kv.numpy(), score), "kv", "ndarray")
    assert_error(lambda: ops.compress_pool(kv, None), "score", "NoneType")
