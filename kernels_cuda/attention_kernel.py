"""Triton kernels of sparse MQA attention (launcher and planning: :mod:`.attention`).

``_sparse_attention_kernel``: one program per (query ``b, s``, block of heads, K split); the
selected rows of up to three KV segments are gathered (``_gather_kv``), dequantized in registers
by :func:`.codecs.dequant_rows` once per program for every head of the block, and fed to an
online softmax (base 2) over K blocks (``_attend``). The split-K partials ``(acc / l, m, l)``
are merged with the sink (``_combine_rows``) by ``_combine_kernel``, or, with ``FINISH``, by the
last split program of each (query, head block, column half) inside the attention launch (a
ticket from its counter, :mod:`.splitk`): one launch fewer per layer.
"""
from __future__ import annotations

import triton
import triton.language as tl

from flashrt.kernels_cuda import splitk
from flashrt.kernels_cuda.codecs import dequant_rows
from flashrt.kernels_cuda.pdl import wait_inputs

LOG2E = tl.constexpr(1.4426950408889634)
# Segment offsets arrive with this bias added: always int64 to Triton (an offset between two
# allocations can pass 2**31 from one call to the next, which would otherwise compile a new variant)
OFFSET_BIAS = tl.constexpr(1 << 48)


@triton.jit
def _mask(hit, col, N: tl.constexpr, BLOCK: tl.constexpr):
    """[rows, 1] row mask, or [rows, BLOCK] with the columns >= N masked when BLOCK > N."""
    m = hit[:, None]
    if N != BLOCK:
        m = m & (col < N)[None, :]
    return m


@triton.jit
def _load_cols(rows, hit, c0, N: tl.constexpr, W: tl.constexpr, FULL: tl.constexpr):
    """[rows, W] items at columns ``[c0, c0 + W)`` of the ``hit`` rows (``N`` valid columns), zeros
    elsewhere; FULL (``c0`` = 0, all columns) keeps the mask static so the loads vectorize."""
    c = tl.arange(0, W)
    if FULL:
        return tl.load(rows[:, None] + c[None, :], mask=_mask(hit, c, N, W), other=0)
    return tl.load(rows[:, None] + c0 + c[None, :], mask=hit[:, None] & (c0 + c < N)[None, :], other=0)


