"""Two-pass sparse attention (``TILES["two_pass"]``, launched by :mod:`.attention`): scores first,
then ``P @ V`` over column slices, so no program holds a ``[heads, 512]`` fp32 accumulator.

The one-pass kernel keeps ``H_BLOCK x D`` fp32 (128 registers a thread at 64 x 512 over 8 warps)
plus ``q`` and the dequantized rows, and spills. Here:

1. ``_scores_kernel`` (programs: query x head block x K split): gathers and dequantizes full rows,
   ``s = q . kv`` (base 2, scaled; ``-inf`` at empty slots) to a ``[B*S, H, K]`` fp32 buffer, and
   the split's running max / sum ``(m, l)``; its registers: ``q``, one row tile, ``[H_BLOCK, BK]``.
2. ``_pv_kernel`` (programs: query x head block x column slice of ``DV``): merges the splits'
   ``(m, l)`` (and the sink), then for each K block ``p = exp2(s - m)`` from the buffer times the
   rows' ``DV`` columns, gathered and dequantized again, into a ``[H_BLOCK, DV]`` accumulator.

Costs over one pass: the rows are gathered twice (full for the scores, by slices for the values)
and the scores are written and read once (``B*S*H*K*8`` bytes). Same math as the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.kernels_cuda.attention_kernel import LOG2E, _gather_kv
from flashrt.kernels_cuda.launch import cdiv, next_pow2

SEGMENT_ARGS = 38  # values of attention._segment_args (3 x 10 + 8)


@triton.jit
def _scores_kernel(q_ptr, idx_ptr, s_ptr, pml_ptr,
                   d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
                   d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
                   d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
                   o3, so3, sb3, st3, ssb3, sst3, start3, len3,
                   S, H, K, blocks_per_split, qk_scale, D: tl.constexpr,
                   FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, ROLE1: tl.constexpr,
                   ROLE2: tl.constexpr, ROLE3: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
                   H_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    bs, split = tl.program_id(0).to(tl.int64), tl.program_id(2)
    h = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (bs * H + h)[:, None] * D + d[None, :], mask=(h < H)[:, None] & (d < D)[None, :],
                other=0.0).to(DOT_DTYPE)
    m_i = tl.full([H_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([H_BLOCK], tl.float32)
    kb_lo = split * blocks_per_split
    for kb in range(kb_lo, tl.minimum(kb_lo + blocks_per_split, tl.cdiv(K, K_BLOCK))):
        offs_k = kb * K_BLOCK + tl.arange(0, K_BLOCK)
        idx = tl.load(idx_ptr + bs * K + offs_k, mask=offs_k < K, other=-1)
        kv = _gather_kv(idx, bs // S, 0, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
                        d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
                        d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
                        o3, so3, sb3, st3, ssb3, sst3, start3, len3,
                        FMT0, FMT1, FMT2, ROLE1, ROLE2, ROLE3, D, K_BLOCK, BLOCK_D, DOT_DTYPE, True)
        s = tl.dot(q, tl.trans(kv), input_precision=PREC) * qk_scale
        s = tl.where((idx >= 0)[None, :], s, float("-inf"))
        tl.store(s_ptr + (bs * H + h)[:, None] * K + offs_k[None, :], s, mask=(h < H)[:, None] & (offs_k < K)[None, :])
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), axis=1)
        m_i = m_new
    row = (split * tl.num_programs(0) + bs) * H + h
    tl.store(pml_ptr + row * 2, m_i, mask=h < H)
    tl.store(pml_ptr + row * 2 + 1, l_i, mask=h < H)


@triton.jit
def _normalizer(pml_ptr, sink_ptr, bs, nbs, h, H, NSPLIT, HAS_SINK: tl.constexpr, H_BLOCK: tl.constexpr):
    """(reference max, denominator) of each head: the splits' (m, l) merged, the sink added."""
    m = tl.full([H_BLOCK], float("-inf"), tl.float32)
    for j in range(NSPLIT):
        m = tl.maximum(m, tl.load(pml_ptr + ((j * nbs + bs) * H + h) * 2, mask=h < H, other=float("-inf")))
    if HAS_SINK:
        m = tl.maximum(m, tl.load(sink_ptr + h, mask=h < H, other=0.0) * LOG2E)
    m = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([H_BLOCK], tl.float32)
    for j in range(NSPLIT):
        row = (j * nbs + bs) * H + h
        mj = tl.load(pml_ptr + row * 2, mask=h < H, other=float("-inf"))
        l += tl.exp2(mj - m) * tl.load(pml_ptr + row * 2 + 1, mask=h < H, other=0.0)
    if HAS_SINK:
        l += tl.exp2(tl.load(sink_ptr + h, mask=h < H, other=0.0) * LOG2E - m)
    return m, l


