"""Triton kernels of sparse MQA attention (launcher and planning: :mod:`.attention`).

``_sparse_attention_kernel``: one program per (query ``b, s``, block of heads, K split); the
selected rows of up to three KV segments are gathered (``_gather_kv``), dequantized in registers
by :func:`.codecs.dequant_rows` once per program for every head of the block, and fed to an
online softmax (base 2) over K blocks (``_attend``). ``_combine_kernel`` merges the split-K
partials ``(acc / l, m, l)`` with the sink.
"""
from __future__ import annotations

import triton
import triton.language as tl

from flashrt.kernels_cuda.codecs import dequant_rows

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _mask(hit, col, N: tl.constexpr, BLOCK: tl.constexpr):
    """[rows, 1] row mask, or [rows, BLOCK] with the columns >= N masked when BLOCK > N."""
    m = hit[:, None]
    if N != BLOCK:
        m = m & (col < N)[None, :]
    return m


@triton.jit
def _load_rows(rows, srows, hit, FMT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Stored (data, scale bytes) of the ``hit`` rows; zeros elsewhere. Plain rows: (data, data)."""
    W: tl.constexpr = BLOCK_D // 2 if FMT >= 2 else BLOCK_D  # fp4: two elements per byte
    BS: tl.constexpr = 16 if FMT == 2 else 32
    c = tl.arange(0, W)
    x = tl.load(rows[:, None] + c[None, :], mask=_mask(hit, c, D * W // BLOCK_D, W), other=0)
    u = x
    if FMT != 0:
        nb = tl.arange(0, BLOCK_D // BS)
        u = tl.load(srows[:, None] + nb[None, :], mask=_mask(hit, nb, D // BS, BLOCK_D // BS), other=0)
    return x, u


@triton.jit
def _locate(idx, b, base, sbase, sb, st, ssb, sst, start, length):
    """(data offsets, scale offsets, hit mask) [BK] of the global ``idx`` that fall in a segment."""
    local = idx - start
    hit = (local >= 0) & (local < length)
    r = tl.where(hit, local, 0).to(tl.int64)
    return base + b * sb + r * st, sbase + b * ssb + r * sst, hit


@triton.jit
def _merge(o, so, h, o2, so2, h2):
    """Rows of a second segment in the same format, addressed from the first one's pointers.
    An arithmetic blend (not tl.where) keeps the offsets' divisibility, so loads stay vectorized."""
    pick = h2.to(tl.int64)
    return o + pick * (o2 - o), so + pick * (so2 - so), h | h2


@triton.jit
def _dequant(kv, rows, srows, hit, FMT: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Add the ``hit`` rows, stored in format ``FMT``, to the tile ``kv`` (the dot dtype: stored
    values times power-of-two or E4M3 scales are exact in bf16, and a row takes one segment's
    values plus zeros, so the sum is exact too). The loads stay outside the branch (the pipeliner
    can prefetch them); the conversion only runs for the formats a block touches."""
    x, u = _load_rows(rows, srows, hit, FMT, D, BLOCK_D)
    if tl.max(hit.to(tl.int32), axis=0) > 0:
        kv += dequant_rows(x, u, FMT, BK, BLOCK_D).to(kv.dtype)
    return kv


@triton.jit
def _gather_kv(idx, b, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
               d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
               d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
               FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, ROLE1: tl.constexpr,
               ROLE2: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr):
    """DT [BK, BLOCK_D] rows ``idx`` of the concatenated segments (zeros where idx is empty).

    Segment i's row r of batch b is at ``d_i + o_i + b * sb_i + r * st_i`` (scales alike).
    ROLE1: -1 absent, 0 same quantized format as segment 0 (one dequant path), 1 own path;
    ROLE2: -1 absent, 0 / 1 merged into segment 0 / 1, 2 own path. A merged segment is passed
    with its target's pointers and its offset from them in ``o_i`` / ``so_i``.
    """
    r0, q0, h0 = _locate(idx, b, o0, so0, sb0, st0, ssb0, sst0, start0, len0)
    r1, q1, h1 = _locate(idx, b, o1, so1, sb1, st1, ssb1, sst1, start1, len1)
    r2, q2, h2 = _locate(idx, b, o2, so2, sb2, st2, ssb2, sst2, start2, len2)
    if ROLE2 == 0:
        r0, q0, h0 = _merge(r0, q0, h0, r2, q2, h2)
    if ROLE2 == 1:
        r1, q1, h1 = _merge(r1, q1, h1, r2, q2, h2)
    if ROLE1 == 0:
        r0, q0, h0 = _merge(r0, q0, h0, r1, q1, h1)
    kv = _dequant(tl.zeros([BK, BLOCK_D], DT), d0 + r0, s0 + q0, h0, FMT0, D, BK, BLOCK_D)
    if ROLE1 == 1:
        kv = _dequant(kv, d1 + r1, s1 + q1, h1, FMT1, D, BK, BLOCK_D)
    if ROLE2 == 2:
        kv = _dequant(kv, d2 + r2, s2 + q2, h2, FMT2, D, BK, BLOCK_D)
    return kv


@triton.jit
def _finish(acc, m, l, sk, HAS_SINK: tl.constexpr):
    """Normalize ``acc`` (base-2 running max ``m``, sum ``l``), the sink only in the denominator."""
    if HAS_SINK:
        m_f = tl.maximum(m, sk)
        m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
        alpha = tl.exp2(m - m_f)
        l = l * alpha + tl.exp2(sk - m_f)
        acc = acc * alpha[:, None]
    return tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)


@triton.jit
def _attend(q, kv, idx, m_i, l_i, acc, qk_scale, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """One K block of the online softmax (base 2; empty slots masked) -> (m, l, acc)."""
    s = tl.dot(q, tl.trans(kv), input_precision=PREC) * qk_scale
    s = tl.where((idx >= 0)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _sparse_attention_kernel(
        q_ptr, idx_ptr, sink_ptr, out_ptr, pacc_ptr, pml_ptr,
        d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
        d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
        d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
        S, H, K, blocks_per_split, qk_scale, D: tl.constexpr,
        FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, ROLE1: tl.constexpr, ROLE2: tl.constexpr,
        HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
        H_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    bs, split = tl.program_id(0).to(tl.int64), tl.program_id(2)
    h = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
    d = tl.arange(0, BLOCK_D)
    mask_hd = _mask(h < H, d, D, BLOCK_D)
    offs_q = (bs * H + h)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + offs_q, mask=mask_hd, other=0.0).to(DOT_DTYPE)
    m_i = tl.full([H_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([H_BLOCK], tl.float32)
    acc = tl.zeros([H_BLOCK, BLOCK_D], tl.float32)
    kb_lo = split * blocks_per_split
    for kb in range(kb_lo, tl.minimum(kb_lo + blocks_per_split, tl.cdiv(K, K_BLOCK))):
        offs_k = kb * K_BLOCK + tl.arange(0, K_BLOCK)
        idx = tl.load(idx_ptr + bs * K + offs_k, mask=offs_k < K, other=-1)
        kv = _gather_kv(idx, bs // S, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
                        d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
                        d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
                        FMT0, FMT1, FMT2, ROLE1, ROLE2, D, K_BLOCK, BLOCK_D, DOT_DTYPE)
        m_i, l_i, acc = _attend(q, kv, idx, m_i, l_i, acc, qk_scale, DOT_DTYPE, PREC)
    if SPLIT:  # partials [splits, B*S, H, D] = acc / l and [.., 2] = (m, l); the sink joins in _combine_kernel
        row = (split * tl.num_programs(0) + bs) * H + h
        o = _finish(acc, m_i, l_i, 0.0, False)
        tl.store(pacc_ptr + row[:, None] * D + d[None, :], o.to(pacc_ptr.dtype.element_ty), mask=mask_hd)
        tl.store(pml_ptr + row * 2, m_i, mask=h < H)
        tl.store(pml_ptr + row * 2 + 1, l_i, mask=h < H)
    else:
        sk = tl.load(sink_ptr + h, mask=h < H, other=0.0) * LOG2E if HAS_SINK else 0.0
        out = _finish(acc, m_i, l_i, sk, HAS_SINK)
        tl.store(out_ptr + offs_q, out.to(out_ptr.dtype.element_ty), mask=mask_hd)


@triton.jit
def _combine_kernel(pacc_ptr, pml_ptr, sink_ptr, out_ptr, NSPLIT, H, D, HAS_SINK: tl.constexpr,
                    H_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    bs, nbs = tl.program_id(0).to(tl.int64), tl.num_programs(0)
    h = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
    d = tl.arange(0, BLOCK_D)
    mask_hd = (h < H)[:, None] & (d < D)[None, :]
    m = tl.full([H_BLOCK], float("-inf"), tl.float32)
    for j in range(NSPLIT):
        m = tl.maximum(m, tl.load(pml_ptr + ((j * nbs + bs) * H + h) * 2, mask=h < H, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([H_BLOCK], tl.float32)
    acc = tl.zeros([H_BLOCK, BLOCK_D], tl.float32)
    for j in range(NSPLIT):
        row = (j * nbs + bs) * H + h
        w = tl.exp2(tl.load(pml_ptr + row * 2, mask=h < H, other=float("-inf")) - m_use)
        w = w * tl.load(pml_ptr + row * 2 + 1, mask=h < H, other=0.0)  # this split's l, rescaled
        l += w
        acc += tl.load(pacc_ptr + row[:, None] * D + d[None, :], mask=mask_hd, other=0.0).to(tl.float32) * w[:, None]
    sk = tl.load(sink_ptr + h, mask=h < H, other=0.0) * LOG2E if HAS_SINK else 0.0
    out = _finish(acc, m_use, l, sk, HAS_SINK)
    tl.store(out_ptr + (bs * H + h)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_hd)
