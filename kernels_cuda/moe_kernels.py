"""Triton kernels of ``moe_experts`` (launcher and tables: :mod:`.moe`, :mod:`.moe_tables`).

``_moe_up_kernel`` / ``_moe_down_kernel`` run one (column tile, row tile, K split) each. With
``SPLIT`` (decode: few row tiles, so few programs and long K loops) every program of an output
tile stores its fp32 partial in a workspace ``[splits, ..]`` and takes a ticket from the tile's
counter (:mod:`.splitk`); the program that draws the last ticket sums the partials in split order
(a deterministic fp32 sum) and runs the epilogue the unsplit program runs: SwiGLU and the fp8
quantization of h (up), the x.dtype rounding and the in-kernel combine (down). The up kernel's
partials are the fp32 gate and up sums: the SwiGLU is not linear, so it waits for the full sums.

With ``SHARED`` one launch of each kernel also runs the shared expert: its row tiles follow the
routed ones, its weights (``FP4_S`` / ``PROMOTE_S`` / ``DOT_S``: their own format) are picked per
row tile by a runtime branch between two compiled K loops, and the combine counts its row.
"""
from __future__ import annotations

import triton
import triton.language as tl

from flashrt.kernels_cuda import splitk
from flashrt.kernels_cuda.codecs import quant_fp8, to_out
from flashrt.kernels_cuda.linear_kernel import _k_loop
from flashrt.kernels_cuda.pdl import wait_inputs
from flashrt.kernels_cuda.round_trip import _fp8_round_trip


@triton.jit
def _tile_rows(tok_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, n_rows, n_tiles, n_pairs, TOPK,
               BLOCK_M: tl.constexpr, DIRECT: tl.constexpr, PAIRS: tl.constexpr, SHARED: tl.constexpr):
    """(expert, pair rows [BLOCK_M], row mask, token of each row (int64), shared-expert tile?) of this
    program's row tile. Tables: tile ``t`` of the routing tables. DIRECT: expert 0, rows ``t *
    BLOCK_M ..`` of ``n_rows`` (the tables are not read). PAIRS: pair ``t`` alone (expert
    ``tile_e[t]`` = its index, token ``t // TOPK``). SHARED: tiles past the ``n_tiles`` routed ones
    hold the shared expert's rows ``n_pairs + token``, ``BLOCK_M`` tokens each (expert 0 of its own
    weights)."""
    t = tl.program_id(1)
    tr = tl.minimum(t, n_tiles - 1)  # the routed tile read (a shared tile ignores it)
    lanes = tl.arange(0, BLOCK_M)
    if DIRECT:
        e = tl.full([], 0, tl.int32)
        rows = t * BLOCK_M + lanes
        end = n_rows
    elif PAIRS:
        e = tl.load(tile_e_ptr + tr)
        rows = tr + lanes
        end = tr + 1
    else:
        e = tl.load(tile_e_ptr + tr)
        rows = tl.load(tile_row_ptr + tr) + lanes
        end = tl.load(row_end_ptr + tr)
    sh = t >= n_tiles
    if SHARED:
        e = tl.where(sh, 0, e)
        rows = tl.where(sh, n_pairs + (t - n_tiles) * BLOCK_M + lanes, rows)
        end = tl.where(sh, n_rows, end)
    row_ok = rows < end
    if DIRECT:
        tok = rows
    elif PAIRS:
        tok = rows // TOPK
    else:
        tok = tl.load(tok_ptr + rows, mask=row_ok & (rows < n_pairs), other=0)
    if SHARED:
        tok = tl.where(rows >= n_pairs, rows - n_pairs, tok)
    return e, rows, row_ok, tok.to(tl.int64), sh


@triton.jit
def _k_range(k_split, K):
    """[k_lo, k_hi) of this program's K split (axis 2)."""
    k_lo = tl.program_id(2) * k_split
    return k_lo, tl.minimum(k_lo + k_split, K)