@triton.jit
def _pv_kernel(s_ptr, pml_ptr, sink_ptr, idx_ptr, out_ptr,
               d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
               d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
               d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
               o3, so3, sb3, st3, ssb3, sst3, start3, len3,
               S, H, K, NSPLIT, D: tl.constexpr,
               FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, ROLE1: tl.constexpr,
               ROLE2: tl.constexpr, ROLE3: tl.constexpr, HAS_SINK: tl.constexpr, DOT_DTYPE: tl.constexpr,
               PREC: tl.constexpr, H_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, DV: tl.constexpr):
    bs, nbs = tl.program_id(0).to(tl.int64), tl.num_programs(0)
    h = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
    c0 = tl.program_id(2) * DV
    m, l = _normalizer(pml_ptr, sink_ptr, bs, nbs, h, H, NSPLIT, HAS_SINK, H_BLOCK)
    acc = tl.zeros([H_BLOCK, DV], tl.float32)
    for kb in range(0, tl.cdiv(K, K_BLOCK)):
        offs_k = kb * K_BLOCK + tl.arange(0, K_BLOCK)
        idx = tl.load(idx_ptr + bs * K + offs_k, mask=offs_k < K, other=-1)
        s = tl.load(s_ptr + (bs * H + h)[:, None] * K + offs_k[None, :], mask=(h < H)[:, None] & (offs_k < K)[None, :],
                    other=float("-inf"))
        p = tl.exp2(s - m[:, None])
        kv = _gather_kv(idx, bs // S, c0, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
                        d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
                        d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
                        o3, so3, sb3, st3, ssb3, sst3, start3, len3,
                        FMT0, FMT1, FMT2, ROLE1, ROLE2, ROLE3, D, K_BLOCK, DV, DOT_DTYPE, False)
        acc += tl.dot(p.to(DOT_DTYPE), kv, input_precision=PREC)
    d = c0 + tl.arange(0, DV)
    out = tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
    tl.store(out_ptr + (bs * H + h)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(h < H)[:, None] & (d < D)[None, :])


def plan(B: int, S: int, H: int, D: int, K: int, t: dict, wave: int) -> dict:
    """Grids and tiles of the two passes (``t``: ``TILES["two_pass"]``)."""
    h_block = min(t["H_BLOCK"], max(16, next_pow2(H)))
    k_block = min(t["K_BLOCK"], max(16, next_pow2(K)))
    block_d = next_pow2(D)
    dv = min(t["DV"], block_d)
    n_kb, programs = cdiv(K, k_block), B * S * cdiv(H, h_block)
    splits = max(1, min(wave // programs, t["max_splits"], n_kb))
    per_split = cdiv(n_kb, splits)
    splits = cdiv(n_kb, per_split)
    return dict(scores_grid=(B * S, cdiv(H, h_block), splits), pv_grid=(B * S, cdiv(H, h_block), block_d // dv),
                splits=splits, per_split=per_split, H_BLOCK=h_block, K_BLOCK=k_block, BLOCK_D=block_d, DV=dv,
                num_warps=t["num_warps"], num_stages=t["num_stages"])


def launch(q, indices, sink, out, seg_args: list, formats: dict, scale: float, p: dict) -> None:
    """Run both passes (``formats``: FMT*/ROLE*/DOT_DTYPE/PREC constexprs of the one-pass plan)."""
    BS, H, K, D = q.shape[0] * q.shape[1], q.shape[2], indices.shape[-1], q.shape[3]
    assert len(seg_args) == SEGMENT_ARGS, len(seg_args)
    scores = torch.empty(BS, H, K, dtype=torch.float32, device=q.device)
    pml = torch.empty(p["splits"], BS, H, 2, dtype=torch.float32, device=q.device)
    f = {k: formats[k] for k in ("FMT0", "FMT1", "FMT2", "ROLE1", "ROLE2", "ROLE3", "DOT_DTYPE", "PREC")}
    tiles = dict(H_BLOCK=p["H_BLOCK"], K_BLOCK=p["K_BLOCK"], num_warps=p["num_warps"], num_stages=p["num_stages"])
    _scores_kernel[p["scores_grid"]](q, indices, scores, pml, *seg_args, q.shape[1], H, K, p["per_split"],
                                     float(scale) * LOG2E.value, D, BLOCK_D=p["BLOCK_D"], **f, **tiles)
    _pv_kernel[p["pv_grid"]](scores, pml, sink if sink is not None else pml, indices, out, *seg_args,
                             q.shape[1], H, K, p["splits"], D, HAS_SINK=sink is not None, DV=p["DV"], **f, **tiles)
