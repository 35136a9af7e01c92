"""``flashrt.ops.compress_decode`` (a compressor's decode step) against an independent float64
computation: the slot write, the softmax pool over the group, the cast, the norm and the entry."""
from __future__ import annotations

import pytest
import torch

from flashrt import ops
from kernel_check import assert_error


def _case(rng, B, r, D):
    kv, score = torch.randn(B, D, generator=rng), torch.randn(B, D, generator=rng) * 4.0
    kv_state, score_state = torch.randn(B, r, D, generator=rng), torch.randn(B, r, D, generator=rng) * 4.0
    positions = torch.randint(0, 5 * r, (B,), generator=rng)
    weight = (torch.randn(D, generator=rng) + 1.0).to(torch.bfloat16)
    return kv, score, kv_state, score_state, positions, weight


def _expected(kv, score, kv_state, score_state, positions, weight, eps):
    """float64: the new rows placed by hand, then a plain softmax, the norm from its definition."""
    B, r, D = kv_state.shape
    st_kv, st_s = kv_state.double().clone(), score_state.double().clone()
    for b in range(B):
        st_kv[b, int(positions[b]) % r], st_s[b, int(positions[b]) % r] = kv[b].double(), score[b].double()
    pooled = (torch.softmax(st_s, dim=1) * st_kv).sum(1)
    return st_kv, st_s, pooled


@pytest.mark.parametrize("B,r,D,dtype", [(1, 2, 16, torch.bfloat16), (3, 4, 64, torch.bfloat16),
                                         (2, 5, 96, torch.float32), (4, 16, 32, torch.float16)])
def test_against_float64(rng, B, r, D, dtype):
    kv, score, kv_state, score_state, positions, weight = _case(rng, B, r, D)
    eps = 1e-6
    st_kv, st_s, pooled = _expected(kv, score, kv_state, score_state, positions, weight, eps)
    latent, entry, mask = ops.compress_decode(kv, score, kv_state, score_state, positions, weight, eps, dtype)
    # the state holds the new rows, every other slot unchanged
    torch.testing.assert_close(kv_state.double(), st_kv, rtol=0, atol=0)
    torch.testing.assert_close(score_state.double(), st_s, rtol=0, atol=0)
    x = pooled.to(dtype).double()  # the pool rounded to the latent's dtype, as the ops in sequence
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    assert latent.dtype == dtype and latent.shape == (B, 1, D)
    tol = 1e-2 if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(latent[:, 0].double(), want, rtol=tol, atol=tol)
    done = positions + 1
    assert entry.dtype == torch.int64 and entry.shape == (B, 1)
    assert entry[:, 0].tolist() == [int(p) // r - 1 for p in done]
    assert mask.dtype == torch.bool and mask[:, 0].tolist() == [int(p) % r == 0 for p in done]


def test_a_completed_group_pools_its_own_tokens(rng):
    """r tokens at positions 0..r-1 through the op, each from a fresh state of garbage: the last
    step's latent is the pool of exactly those tokens' rows (entry 0, complete)."""
    r, D = 4, 32
    kv_state, score_state = torch.full((1, r, D), 1e6), torch.full((1, r, D), 50.0)
    rows = [(torch.randn(1, D, generator=rng), torch.randn(1, D, generator=rng)) for _ in range(r)]
    weight = torch.ones(D)
    for p, (kv, score) in enumerate(rows):
        latent, entry, mask = ops.compress_decode(kv, score, kv_state, score_state, torch.tensor([p]), weight, 0.0,
                                                  torch.float32)
        assert bool(mask[0, 0]) == (p == r - 1)
    assert int(entry[0, 0]) == 0
    pool = (torch.softmax(torch.stack([s[0] for _, s in rows]).double(), 0)
            * torch.stack([k[0] for k, _ in rows]).double()).sum(0)
    want = pool * torch.rsqrt(pool.pow(2).mean())
    torch.testing.assert_close(latent[0, 0].double(), want, rtol=1e-5, atol=1e-5)


def test_errors(rng):
    kv, score, kv_state, score_state, positions, weight = _case(rng, 2, 4, 16)
    args = lambda **k: {**dict(kv=kv, score=score, kv_state=kv_state, score_state=score_state, positions=positions,
                               weight=weight, eps=1e-6, dtype=torch.bfloat16), **k}
    assert_error(lambda: ops.compress_decode(**args(kv=kv.to(torch.bfloat16))), "kv", "float32")
    assert_error(lambda: ops.compress_decode(**args(kv_state=kv_state[:, :1].contiguous(),
                                                    score_state=score_state[:, :1].contiguous())), "kv_state", "r >= 2")
    assert_error(lambda: ops.compress_decode(**args(score_state=score_state[:, :3])), "score_state")
    assert_error(lambda: ops.compress_decode(**args(positions=positions.to(torch.int32))), "positions", "int64")
    assert_error(lambda: ops.compress_decode(**args(positions=torch.tensor([3, -1]))), "positions", "[0,")
    assert_error(lambda: ops.compress_decode(**args(weight=weight[:8])), "weight")
    assert_error(lambda: ops.compress_decode(**args(eps=-1.0)), "eps")
    assert_error(lambda: ops.compress_decode(**args(dtype=torch.int32)), "dtype")