@triton.jit
def _partials_sum(part, split_stride, n_splits, ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The fp32 partials ``part + s * split_stride`` summed in split order (read past L1: other
    programs wrote them)."""
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in range(n_splits):
        total += tl.load(part + s * split_stride, mask=ok, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _swiglu(g, u, rw, limit, CLAMP: tl.constexpr, XDT: tl.constexpr):
    """h = silu(min(g, L)) * clamp(u, -L, L) * rw in fp32 from x.dtype-rounded g, u; rounded to x.dtype."""
    g = to_out(g, XDT).to(tl.float32)
    u = to_out(u, XDT).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g / (1.0 + tl.exp(-g)) * u * rw[:, None]
    return to_out(h, XDT).to(tl.float32)


@triton.jit
def _swiglu_fp8_kernel(gu_ptr, rw_ptr, out_ptr, rows, I, limit, stride_gu, stride_out,
                       CLAMP: tl.constexpr, XDT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The grouped path's SwiGLU (kernels_cuda/moe_grouped.py) in one pass: ``gu`` [rows, 2I] (gate
    sums ‖ up sums, x.dtype) and each row's weight -> h as the up kernel's epilogue makes it
    (:func:`_swiglu`), then quantized to fp8 per 32 and decoded back (the values W2 sees), stored
    in x.dtype [rows, I]. One program: ``BLOCK_R`` rows x ``BLOCK_C`` columns (whole blocks of 32)."""
    wait_inputs()
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < I)[None, :]
    at = r[:, None] * stride_gu + c[None, :]
    g = tl.load(gu_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + at + I, mask=ok, other=0.0).to(tl.float32)
    rw = tl.load(rw_ptr + r, mask=r < rows, other=1.0)
    h = _swiglu(g, u, rw, limit, CLAMP, XDT)
    tl.store(out_ptr + r[:, None] * stride_out + c[None, :], _fp8_round_trip(h, XDT, BLOCK_R, BLOCK_C), mask=ok)