@triton.jit
def _load_rows(rows, srows, hit, c0, FMT: tl.constexpr, D: tl.constexpr, BW: tl.constexpr, FULL: tl.constexpr):
    """Stored (data, scale bytes) of columns ``[c0, c0 + BW)`` of the ``hit`` rows; zeros elsewhere
    (``c0`` a multiple of 32; FULL: the columns are all of ``[0, D)`` padded). Plain rows: (data, data)."""
    PER: tl.constexpr = 2 if FMT >= 2 else 1  # fp4: two elements per byte
    BS: tl.constexpr = 16 if FMT == 2 else 32
    x = _load_cols(rows, hit, c0 // PER, D // PER, BW // PER, FULL)
    u = x
    if FMT != 0:
        u = _load_cols(srows, hit, c0 // BS, D // BS, BW // BS, FULL)
    return x, u


@triton.jit
def _locate(idx, b, base, sbase, sb, st, ssb, sst, start, length):
    """(data offsets, scale offsets, hit mask) [BK] of the global ``idx`` that fall in a segment."""
    local = idx - start
    hit = (local >= 0) & (local < length)
    r = tl.where(hit, local, 0).to(tl.int64)
    return base - OFFSET_BIAS + b * sb + r * st, sbase - OFFSET_BIAS + b * ssb + r * sst, hit


@triton.jit
def _merge(o, so, h, o2, so2, h2):
    """Rows of a second segment in the same format, addressed from the first one's pointers.
    An arithmetic blend (not tl.where) keeps the offsets' divisibility, so loads stay vectorized."""
    pick = h2.to(tl.int64)
    return o + pick * (o2 - o), so + pick * (so2 - so), h | h2


@triton.jit
def _dequant(kv, rows, srows, hit, c0, FMT: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr,
             FULL: tl.constexpr, PACKED: tl.constexpr = False):
    """Add the ``hit`` rows, stored in format ``FMT``, to the tile ``kv`` (the dot dtype: stored
    values times power-of-two or E4M3 scales are exact in bf16, and a row takes one segment's
    values plus zeros, so the sum is exact too). The loads stay outside the branch (the pipeliner
    can prefetch them); the conversion only runs for the formats a block touches."""
    x, u = _load_rows(rows, srows, hit, c0, FMT, D, BW, FULL)
    if tl.max(hit.to(tl.int32), axis=0) > 0:
        kv += dequant_rows(x, u, FMT, BK, BW, PACKED).to(kv.dtype)
    return kv


@triton.jit
def locate_paths(idx, b, o0, so0, sb0, st0, ssb0, sst0, start0, len0, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
                 o2, so2, sb2, st2, ssb2, sst2, start2, len2, o3, so3, sb3, st3, ssb3, sst3, start3, len3,
                 ROLE1: tl.constexpr, ROLE2: tl.constexpr, ROLE3: tl.constexpr):
    """(data offsets, scale offsets, hit) of the rows ``idx`` on each dequant path (segments 0, 1, 2
    with the segments merged into them: ROLE1..3 as :func:`_gather_kv`'s); elementwise, so the
    Gluon kernel (:mod:`.attention_ws`) shares it."""
    r0, q0, h0 = _locate(idx, b, o0, so0, sb0, st0, ssb0, sst0, start0, len0)
    r1, q1, h1 = _locate(idx, b, o1, so1, sb1, st1, ssb1, sst1, start1, len1)
    r2, q2, h2 = _locate(idx, b, o2, so2, sb2, st2, ssb2, sst2, start2, len2)
    if ROLE3 >= 0:
        r3, q3, h3 = _locate(idx, b, o3, so3, sb3, st3, ssb3, sst3, start3, len3)
        if ROLE3 == 0:
            r0, q0, h0 = _merge(r0, q0, h0, r3, q3, h3)
        if ROLE3 == 1:
            r1, q1, h1 = _merge(r1, q1, h1, r3, q3, h3)
        if ROLE3 == 2:
            r2, q2, h2 = _merge(r2, q2, h2, r3, q3, h3)
    if ROLE2 == 0:
        r0, q0, h0 = _merge(r0, q0, h0, r2, q2, h2)
    if ROLE2 == 1:
        r1, q1, h1 = _merge(r1, q1, h1, r2, q2, h2)
    if ROLE1 == 0:
        r0, q0, h0 = _merge(r0, q0, h0, r1, q1, h1)
    return r0, q0, h0, r1, q1, h1, r2, q2, h2


@triton.jit
def _gather_kv(idx, b, c0, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
               d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
               d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
               o3, so3, sb3, st3, ssb3, sst3, start3, len3,
               FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, ROLE1: tl.constexpr,
               ROLE2: tl.constexpr, ROLE3: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr, DT: tl.constexpr,
               FULL: tl.constexpr, PACKED: tl.constexpr = False):
    """DT [BK, BW] columns ``[c0, c0 + BW)`` of the rows ``idx`` of the concatenated segments
    (zeros where idx is empty).

    Segment i's row r of batch b is at ``d_i + o_i + b * sb_i + r * st_i`` (scales alike).
    ROLE1: -1 absent, 0 same quantized format as segment 0 (one dequant path), 1 own path;
    ROLE2: -1 absent, 0 / 1 merged into segment 0 / 1, 2 own path; ROLE3: -1 absent, 0 / 1 / 2
    merged into that segment (a fourth segment has no own path). A merged segment is passed
    with its target's pointers and its offset from them in ``o_i`` / ``so_i``. PACKED: fp4_b16 rows
    decoded in packed registers on sm_90 (:func:`.codecs.dequant_rows`; the same values).
    """
    r0, q0, h0, r1, q1, h1, r2, q2, h2 = locate_paths(
        idx, b, o0, so0, sb0, st0, ssb0, sst0, start0, len0, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
        o2, so2, sb2, st2, ssb2, sst2, start2, len2, o3, so3, sb3, st3, ssb3, sst3, start3, len3, ROLE1, ROLE2, ROLE3)
    kv = _dequant(tl.zeros([BK, BW], DT), d0 + r0, s0 + q0, h0, c0, FMT0, D, BK, BW, FULL, PACKED)
    if ROLE1 == 1:
        kv = _dequant(kv, d1 + r1, s1 + q1, h1, c0, FMT1, D, BK, BW, FULL, PACKED)
    if ROLE2 == 2:
        kv = _dequant(kv, d2 + r2, s2 + q2, h2, c0, FMT2, D, BK, BW, FULL, PACKED)
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
def _attend(s, kv, seen, m_i, l_i, acc, qk_scale, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """One K block of the online softmax over raw scores ``s`` [M, K] (base 2; ``seen``, broadcast to
    [M, K], masks the slots a row does not attend to) and the values ``kv`` -> (m, l, acc)."""
    s = tl.where(seen, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _scores(q, kv, q_o, kv_o, lo_first, D_SPLIT: tl.constexpr, PREC: tl.constexpr):
    """q . kv over all of D: one dot, or with the output split over two programs the two column
    halves (this program's, the other's), always the low half first so both programs get the same
    scores bit for bit."""
    if D_SPLIT == 1:
        return tl.dot(q, tl.trans(kv), input_precision=PREC)
    if lo_first:
        s = tl.dot(q, tl.trans(kv), input_precision=PREC)
        s = tl.dot(q_o, tl.trans(kv_o), s, input_precision=PREC)
    else:
        s = tl.dot(q_o, tl.trans(kv_o), input_precision=PREC)
        s = tl.dot(q, tl.trans(kv), s, input_precision=PREC)
    return s


# K (indices per query) grows with the context in decode until the top-k is full, and the blocks a
# split reads with it: not specialised on (== 1, % 16 == 0), so they compile no variant mid-run; K
# bounds the loop and masks the index loads.
@triton.jit(do_not_specialize=("K", "K0", "blocks_per_split"))
def _sparse_attention_kernel(
        q_ptr, idx_ptr, idx1_ptr, sink_ptr, out_ptr, pacc_ptr, pml_ptr,
        d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
        d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
        d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
        o3, so3, sb3, st3, ssb3, sst3, start3, len3,
        S, H, K, K0, blocks_per_split, qk_scale, cnt_ptr, D: tl.constexpr,
        FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, ROLE1: tl.constexpr, ROLE2: tl.constexpr,
        ROLE3: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
        H_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, D_SPLIT: tl.constexpr,
        TWO_PARTS: tl.constexpr, FINISH: tl.constexpr, PACKED: tl.constexpr = False):
    """D_SPLIT 2: two programs share a head block, each accumulating half of the output columns
    (half the accumulator registers) and gathering both halves for the scores. TWO_PARTS: the
    indices come in two tensors, ``[B*S, K0]`` (the window's) and ``[B*S, K - K0]`` (the picks),
    read as their concatenation (no concatenated copy); else one ``[B*S, K]`` with K0 == K.
    SPLIT: partials to ``pacc`` / ``pml``; with FINISH the last split program of this (query, head
    block, column half) merges them into ``out`` (counter ``cnt_ptr`` + its tile, reset after).
    PACKED: the fp4_b16 rows decoded in packed registers on sm_90 (``tiles.attention.dequant``)."""
    wait_inputs()
    BW: tl.constexpr = BLOCK_D // D_SPLIT
    bs, split = tl.program_id(0).to(tl.int64), tl.program_id(2)
    h = (tl.program_id(1) // D_SPLIT) * H_BLOCK + tl.arange(0, H_BLOCK)
    c0 = (tl.program_id(1) % D_SPLIT) * BW  # this program's output columns [c0, c0 + BW)
    c1 = BW - c0  # the other half's (D_SPLIT 2)
    d = c0 + tl.arange(0, BW)
    mask_hd = (h < H)[:, None] & (d < D)[None, :]
    q_row = q_ptr + (bs * H + h)[:, None] * D
    q = tl.load(q_row + d[None, :], mask=mask_hd, other=0.0).to(DOT_DTYPE)
    q_o = q
    if D_SPLIT == 2:
        d_o = c1 + tl.arange(0, BW)
        q_o = tl.load(q_row + d_o[None, :], mask=(h < H)[:, None] & (d_o < D)[None, :], other=0.0).to(DOT_DTYPE)
    m_i = tl.full([H_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([H_BLOCK], tl.float32)
    acc = tl.zeros([H_BLOCK, BW], tl.float32)
    kb_lo = split * blocks_per_split
    row0 = idx_ptr + bs * K0  # this query's indices: slots [0, K0) here, [K0, K) in the second part
    row1 = idx1_ptr + bs * (K - K0) - K0
    for kb in range(kb_lo, tl.minimum(kb_lo + blocks_per_split, tl.cdiv(K, K_BLOCK))):
        offs_k = kb * K_BLOCK + tl.arange(0, K_BLOCK)
        if TWO_PARTS:  # one load through the part each slot lies in
            idx = tl.load(tl.where(offs_k < K0, row0 + offs_k, row1 + offs_k), mask=offs_k < K, other=-1)
        else:
            idx = tl.load(row0 + offs_k, mask=offs_k < K, other=-1)
        kv = _gather_kv(idx, bs // S, c0, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
                        d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
                        d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
                        o3, so3, sb3, st3, ssb3, sst3, start3, len3,
                        FMT0, FMT1, FMT2, ROLE1, ROLE2, ROLE3, D, K_BLOCK, BW, DOT_DTYPE, D_SPLIT == 1, PACKED)
        kv_o = kv
        if D_SPLIT == 2:
            kv_o = _gather_kv(idx, bs // S, c1, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
                              d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
                              d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
                              o3, so3, sb3, st3, ssb3, sst3, start3, len3,
                              FMT0, FMT1, FMT2, ROLE1, ROLE2, ROLE3, D, K_BLOCK, BW, DOT_DTYPE, False, PACKED)
        s = _scores(q, kv, q_o, kv_o, c0 == 0, D_SPLIT, PREC)
        m_i, l_i, acc = _attend(s, kv, (idx >= 0)[None, :], m_i, l_i, acc, qk_scale, DOT_DTYPE, PREC)
    offs_o = (bs * H + h)[:, None] * D + d[None, :]
    if SPLIT:  # partials [splits, B*S, H, D] = acc / l and [.., 2] = (m, l); the sink joins in _combine_kernel
        row = (split * tl.num_programs(0) + bs) * H + h
        o = _finish(acc, m_i, l_i, 0.0, False)
        tl.store(pacc_ptr + row[:, None] * D + d[None, :], o.to(pacc_ptr.dtype.element_ty), mask=mask_hd)
        tl.store(pml_ptr + row * 2, m_i, mask=h < H)  # D_SPLIT 2: both programs store the same (m, l)
        tl.store(pml_ptr + row * 2 + 1, l_i, mask=h < H)
        if FINISH:
            tile = cnt_ptr + bs * tl.num_programs(1) + tl.program_id(1)
            if splitk.last_ticket(tile, tl.num_programs(2)):
                _combine_rows(pacc_ptr, pml_ptr, sink_ptr, out_ptr, bs, tl.num_programs(0), h, d, tl.num_programs(2),
                              H, D, HAS_SINK)
                splitk.reset_ticket(tile)
    else:
        sk = tl.load(sink_ptr + h, mask=h < H, other=0.0) * LOG2E if HAS_SINK else 0.0
        out = _finish(acc, m_i, l_i, sk, HAS_SINK)
        tl.store(out_ptr + offs_o, out.to(out_ptr.dtype.element_ty), mask=mask_hd)


@triton.jit
def _combine_rows(pacc_ptr, pml_ptr, sink_ptr, out_ptr, bs, nbs, h, d, NSPLIT, H, D, HAS_SINK: tl.constexpr):
    """``out`` rows of query ``bs``, heads ``h``, columns ``d``: the NSPLIT partials merged in split
    order (deterministic), the sink joining the denominator. The partials are loaded past L1 (``.cg``,
    as :mod:`.splitk` reads them): other programs of the same launch may have just stored them."""
    mask_hd = (h < H)[:, None] & (d < D)[None, :]
    m = tl.full(h.shape, float("-inf"), tl.float32)
    for j in range(NSPLIT):
        row = (j * nbs + bs) * H + h
        m = tl.maximum(m, tl.load(pml_ptr + row * 2, mask=h < H, other=float("-inf"), cache_modifier=".cg"))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros(h.shape, tl.float32)
    acc = tl.zeros(mask_hd.shape, tl.float32)
    for j in range(NSPLIT):
        row = (j * nbs + bs) * H + h
        w = tl.exp2(tl.load(pml_ptr + row * 2, mask=h < H, other=float("-inf"), cache_modifier=".cg") - m_use)
        w = w * tl.load(pml_ptr + row * 2 + 1, mask=h < H, other=0.0, cache_modifier=".cg")  # this split's l, rescaled
        l += w
        part = tl.load(pacc_ptr + row[:, None] * D + d[None, :], mask=mask_hd, other=0.0, cache_modifier=".cg")
        acc += part.to(tl.float32) * w[:, None]
    sk = tl.load(sink_ptr + h, mask=h < H, other=0.0) * LOG2E if HAS_SINK else 0.0
    out = _finish(acc, m_use, l, sk, HAS_SINK)
    tl.store(out_ptr + (bs * H + h)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_hd)


@triton.jit
def _combine_kernel(pacc_ptr, pml_ptr, sink_ptr, out_ptr, NSPLIT, H, D, HAS_SINK: tl.constexpr,
                    H_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (query, ``H_BLOCK`` heads, ``BLOCK_D`` columns)."""
    wait_inputs()
    h = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    _combine_rows(pacc_ptr, pml_ptr, sink_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.num_programs(0), h, d,
                  NSPLIT, H, D, HAS_SINK)
