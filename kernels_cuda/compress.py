"""CSA2 compression pool (docs/ops.md ``compress_pool``): per channel ``sum_r softmax_r(score) * kv``,
and a compressor's decode step (``compress_decode``).

``compress_pool``: a program owns one (b, g) entry and ``BLOCK_D`` channels and walks ``r`` in
``BLOCK_R`` steps with an online softmax (running max, denominator and weighted sum), so any ``r``
works and the common small ``r`` is a single step. fp32 in and out; memory-bound (kv and score
read once).

``compress_decode``: a program owns one row: it writes the token's kv and score rows into slot
``pos % r`` of the row's pending group, pools the group's ``r`` slots (the new rows taken from
registers) as ``compress_pool``'s single step does, rounds to the latent's dtype, applies
``rms_norm``'s math and writes the entry index and completion flag: one launch for the slot
arithmetic, the two row stores, the pool, the cast, the norm and the entry bookkeeping. Rows whose
``D`` is not a power of two or over ``MAX_D``, ``r`` over ``compress_pool.MAX_BLOCK_R`` or
strided states run those steps in sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from flashrt.families import KernelFamily, Support
from flashrt.tile_checks import POW2, Tile
from flashrt.kernels_cuda.codecs import to_out
from flashrt.kernels_cuda.launch import TL_DTYPES, PlanCache, cdiv, next_pow2
from flashrt.kernels_cuda import norm_rope
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

TILES = {"compress_pool": {"TILE_ELEMS": 2048, "MAX_BLOCK_R": 16, "num_warps": 4},
         "compress_decode": {"MAX_D": 4096, "num_warps": 4, "in_kernel": True}}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


PLANS = PlanCache("compress", TILES)  # the active tiles (and launch plans made with them)
_tiles = PLANS.tiles


@triton.jit
def _compress_pool_kernel(kv_ptr, score_ptr, out_ptr, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    wait_inputs()
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
    _compress_pool_kernel[grid](kv, score, out, R, D, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=t["num_warps"],
                                **pdl.options(kv.device))
    return out


@triton.jit
def _compress_decode_kernel(kv_ptr, score_ptr, kvs_ptr, ss_ptr, pos_ptr, w_ptr, out_ptr, entry_ptr, mask_ptr, R, eps,
                            stride_kv, stride_s, D: tl.constexpr, BLOCK_R: tl.constexpr, OUT: tl.constexpr):
    wait_inputs()
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + b)
    slot = pos % R
    d = tl.arange(0, D)
    new_kv = tl.load(kv_ptr + b * stride_kv + d)  # rows may be column slices of one GEMM's output
    new_s = tl.load(score_ptr + b * stride_s + d)
    tl.store(kvs_ptr + (b * R + slot) * D + d, new_kv)
    tl.store(ss_ptr + (b * R + slot) * D + d, new_s)
    # the group's slots; the one just written is taken from registers (no read-after-write across threads)
    r = tl.arange(0, BLOCK_R)
    msk = (r < R)[:, None]
    offs = (b * R + r[:, None]) * D + d[None, :]
    here = (r == slot)[:, None]
    s = tl.where(here, new_s[None, :], tl.load(ss_ptr + offs, mask=msk, other=float("-inf")))
    v = tl.where(here, new_kv[None, :], tl.load(kvs_ptr + offs, mask=msk, other=0.0))
    # compress_pool's single step (its running values start at -inf / 0)
    m = tl.max(s, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(s - m_safe[None, :])
    pooled = tl.sum(p * v, axis=0) / tl.sum(p, axis=0)
    # the cast to the latent's dtype, then rms_norm's math
    x = to_out(pooled, OUT).to(tl.float32)
    rr = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + d).to(tl.float32)
    tl.store(out_ptr + b * D + d, to_out(x * rr * w, OUT))
    done = pos + 1
    tl.store(entry_ptr + b, done // R - 1)
    tl.store(mask_ptr + b, (done % R == 0).to(tl.uint8))


def _fused(kv_state, dtype) -> bool:
    """The one-program path serves these states and dtype (else the steps run in sequence)."""
    t, R, D = _tiles()["compress_decode"], kv_state.shape[1], kv_state.shape[2]
    return (t["in_kernel"] and dtype in _DTYPES and D == next_pow2(D) and D <= t["MAX_D"]
            and R <= _tiles()["compress_pool"]["MAX_BLOCK_R"] and kv_state.is_contiguous())


def compress_decode(kv, score, kv_state, score_state, positions, weight, eps, dtype):
    B, R, D = kv_state.shape
    if not (_fused(kv_state, dtype) and score_state.is_contiguous()):
        rows, slot = torch.arange(B, device=kv.device), positions % R
        kv_state[rows, slot] = kv
        score_state[rows, slot] = score
        pooled = compress_pool(kv_state.unsqueeze(1), score_state.unsqueeze(1))
        latent = norm_rope.rms_norm(pooled.to(dtype), weight, eps)
        done = positions + 1
        return latent, (done // R - 1).unsqueeze(1), (done % R == 0).unsqueeze(1)
    latent = torch.empty(B, 1, D, dtype=dtype, device=kv.device)
    entry = torch.empty(B, 1, dtype=torch.int64, device=kv.device)
    mask = torch.empty(B, 1, dtype=torch.uint8, device=kv.device)
    if B:
        kv, score = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, score))
        _compress_decode_kernel[(B,)](
            kv, score, kv_state, score_state, positions.contiguous(), weight.contiguous(),
            latent, entry, mask, R, float(eps), kv.stride(0), score.stride(0), D=D, BLOCK_R=next_pow2(R), OUT=TL_DTYPES[dtype],
            num_warps=_tiles()["compress_decode"]["num_warps"], **pdl.options(kv.device))
    return latent, entry, mask.view(torch.bool)


def warmup_cases(device, d: dict, dtype):
    """compress_pool over the groups of a decode step and of a prefill, and compress_decode's one
    decode row, at every ratio > 1."""
    D = d["head_dim"]
    for r in sorted(set(d["compress_ratios"]) - {0, 1}):
        for groups in sorted({max(1, n // r) for n in _warmup.TOKENS}):
            kv = torch.randn(1, groups, r, D, device=device)
            yield _warmup.Launch("compress_pool", compress_pool, (kv, torch.randn_like(kv)))
        state = torch.zeros(1, r, D, device=device)
        yield _warmup.Launch("compress_decode", compress_decode,
                             (torch.randn(1, D, device=device), torch.randn(1, D, device=device), state,
                              torch.zeros_like(state), torch.zeros(1, dtype=torch.int64, device=device),
                              torch.ones(D, dtype=torch.bfloat16, device=device), d["norm_eps"], dtype))


FAMILY = KernelFamily(
    "compress", ops={"compress_pool": compress_pool, "compress_decode": compress_decode},
    supports={"compress_decode": Support(inputs={"weight": _DTYPES})},
    tiles=TILES, tile_checks={"compress_pool.TILE_ELEMS": POW2, "compress_pool.MAX_BLOCK_R": POW2,
                              "compress_decode.MAX_D": POW2, "compress_decode.in_kernel": Tile(kind=bool)},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="CSA2 compression: softmax-weighted pooling of each group; a compressor's decode step in one program")