@triton.jit
def _up_epilogue(g, u, rw_ptr, rows, row_ok, n_pairs, n0, I, limit, hq_ptr, sh_ptr, stride_hm, stride_shm,
                 CLAMP: tl.constexpr, XDT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HDQ: tl.constexpr):
    """SwiGLU of the full gate / up sums, h quantized to fp8 per 32 and stored in pair order (rows
    past ``n_pairs``, the shared expert's, weigh 1): as E4M3 and UE8M0 bytes, or (HDQ) as the
    values they stand for in hq's dtype (sh unused)."""
    rw = tl.load(rw_ptr + rows, mask=row_ok & (rows < n_pairs), other=1.0)
    h = _swiglu(g, u, rw, limit, CLAMP, XDT)
    r64 = rows.to(tl.int64)
    if HDQ:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        tl.store(hq_ptr + r64[:, None] * stride_hm + offs_n[None, :],
                 _fp8_round_trip(h, hq_ptr.dtype.element_ty, BLOCK_M, BLOCK_N),
                 mask=row_ok[:, None] & (offs_n < I)[None, :])
        return
    q, s = quant_fp8(tl.reshape(h, (BLOCK_M, BLOCK_N // 32, 32)))  # fp8 bytes: E4M3 and UE8M0
    kg = n0 + tl.arange(0, BLOCK_N // 32) * 32
    ok = row_ok[:, None] & (kg < I)[None, :]
    ptrs = hq_ptr + r64[:, None, None] * stride_hm + kg[None, :, None] + tl.arange(0, 32)[None, None, :]
    tl.store(ptrs, q.to(tl.uint8), mask=ok[:, :, None])
    tl.store(sh_ptr + r64[:, None] * stride_shm + (kg // 32)[None, :], s.to(tl.uint8), mask=ok)


@triton.jit
def _moe_up_kernel(xq_ptr, sx_ptr, tok_ptr, rw_ptr, w1_ptr, sw1_ptr, w3_ptr, sw3_ptr, hq_ptr, sh_ptr,
                   tile_e_ptr, tile_row_ptr, row_end_ptr, E, I, D, limit, n_rows,
                   stride_xm, stride_sxm, stride_we, stride_wn, stride_swe, stride_swn, stride_hm, stride_shm,
                   ws_ptr, cnt_ptr, k_split, n_splits,
                   s1_ptr, ss1_ptr, s3_ptr, ss3_ptr, stride_s_wn, stride_s_swn, n_tiles, n_pairs, TOPK,
                   FP4: tl.constexpr, PROMOTE: tl.constexpr, DOT: tl.constexpr, CLAMP: tl.constexpr, XDT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QX: tl.constexpr,
                   DIRECT: tl.constexpr, SPLIT: tl.constexpr, PAIRS: tl.constexpr, SHARED: tl.constexpr,
                   FP4_S: tl.constexpr, PROMOTE_S: tl.constexpr, DOT_S: tl.constexpr, E2M1: tl.constexpr,
                   SCALE_K: tl.constexpr = 1, SCALE_K_S: tl.constexpr = 1, HDQ: tl.constexpr = False):
    """QX: xq_ptr holds the float x rows, quantized to fp8 in registers (sx_ptr unused); QX 2: rows of
    x already through the fp8 round trip (linear_kernel.ACT_DEQUANTIZED). HDQ: h stored as the values
    of its fp8 round trip in hq's dtype (:func:`_up_epilogue`). DIRECT /
    PAIRS / SHARED: the row tiles of :func:`_tile_rows`; rw_ptr holds the routing weight of each
    pair row (DIRECT: of each token). SHARED: s1/ss1/s3/ss3 the shared expert's W1 / W3 (data,
    scales; format FP4_S, MMA mode PROMOTE_S / DOT_S). SPLIT: ws_ptr [splits, 2, n_rows, I] fp32
    gate / up partials, cnt_ptr a counter per (row tile, column tile)."""
    wait_inputs()
    e, rows, row_ok, tok, sh = _tile_rows(tok_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, n_rows, n_tiles, n_pairs,
                                          TOPK, BLOCK_M, DIRECT, PAIRS, SHARED)
    if e >= E:  # past the last tile
        return
    n0 = tl.program_id(0) * BLOCK_N
    k_lo, k_hi = _k_range(k_split, D)
    a_rows, sa_rows = xq_ptr + tok * stride_xm, sx_ptr + tok * stride_sxm
    ew, es = e.to(tl.int64) * stride_we, e.to(tl.int64) * stride_swe
    if SHARED:
        if sh:
            g, u = _k_loop(a_rows, sa_rows, row_ok, s1_ptr, ss1_ptr, s3_ptr, ss3_ptr, n0, I, k_lo, k_hi,
                           stride_s_wn, stride_s_swn, SCALE_K_S, FP4_S, PROMOTE_S, True, DOT_S, BLOCK_M, BLOCK_N,
                           BLOCK_K, QX, E2M1)
        else:
            g, u = _k_loop(a_rows, sa_rows, row_ok, w1_ptr + ew, sw1_ptr + es, w3_ptr + ew, sw3_ptr + es, n0, I,
                           k_lo, k_hi, stride_wn, stride_swn, SCALE_K, FP4, PROMOTE, True, DOT, BLOCK_M, BLOCK_N,
                           BLOCK_K, QX, E2M1)
    else:
        g, u = _k_loop(a_rows, sa_rows, row_ok, w1_ptr + ew, sw1_ptr + es, w3_ptr + ew, sw3_ptr + es, n0, I,
                       k_lo, k_hi, stride_wn, stride_swn, SCALE_K, FP4, PROMOTE, True, DOT, BLOCK_M, BLOCK_N,
                       BLOCK_K, QX,
                       E2M1)
    if SPLIT:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = row_ok[:, None] & (offs_n < I)[None, :]
        plane = n_rows * I  # one [n_rows, I] partial (< 2**31: the launcher's check)
        part = ws_ptr + rows.to(tl.int64)[:, None] * I + offs_n[None, :]
        mine = part + tl.program_id(2).to(tl.int64) * 2 * plane
        tl.store(mine, g, mask=ok)
        tl.store(mine + plane, u, mask=ok)
        tile = cnt_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if splitk.last_ticket(tile, n_splits):
            g = _partials_sum(part, 2 * plane, n_splits, ok, BLOCK_M, BLOCK_N)
            u = _partials_sum(part + plane, 2 * plane, n_splits, ok, BLOCK_M, BLOCK_N)
            _up_epilogue(g, u, rw_ptr, rows, row_ok, n_pairs, n0, I, limit, hq_ptr, sh_ptr, stride_hm, stride_shm,
                         CLAMP, XDT, BLOCK_M, BLOCK_N, HDQ)
            splitk.reset_ticket(tile)
    else:
        _up_epilogue(g, u, rw_ptr, rows, row_ok, n_pairs, n0, I, limit, hq_ptr, sh_ptr, stride_hm, stride_shm,
                     CLAMP, XDT, BLOCK_M, BLOCK_N, HDQ)


@triton.jit
def _down_epilogue(acc, rows, row_ok, tok, n0, D, y_ptr, stride_ym, pos_ptr, out_ptr, cnt_ptr, TOPK, stride_om,
                   add_ptr, stride_am, n_pairs, XDT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   COMBINE: tl.constexpr, HAS_ADD: tl.constexpr, PAIRS: tl.constexpr, SHARED: tl.constexpr):
    """y rows rounded to XDT; COMBINE: the token's last row sums its rows (see the kernel)."""
    r64 = rows.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    y = to_out(acc, XDT).to(y_ptr.dtype.element_ty)
    col_ok = offs_n < D
    tl.store(y_ptr + r64[:, None] * stride_ym + offs_n[None, :], y, mask=row_ok[:, None] & col_ok[None, :])
    if COMBINE:
        slot = cnt_ptr + tok * tl.num_programs(0) + tl.program_id(0)
        tickets = TOPK
        if SHARED:
            tickets = TOPK + 1
        last = row_ok & splitk.last_ticket(slot, tickets, row_ok)  # once every thread's rows are stored
        tl.debug_barrier()  # a row's ticket and its loads below may sit in different threads
        ok = last[:, None] & col_ok[None, :]
        total = _token_sum(y_ptr, pos_ptr, tok, offs_n, ok, last, TOPK, stride_ym, n_pairs, BLOCK_M, BLOCK_N,
                           PAIRS, SHARED)
        if HAS_ADD:
            total += tl.load(add_ptr + tok[:, None] * stride_am + offs_n[None, :], mask=ok, other=0.0)
        tl.store(out_ptr + tok[:, None] * stride_om + offs_n[None, :], to_out(total, out_ptr.dtype.element_ty), mask=ok)
        splitk.reset_ticket(slot, last)


@triton.jit
def _token_sum(y_ptr, pos_ptr, tok, offs_n, ok, tok_ok, TOPK, stride_ym, n_pairs, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, PAIRS: tl.constexpr, SHARED: tl.constexpr):
    """fp32 sum of each token's TOPK slot rows in slot order (row ``pos[tok * TOPK + s]``; PAIRS: row
    ``tok * TOPK + s``), then its shared-expert row ``n_pairs + tok`` (SHARED); read past L1."""
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in range(TOPK):
        if PAIRS:
            p = tok * TOPK + s
        else:
            p = tl.load(pos_ptr + tok * TOPK + s, mask=tok_ok, other=0).to(tl.int64)
        total += tl.load(y_ptr + p[:, None] * stride_ym + offs_n[None, :], mask=ok, other=0.0,
                         cache_modifier=".cg").to(tl.float32)
    if SHARED:
        total += tl.load(y_ptr + (n_pairs + tok)[:, None] * stride_ym + offs_n[None, :], mask=ok, other=0.0,
                         cache_modifier=".cg").to(tl.float32)
    return total


@triton.jit
def _moe_down_kernel(hq_ptr, sh_ptr, w2_ptr, sw2_ptr, y_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, E, D, I, n_rows,
                     stride_hm, stride_shm, stride_we, stride_wn, stride_swe, stride_swn, stride_ym,
                     tok_ptr, pos_ptr, out_ptr, cnt_ptr, TOPK, stride_om, add_ptr, stride_am,
                     ws_ptr, split_cnt_ptr, k_split, n_splits,
                     s2_ptr, ss2_ptr, stride_s_wn, stride_s_swn, n_tiles, n_pairs,
                     FP4: tl.constexpr, PROMOTE: tl.constexpr, DOT: tl.constexpr, XDT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT: tl.constexpr,
                     COMBINE: tl.constexpr, HAS_ADD: tl.constexpr, SPLIT: tl.constexpr, PAIRS: tl.constexpr,
                     SHARED: tl.constexpr, FP4_S: tl.constexpr, PROMOTE_S: tl.constexpr, DOT_S: tl.constexpr,
                     E2M1: tl.constexpr, SCALE_K: tl.constexpr = 1, SCALE_K_S: tl.constexpr = 1,
                     QX: tl.constexpr = False):
    """y rows rounded to XDT (stored as y's dtype: fp32 when DIRECT writes the op's output); row
    tiles as the up kernel's (SHARED: s2 / ss2 the shared expert's W2). COMBINE: then a ticket per
    (token, column tile) of each row; the program drawing a token's last ticket (TOPK, plus one for
    its shared row) sums its rows (:func:`_token_sum`, ``_moe_combine_kernel``'s sum), adds the
    token's ``add`` row after the sum (HAS_ADD), stores it in ``out``'s dtype and puts the counter
    back to zero. SPLIT: ws_ptr [splits, n_rows, D] fp32 partials, split_cnt_ptr a counter per
    (row tile, column tile) (apart from the combine's). QX 2: hq holds h's dequantized values (the up
    kernel's HDQ), sh unused."""
    wait_inputs()
    e, rows, row_ok, tok, sh = _tile_rows(tok_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, n_rows, n_tiles, n_pairs,
                                          TOPK, BLOCK_M, DIRECT, PAIRS, SHARED)
    if e >= E:
        return
    r64 = rows.to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    k_lo, k_hi = _k_range(k_split, I)
    h_rows, sh_rows = hq_ptr + r64 * stride_hm, sh_ptr + r64 * stride_shm
    w2, sw2 = w2_ptr + e.to(tl.int64) * stride_we, sw2_ptr + e.to(tl.int64) * stride_swe
    if SHARED:
        if sh:
            acc, _ = _k_loop(h_rows, sh_rows, row_ok, s2_ptr, ss2_ptr, s2_ptr, ss2_ptr, n0, D, k_lo, k_hi,
                             stride_s_wn, stride_s_swn, SCALE_K_S, FP4_S, PROMOTE_S, False, DOT_S, BLOCK_M, BLOCK_N,
                             BLOCK_K, QX, E2M1)
        else:
            acc, _ = _k_loop(h_rows, sh_rows, row_ok, w2, sw2, w2, sw2, n0, D, k_lo, k_hi, stride_wn, stride_swn,
                             SCALE_K, FP4, PROMOTE, False, DOT, BLOCK_M, BLOCK_N, BLOCK_K, QX, E2M1)
    else:
        acc, _ = _k_loop(h_rows, sh_rows, row_ok, w2, sw2, w2, sw2, n0, D, k_lo, k_hi, stride_wn, stride_swn, SCALE_K,
                         FP4, PROMOTE, False, DOT, BLOCK_M, BLOCK_N, BLOCK_K, QX, E2M1)
    if SPLIT:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = row_ok[:, None] & (offs_n < D)[None, :]
        plane = n_rows * D
        part = ws_ptr + r64[:, None] * D + offs_n[None, :]
        tl.store(part + tl.program_id(2).to(tl.int64) * plane, acc, mask=ok)
        tile = split_cnt_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if splitk.last_ticket(tile, n_splits):
            acc = _partials_sum(part, plane, n_splits, ok, BLOCK_M, BLOCK_N)
            _down_epilogue(acc, rows, row_ok, tok, n0, D, y_ptr, stride_ym, pos_ptr, out_ptr, cnt_ptr, TOPK,
                           stride_om, add_ptr, stride_am, n_pairs, XDT, BLOCK_M, BLOCK_N, COMBINE, HAS_ADD,
                           PAIRS, SHARED)
            splitk.reset_ticket(tile)
    else:
        _down_epilogue(acc, rows, row_ok, tok, n0, D, y_ptr, stride_ym, pos_ptr, out_ptr, cnt_ptr, TOPK,
                       stride_om, add_ptr, stride_am, n_pairs, XDT, BLOCK_M, BLOCK_N, COMBINE, HAS_ADD, PAIRS, SHARED)


@triton.jit
def _moe_combine_kernel(y_ptr, pos_ptr, out_ptr, add_ptr, D, TOPK, stride_ym, stride_om, stride_am, n_pairs,
                        BLOCK_D: tl.constexpr, HAS_ADD: tl.constexpr, PAIRS: tl.constexpr, SHARED: tl.constexpr):
    """Token ``program_id(0)``'s rows summed as :func:`_token_sum`, plus its ``add`` row (HAS_ADD)."""
    wait_inputs()
    t = tl.program_id(0).to(tl.int64) + tl.zeros([1], tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (offs < D)[None, :]
    acc = _token_sum(y_ptr, pos_ptr, t, offs, ok, t >= 0, TOPK, stride_ym, n_pairs, 1, BLOCK_D, PAIRS, SHARED)
    if HAS_ADD:  # after the sum, as the op adds it
        acc += tl.load(add_ptr + t[:, None] * stride_am + offs[None, :], mask=ok, other=0.0)
    tl.store(out_ptr + t[:, None] * stride_om + offs[None, :], to_out(acc, out_ptr.dtype.element_ty), mask=ok)
