"""``linear`` as a GEMV: multiply-adds on the CUDA cores, one or a few activation rows a program, for
the decode rules that set the ``gemv`` knob: ``fp8_w`` weights (:mod:`.linear`'s ``KNOBS``) and
plain bf16 / fp16 ones (:mod:`.linear_plain`'s, :func:`_plain_gemv_kernel`).

At one row the MMA loops spend most of a tile on rows that do not exist and promote every 32-wide
K slice through shared memory and barriers. Here a program takes ``ROWS`` activation rows (the
rule's ``gemv_rows`` knob, at most the launch's rows rounded up to a power of two; 1 by default) and
``BLOCK_N`` weight rows: each K block of ``BLOCK_K`` (a pipelined, asynchronous copy: ``tl.range``
with the rule's ``num_stages``, which Triton applies to a loop without a dot only when asked) is
converted from E4M3 by the device (two bytes an instruction on sm_89+, :func:`.codecs.e4m3_cvt`) and
multiplied by the activations, which the program quantizes to ``fp8`` itself as the MMA loops do
(:func:`.linear_kernel._a_block`: the per-32 blocks ``act_quant`` makes, from column 0) and carries
as the values they stand for; with the rule's ``gemv_round_trip`` knob a launch before it computes
those values once (:func:`.round_trip.fp8_round_trip`, bf16) and every program loads them as they
are (``QX`` :data:`.linear_kernel.ACT_DEQUANTIZED`) instead of quantizing its rows again. The
weight rows go in groups of 32 (one row of the 32 x 32 weight scale tiles each): a group's scale
multiplies the activations (a K block's worth) instead of every weight. A weight block is loaded
and converted once for the program's rows, each row's products summed on their own. Products and
sums are fp32: the same values as the MMA loops up to the order of the sums. A split K meets in the
tile's last program (:func:`.splitk.store_tile`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.kernels_cuda import splitk
from flashrt.kernels_cuda.codecs import e4m3_cvt, e8m0_to_f32
from flashrt.kernels_cuda.linear_kernel import ACT_DEQUANTIZED, _a_block
from flashrt.kernels_cuda.launch import TL_DTYPES, cdiv, next_pow2
from flashrt.kernels_cuda.pdl import wait_inputs
from flashrt.kernels_cuda.splitk import store_tile

SCALE_ROWS = tl.constexpr(32)  # the rows of one fp8_w scale tile


def plan(m: int, n: int, k: int, out_dtype: torch.dtype, tile: dict, knobs: dict, split_k, sms: int,
         in_kernel: bool) -> dict:
    """The launch of a GEMV rule (its kernel parameters ``tile``, its launch knobs ``knobs``: the K
    split's ``split_min_blocks`` and ``split_per_sm``, the rows a program ``gemv_rows``, the
    activations' launch before it ``gemv_round_trip``, both only from ``gemv_shared_min_weights``
    weight elements ``n * k``; ``split_k``: the family's forced split count or None): a program per
    (``ROWS`` rows, ``BLOCK_N`` weight rows, K split); the split summed in the kernel where
    ``in_kernel`` and the counters hold its tiles, else by a launch after it."""
    # below gemv_shared_min_weights weight elements a launch is too short for its rows to share a
    # program or for the round trip's launch to pay: one row a program, each quantizing its own
    shared = n * k >= (knobs.get("gemv_shared_min_weights") or 0)
    rows = min(knobs["gemv_rows"], next_pow2(m)) if shared else 1
    tiles = cdiv(m, rows) * cdiv(n, tile["BLOCK_N"])
    split, k_split = splitk.splits(tiles, k, tile["BLOCK_K"], sms, split_k, knobs["split_min_blocks"],
                                   knobs["split_per_sm"])
    reduce = in_kernel and split > 1 and splitk.fits(tiles) and split * m * n < 2 ** 31
    dtype = out_dtype if split == 1 or reduce else torch.float32
    round_trip = shared and bool(knobs.get("gemv_round_trip"))  # QX passed only when on: the other variants as before
    return dict(gemv=True, grid=(tiles, split), split=split, k_split=k_split, out_dtype=dtype, reduce=reduce,
                round_trip=round_trip,
                constexprs=dict(OUT=TL_DTYPES[dtype], ROWS=rows, BLOCK_N=tile["BLOCK_N"], BLOCK_K=tile["BLOCK_K"],
                                STAGES=tile["num_stages"], REDUCE=reduce, num_warps=tile["num_warps"],
                                num_stages=tile["num_stages"], **({"QX": ACT_DEQUANTIZED} if round_trip else {})))


def warmup_rows(rules) -> tuple[int, ...]:
    """The row counts past one that a family's GEMV rules launch variants of their own for (``ROWS`` 2
    and 4, up to each rule's ``gemv_rows`` and row limit): what a warm-up adds to its one-row launches."""
    rows = set()
    for limit, tile in rules:
        if tile.get("gemv"):
            rows.update(r for r in (2, 4) if r <= tile.get("gemv_rows", 1) and (limit is None or r <= limit))
    return tuple(sorted(rows))


@triton.jit
def _fp8_row(acc, w, ws, x_ptr, row, M, k0, k_hi, stride_xm, BLOCK_K: tl.constexpr, QX: tl.constexpr):
    """acc [R, 32] + the products of weight block ``w`` (E4M3 bytes, converted here) and row ``row``'s
    activations (quantized to fp8 per 32 from k0, act_quant's blocks, as fp32 values: here, or by the
    launch before where QX is ACT_DEQUANTIZED) times each weight group's scale ``ws`` [R, BLOCK_K],
    summed over the block. A row past ``M`` reads as zeros."""
    r = row + tl.arange(0, 1)
    x_row = x_ptr + r.to(tl.int64) * stride_xm
    x = tl.reshape(_a_block(x_row, x_row, r < M, k0, k_hi, QX, tl.float32, 1, BLOCK_K), (BLOCK_K,))
    return acc + tl.sum(e4m3_cvt(w.to(tl.uint8, bitcast=True)) * (x[None, :] * ws)[:, None, :], axis=2)


@triton.jit
def _plain_row(acc, w, x_group, row, M, kk, k_ok, stride_xm):
    """acc [BLOCK_N] + the products of fp32 weight block ``w`` and row ``row`` of x, summed over the
    block (a row past ``M`` reads row ``M - 1``: its sums are never stored)."""
    x = tl.load(x_group + tl.minimum(row, M - 1).to(tl.int64) * stride_xm + kk, mask=k_ok, other=0.0)
    return acc + tl.sum(w * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _stack(a0, a1, a2, a3, ROWS: tl.constexpr):
    """[ROWS, n] of the first ``ROWS`` of four [n] accumulators (the others unused)."""
    if ROWS == 1:
        return a0[None, :]
    else:
        which = tl.arange(0, ROWS)[:, None]
        out = tl.where(which == 0, a0[None, :], 0.0) + tl.where(which == 1, a1[None, :], 0.0)
        if ROWS > 2:
            out += tl.where(which == 2, a2[None, :], 0.0) + tl.where(which == 3, a3[None, :], 0.0)
        return out


# the rows a launch has (a decode batch) are not specialised on (== 1): one variant serves every batch
# a rule covers, so the warm-up's one-row launches compile what the larger batches launch
@triton.jit(do_not_specialize=("M",))
def _gemv_kernel(x_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, k_split, n_splits,
                 stride_xm, stride_wn, stride_swn, stride_swk, stride_om, stride_os,
                 OUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                 REDUCE: tl.constexpr, ROWS: tl.constexpr = 1, QX: tl.constexpr = 1):
    """out[rows, n0 : n0 + BLOCK_N] (fp32 partial of K split ``program_id(1)``) for program
    ``pid = tile * row_tiles + row_tile``, its rows ``row_tile * ROWS + [0, ROWS)`` (ROWS 1, 2 or 4):
    the row tiles of one weight tile are neighbours in the launch order, so they read it from L2 while
    it is there. The tile is ``BLOCK_N // 32`` groups of 32 weight rows (one row of scale tiles each): a
    group's scale multiplies the activations, once a K block. A weight block is loaded once for the
    program's rows, each row summed into an accumulator of its own. x: float rows the program
    quantizes (QX 1), or their fp8 round trip's values (QX ACT_DEQUANTIZED)."""
    wait_inputs()
    R: tl.constexpr = BLOCK_N // SCALE_ROWS
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(M, ROWS)
    n0 = (pid // row_tiles) * BLOCK_N
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    group = tl.arange(0, R)
    offs_n = n0 + group[:, None] * SCALE_ROWS + tl.arange(0, SCALE_ROWS)[None, :]  # [R, 32]
    n_ok = offs_n < N
    row = (pid % row_tiles) * ROWS
    acc0 = tl.zeros((R, SCALE_ROWS), tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_hi
        w = tl.load(w_ptr + offs_n[:, :, None] * stride_wn + kk[None, None, :],
                    mask=n_ok[:, :, None] & k_ok[None, None, :], other=0.0)
        s = tl.load(sw_ptr + (n0 // SCALE_ROWS + group)[:, None] * stride_swn + (kk // 32)[None, :] * stride_swk,
                    mask=k_ok[None, :], other=0)  # [R, BLOCK_K]: each group's scale byte per 32 of K
        ws = e8m0_to_f32(s.to(tl.int32))
        acc0 = _fp8_row(acc0, w, ws, x_ptr, row, M, k0, k_hi, stride_xm, BLOCK_K, QX)
        if ROWS > 1:
            acc1 = _fp8_row(acc1, w, ws, x_ptr, row + 1, M, k0, k_hi, stride_xm, BLOCK_K, QX)
        if ROWS > 2:
            acc2 = _fp8_row(acc2, w, ws, x_ptr, row + 2, M, k0, k_hi, stride_xm, BLOCK_K, QX)
            acc3 = _fp8_row(acc3, w, ws, x_ptr, row + 3, M, k0, k_hi, stride_xm, BLOCK_K, QX)
    rows = row + tl.arange(0, ROWS)
    cols = tl.reshape(offs_n, (BLOCK_N,))
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    out = out_ptr if REDUCE else out_ptr + tl.program_id(1) * stride_os
    acc = _stack(tl.reshape(acc0, (BLOCK_N,)), tl.reshape(acc1, (BLOCK_N,)), tl.reshape(acc2, (BLOCK_N,)),
                 tl.reshape(acc3, (BLOCK_N,)), ROWS)
    store_tile(acc, out, ws_ptr, cnt_ptr, pid, tl.program_id(1), n_splits, rows, cols, ok, stride_om, M, N, OUT,
               REDUCE)


@triton.jit(do_not_specialize=("M",))
def _plain_gemv_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, n_group, k_split, n_splits,
                       stride_xm, stride_wn, stride_om, stride_os,
                       OUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                       REDUCE: tl.constexpr, ROWS: tl.constexpr = 1):
    """``linear`` on a plain bf16 / fp16 weight as a GEMV (:mod:`.linear_plain`'s ``gemv`` knob):
    out[row, n] = x[row, g*K:(g+1)*K] @ w[n].T with g = n // n_group (one group: n_group = N; a
    column tile lies inside one group), for program ``pid = tile * row_tiles + row_tile`` (its rows
    ``row_tile * ROWS + [0, ROWS)``, ROWS 1, 2 or 4) and K split ``program_id(1)``. The weight block
    converted to fp32 (exact) once and multiplied by each row of x (fp32, or the weight's dtype) in fp32
    multiply-adds: each product rounded once, as the reference's fp32 GEMM."""
    wait_inputs()
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(M, ROWS)
    n0 = (pid // row_tiles) * BLOCK_N
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    row = (pid % row_tiles) * ROWS
    x_group = x_ptr + (n0 // n_group).to(tl.int64) * K
    acc0 = tl.zeros((BLOCK_N,), tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_hi
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc0 = _plain_row(acc0, w, x_group, row, M, kk, k_ok, stride_xm)
        if ROWS > 1:
            acc1 = _plain_row(acc1, w, x_group, row + 1, M, kk, k_ok, stride_xm)
        if ROWS > 2:
            acc2 = _plain_row(acc2, w, x_group, row + 2, M, kk, k_ok, stride_xm)
            acc3 = _plain_row(acc3, w, x_group, row + 3, M, kk, k_ok, stride_xm)
    rows = row + tl.arange(0, ROWS)
    out = out_ptr if REDUCE else out_ptr + tl.program_id(1) * stride_os
    store_tile(_stack(acc0, acc1, acc2, acc3, ROWS), out, ws_ptr, cnt_ptr, pid, tl.program_id(1), n_splits, rows,
               offs_n, (rows < M)[:, None] & n_ok[None, :], stride_om, M, N, OUT, REDUCE)
