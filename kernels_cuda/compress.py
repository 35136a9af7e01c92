"""CSA2 compression pool (docs/ops.md ``compress_pool``): per channel ``sum_r softmax_r(score) * kv``.

A program owns one (b, g) entry and ``BLOCK_D`` channels and walks ``r`` in ``BLOCK_R`` steps
with an online softmax (running max, denominator and weighted sum), so any ``r`` works and the
common small ``r`` is a single step. fp32 in and out; memory-bound (kv and score read once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from flashrt.families import KernelFamily
from flashrt.tile_checks import POW2
from flashrt.kernels_cuda.launch import PlanCache, cdiv, next_pow2
from flashrt.kernels_cuda import warmup as _warmup

TILES = {"compress_pool": {"TILE_ELEMS": 2048, "MAX_BLOCK_R": 16, "num_warps": 4}}


PLANS = PlanCache("compress", TILES)  # the active tiles (and launch plans made with them)
_tiles = PLANS.tiles


@triton.jit
def _compress_pool_kernel(kv_ptr, score_ptr, out_ptr, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    entry = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    base = entry * R * D
    m = tl.full((BLOCK_D,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        msk = (r < R)[:, None] & dm[None, :]
        offs = base + r[:, None] * D + d[None, :]
        s = tl.load(score_ptr + offs, mask=msk, other=float("-inf"))
        v = tl.load(kv_ptr + offs, mask=msk, other=0.0)
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: nothing to rescale
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[None, :])
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * v, axis=0)
        m = m_new
    tl.store(out_ptr + entry * D + d, acc / tl.where(dm, denom, 1.0), mask=dm)


def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    B, G, R, D = kv.shape
    kv, score = kv.contiguous(), score.contiguous()
    out = torch.empty(B, G, D, dtype=torch.float32, device=kv.device)
    if out.numel() == 0:
        return out
    if R == 0:
        return out.zero_()
    t = _tiles()["compress_pool"]
    block_r = min(next_pow2(R), t["MAX_BLOCK_R"])
    block_d = min(next_pow2(D), max(16, t["TILE_ELEMS"] // block_r))
    grid = (B * G, cdiv(D, block_d))
    _compress_pool_kernel[grid](kv, score, out, R, D, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=t["num_warps"])
    return out


def warmup_cases(device, d: dict, dtype):
    """compress_pool over the groups of a decode step and of a prefill, at every ratio > 1."""
    D = d["head_dim"]
    for r in sorted(set(d["compress_ratios"]) - {0, 1}):
        for groups in sorted({max(1, n // r) for n in _warmup.TOKENS}):
            kv = torch.randn(1, groups, r, D, device=device)
            yield _warmup.Launch("compress_pool", compress_pool, (kv, torch.randn_like(kv)))


FAMILY = KernelFamily(
    "compress", ops={"compress_pool": compress_pool},
    tiles=TILES, tile_checks={"compress_pool.TILE_ELEMS": POW2, "compress_pool.MAX_BLOCK_R": POW2},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="CSA2 compression: softmax-weighted pooling of each group")
