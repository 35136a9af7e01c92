"""Triton kernels of the block-scaled GEMMs (launchers: :mod:`.linear`, :mod:`.moe`).

``_k_loop`` accumulates ``dequant(xq) @ dequant(w).T`` over a K range for one output tile, where
``xq`` holds fp8 activations (E4M3 bytes, UE8M0 scale bytes per 32: quant.py's ``fp8`` rows) and
``w`` an ``fp8_w`` (32 x 32 tile scales) or ``fp4_w`` (UE8M0 per 32 inputs) weight. ``PROMOTE``:
``tl.dot`` on the raw E4M3 operands one 32-wide K slice at a time, each slice's product scaled by
``sx[row] * sw[col]`` into the fp32 accumulator (fp8_w on sm_89+); otherwise both operands are
dequantized in registers (exact in bf16: E4M3 / E2M1 times a power of two) and one ``tl.dot`` per
K block accumulates. ``_linear_kernel`` runs it per (output tile in grouped order, K split).
E4M3 bytes may arrive as uint8 or float8e4nv (bitcast in registers either way).
"""
from __future__ import annotations

import triton
import triton.language as tl

from flashrt.kernels_cuda.codecs import (e2m1_pairs_bf16, e2m1_x16384, e4m3_x256, e8m0_bf16, e8m0_bf16_x2p126,
                                         e8m0_to_f32, pow2, quant_fp8)
from flashrt.kernels_cuda.codecs_e4m3 import e4m3_pairs_bf16, e8m0_bf16_x2p120
from flashrt.kernels_cuda.codecs_words import e2m1_words_bf16, e2m1_words_nibbles
from flashrt.kernels_cuda.splitk import store_tile
from flashrt.kernels_cuda.pdl import wait_inputs


# The QX constexpr of activations that arrive as the values their fp8 round trip gives (in a float
# dtype, e.g. bf16): the MMA loops load them as they are, no quantization or decode per program.
ACT_DEQUANTIZED = tl.constexpr(2)


@triton.jit
def _e4m3_operand(b, DOT: tl.constexpr):
    """Raw (unscaled) E4M3 dot operand: the loaded fp8 as it is for an fp8 dot, decoded otherwise."""
    if DOT == tl.float8e4nv:
        return b.to(tl.float8e4nv, bitcast=True)
    return (e4m3_x256(b).to(tl.float32) * 256.0).to(DOT)


@triton.jit
def _w_scales(sw_ptr, n0, N, k0, k_hi, stride_swn, stride_swk, FP4: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """The scale bytes (int32 [BLOCK_N, BLOCK_K // 32]) of weight rows [n0, n0 + BLOCK_N) at K block k0,
    at ``sw_ptr + row (or row tile, fp8_w) * stride_swn + group * stride_swk`` (row or K major); 0
    past N or k_hi."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kg = k0 + tl.arange(0, BLOCK_K // 32) * 32
    ok = (offs_n < N)[:, None] & (kg < k_hi)[None, :]
    rows = offs_n if FP4 else offs_n // 32
    s = tl.load(sw_ptr + rows[:, None] * stride_swn + (kg // 32)[None, :] * stride_swk, mask=ok, other=0)
    return s.to(tl.int32)


@triton.jit
def _w_decode(w_ptr, s, n0, N, k0, k_hi, stride_wn, FP4: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, E2M1: tl.constexpr = 0):
    """Dequantized weight rows [n0, n0 + BLOCK_N) x K block [k0, k0 + BLOCK_K) as DOT, ``s`` their scale
    bytes (:func:`_w_scales`). fp4_w with E2M1 % 8 == 2: the codes decoded two a byte in packed
    registers (codecs.e2m1_pairs_bf16) into bf16, the re-bias folded into the scales where E2M1 has
    16 (scale bytes up to 128: the launcher's :func:`.linear.fold_scales`), else code by code; with 32
    in E2M1 the block's K order is :func:`_halves`' (the caller permutes the activations so); with 64
    the bytes are in the E2M1 word layout (the packed decode reads them as they are, its registers in
    element order, codecs_words.e2m1_words_bf16, so never in the halves order; code by code they are
    put back in nibbles first). fp8_w with
    E2M1 % 8 == 2 and 128 in E2M1: four E4M3 bytes a call into bf16 (codecs_e4m3.e4m3_pairs_bf16; with
    256 its 2**120 folded into the scales), else byte by byte."""
    G: tl.constexpr = BLOCK_K // 32
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kg = k0 + tl.arange(0, G) * 32
    ok = (offs_n < N)[:, None] & (kg < k_hi)[None, :]  # [BN, G]
    if FP4:
        j = tl.arange(0, 16)
        ptrs = w_ptr + offs_n[:, None, None] * stride_wn + (kg // 2)[None, :, None] + j[None, None, :]
        byte = tl.load(ptrs, mask=ok[:, :, None], other=0)
        WORDS: tl.constexpr = (E2M1 // 64) % 2 == 1
        # four and four codes of each eight in lo / hi: the halves order, or a word's codes 0-3 / 4-7 of
        # the packed words decode (element order once relabelled; the caller keeps the activations' order)
        FOURS: tl.constexpr = (E2M1 // 32) % 2 == 1 or (WORDS and E2M1 % 8 == 2)
        if E2M1 % 8 == 2:
            FOLD: tl.constexpr = (E2M1 // 16) % 2 == 1
            scale = tl.broadcast_to((e8m0_bf16_x2p126(s) if FOLD else e8m0_bf16(s))[:, :, None], (BLOCK_N, G, 16))
            if WORDS:
                tl.static_assert((E2M1 // 32) % 2 == 0, "the words' packed decode is in element order")
                lo, hi = e2m1_words_bf16(byte, scale, FOLD)
            else:
                lo, hi = e2m1_pairs_bf16(byte, scale, FOLD)
        else:
            byte = byte.to(tl.int32)
            if WORDS:
                byte = tl.reshape(e2m1_words_nibbles(tl.reshape(byte, (BLOCK_N * G, 16)), BLOCK_N * G, 16),
                                  (BLOCK_N, G, 16))
            s = pow2(s + 14)[:, :, None]  # 2**(b - 127) * 2**14
            lo = e2m1_x16384(byte & 15).to(tl.float32) * s
            hi = e2m1_x16384(byte >> 4).to(tl.float32) * s
        if FOURS:  # the K order within 8 of lo / hi's four and four
            v = tl.reshape(tl.permute(tl.reshape(tl.join(lo, hi), (BLOCK_N, G * 4, 4, 2)), (0, 1, 3, 2)),
                           (BLOCK_N, BLOCK_K))
        else:
            v = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # element 2i low nibble, 2i + 1 high
    else:
        j = tl.arange(0, 32)
        ptrs = w_ptr + offs_n[:, None, None] * stride_wn + kg[None, :, None] + j[None, None, :]
        raw = tl.load(ptrs, mask=ok[:, :, None], other=0.0)
        if E2M1 % 8 == 2 and (E2M1 // 128) % 2 == 1:  # four bytes a call into bf16 pairs (the same values)
            FOLD8: tl.constexpr = (E2M1 // 256) % 2 == 1  # the 2**120 in the scales (linear.fold_fp8)
            scale = tl.broadcast_to((e8m0_bf16_x2p120(s) if FOLD8 else e8m0_bf16(s))[:, :, None], (BLOCK_N, G, 32))
            v = tl.reshape(e4m3_pairs_bf16(raw.to(tl.uint8, bitcast=True), scale, FOLD8), (BLOCK_N, BLOCK_K))
        else:
            w = e4m3_x256(raw).to(tl.float32)
            v = tl.reshape(w * pow2(s + 8)[:, :, None], (BLOCK_N, BLOCK_K))  # 2**(b - 127) * 2**8
    return v.to(DOT)


@triton.jit
def _w_block(w_ptr, sw_ptr, n0, N, k0, k_hi, stride_wn, stride_swn, stride_swk,
             FP4: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             E2M1: tl.constexpr = 0):
    """:func:`_w_decode` of the block with its scales loaded here (:func:`_w_scales`)."""
    s = _w_scales(sw_ptr, n0, N, k0, k_hi, stride_swn, stride_swk, FP4, BLOCK_N, BLOCK_K)
    return _w_decode(w_ptr, s, n0, N, k0, k_hi, stride_wn, FP4, DOT, BLOCK_N, BLOCK_K, E2M1)


@triton.jit
def _w_packed(w_ptr, sw_ptr, n0, N, k0, k_hi, stride_wn, stride_swn, stride_swk, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """``fp4_w`` rows [n0, n0 + BLOCK_N) at K block k0 as ``tl.dot_scaled``'s e2m1 operand: the bytes
    [BLOCK_K // 2, BLOCK_N] (two K elements a byte, the low nibble first) and the UE8M0 scale bytes
    [BLOCK_N, BLOCK_K // 32]."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    n_ok = offs_n < N
    w = tl.load(w_ptr + offs_n[None, :] * stride_wn + kb[:, None], mask=n_ok[None, :] & (kb * 2 < k_hi)[:, None],
                other=0)
    s = tl.load(sw_ptr + offs_n[:, None] * stride_swn + kg[None, :] * stride_swk,
                mask=n_ok[:, None] & (kg * 32 < k_hi)[None, :], other=0)
    return w, s


@triton.jit
def _x_fp8(a_rows, ok, kg, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Float activations x[:, kg + 0..31] quantized in registers to ``fp8`` (what act_quant stores):
    (E4M3 bytes uint8 [BLOCK_M, G, 32], UE8M0 bytes int32 [BLOCK_M, G])."""
    x = tl.load(a_rows[:, None, None] + kg[None, :, None] + tl.arange(0, 32)[None, None, :],
                mask=ok[:, :, None], other=0.0).to(tl.float32)
    q, s = quant_fp8(x)
    return q.to(tl.uint8), s


@triton.jit
def _a_block(a_rows, sa_rows, row_ok, k0, k_hi, QX: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """Dequantized activations [BLOCK_M, BLOCK_K] at k0 as DOT (a_rows / sa_rows: row pointers; QX 1
    (True): a_rows point at float rows quantized here; QX 2: at float rows that already hold the
    dequantized fp8 values (:data:`ACT_DEQUANTIZED`), loaded as they are; sa_rows unused for both)."""
    if QX == ACT_DEQUANTIZED:
        offs = k0 + tl.arange(0, BLOCK_K)
        return tl.load(a_rows[:, None] + offs[None, :], mask=row_ok[:, None] & (offs < k_hi)[None, :],
                       other=0.0).to(DOT)
    G: tl.constexpr = BLOCK_K // 32
    kg = k0 + tl.arange(0, G) * 32
    ok = row_ok[:, None] & (kg < k_hi)[None, :]
    if QX:
        a, sb = _x_fp8(a_rows, ok, kg, G, BLOCK_M)
    else:
        a = tl.load(a_rows[:, None, None] + kg[None, :, None] + tl.arange(0, 32)[None, None, :],
                    mask=ok[:, :, None], other=0)
        sb = tl.load(sa_rows[:, None] + (kg // 32)[None, :], mask=ok, other=0).to(tl.int32)
    sa = e8m0_to_f32(sb) * 256.0
    return tl.reshape(e4m3_x256(a).to(tl.float32) * sa[:, :, None], (BLOCK_M, BLOCK_K)).to(DOT)


@triton.jit
def _halves(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activations [BLOCK_M, BLOCK_K] in the K order the fp4 weights take with 32 in E2M1: within each
    8, positions 0, 2, 4, 6, then 1, 3, 5, 7 (the low nibbles of four bytes, then their high ones).
    The packed decode's registers hold two low (or two high) nibbles' values, which the MMA then
    takes as one operand register; the sum over K is the same."""
    return tl.reshape(tl.permute(tl.reshape(a, (BLOCK_M, BLOCK_K // 8, 4, 2)), (0, 1, 3, 2)), (BLOCK_M, BLOCK_K))


@triton.jit
def _col_scale(sw_ptr, n0, N, k1, k_hi, stride_swn, stride_swk, BLOCK_N: tl.constexpr):
    """fp8_w tile scale of each column n0 + [0, BLOCK_N) at K offset k1: one scalar load per 32."""
    grp = tl.arange(0, BLOCK_N) // 32
    out = tl.zeros([BLOCK_N], tl.float32)
    for g in tl.static_range(BLOCK_N // 32):
        nb = n0 // 32 + g
        ok = (nb * 32 < N) & (k1 < k_hi)
        byte = tl.load(sw_ptr + nb * stride_swn + (k1 // 32) * stride_swk, mask=ok, other=127).to(tl.int32)
        out = tl.where(grp == g, e8m0_to_f32(byte), out)
    return out


@triton.jit
def _promote(acc, a, sa, w_ptr, sw_ptr, n0, N, k1, k_hi, stride_wn, stride_swn, stride_swk,
             DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc + (a @ w[:, k1:k1+32].T) * sa[:, None] * sw[None, :] with raw E4M3 dot operands."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = k1 + tl.arange(0, 32)
    ok = (offs_n < N)[:, None] & (offs_k < k_hi)[None, :]
    b = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=ok, other=0.0)
    part = tl.dot(a, tl.trans(_e4m3_operand(b, DOT)))
    sw = _col_scale(sw_ptr, n0, N, k1, k_hi, stride_swn, stride_swk, BLOCK_N)
    return acc + part * (sa[:, None] * sw[None, :])


@triton.jit
def _fma_k_loop(a_rows, sa_rows, row_ok, w_ptr, sw_ptr, w3_ptr, sw3_ptr, n0, N, k_lo, k_hi, stride_wn, stride_swn,
                stride_swk, FP4: tl.constexpr, DUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, QX: tl.constexpr, E2M1: tl.constexpr = 0):
    """:func:`_k_loop` for row tiles under 16 (a GEMV: decode's few rows): both operands dequantized
    to fp32 in registers, their products added elementwise into [BLOCK_M, BLOCK_N, BLOCK_K] partial
    sums, reduced over K once at the end. No MMA: its 16-row minimum would spend 15 of 16 rows on
    nothing at one row, and the weight tile is used where it was decoded, without the trip through
    shared memory a dot operand takes. Of E2M1 only the word layout's flag applies (64: fp4_w bytes
    in words, put back in nibbles before the code-by-code decode). Products of E4M3 / E2M1 values
    are exact in fp32; only the order of the fp32 sums differs from the MMA paths."""
    W_E2M1: tl.constexpr = E2M1 & 64 if FP4 else 0
    part = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    part3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a = _a_block(a_rows, sa_rows, row_ok, k0, k_hi, QX, tl.float32, BLOCK_M, BLOCK_K)[:, None, :]
        b = _w_block(w_ptr, sw_ptr, n0, N, k0, k_hi, stride_wn, stride_swn, stride_swk, FP4, tl.float32, BLOCK_N,
                     BLOCK_K, W_E2M1)
        part += a * b[None, :, :]
        if DUAL:
            b3 = _w_block(w3_ptr, sw3_ptr, n0, N, k0, k_hi, stride_wn, stride_swn, stride_swk, FP4, tl.float32,
                          BLOCK_N, BLOCK_K, W_E2M1)
            part3 += a * b3[None, :, :]
    return tl.sum(part, axis=2), tl.sum(part3, axis=2)


@triton.jit
def _mma_k_loop(a_rows, sa_rows, row_ok, w_ptr, sw_ptr, w3_ptr, sw3_ptr, n0, N, k_lo, k_hi, stride_wn, stride_swn,
                stride_swk, FP4: tl.constexpr, PROMOTE: tl.constexpr, DUAL: tl.constexpr, DOT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QX: tl.constexpr,
                E2M1: tl.constexpr):
    """:func:`_k_loop` for row tiles of 16 and more: ``tl.dot`` per 32-wide K slice (PROMOTE) or per K
    block; fp4_w with E2M1 == 1: ``tl.dot_scaled`` on the packed E2M1 bytes and their scales (Triton's
    own decode of the weights, in place of :func:`_w_block`'s). fp4_w with 8 in E2M1: each block's
    scale bytes are loaded one block ahead and carried in registers (too narrow for the pipeliner's
    asynchronous copies, they would otherwise be waited for in the block that decodes them). With 32
    in E2M1 the activation block is permuted to the decoded weights' K order (:func:`_halves`)."""
    PREFETCH: tl.constexpr = FP4 and not PROMOTE and (E2M1 // 8) % 2 == 1
    # the halves order on tiles under 64 rows only (mma.sync, operands in registers); 64-row tiles take
    # the warpgroup MMA, whose activation operand a permutation would send through shared memory
    # (and not over the words' packed decode, whose registers are in element order already)
    HALVES: tl.constexpr = (FP4 and not PROMOTE and (E2M1 // 32) % 2 == 1 and BLOCK_M < 64
                            and not (E2M1 % 8 == 2 and (E2M1 // 64) % 2 == 1))
    W_E2M1: tl.constexpr = E2M1 if HALVES else E2M1 & ~32  # what the weights' decode is told
    # the swap_operands tile on the dequantizing loops' warpgroup-MMA tiles: acc holds the tile transposed
    SWAP: tl.constexpr = not PROMOTE and E2M1 != 1 and (E2M1 // 512) % 2 == 1 and BLOCK_M >= 64
    tl.static_assert(not (PROMOTE and QX == ACT_DEQUANTIZED), "fp8 MMA on raw E4M3 needs fp8 activations")
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if PREFETCH:
        s_next = _w_scales(sw_ptr, n0, N, k_lo, k_hi, stride_swn, stride_swk, FP4, BLOCK_N, BLOCK_K)
        if DUAL:
            s3_next = _w_scales(sw3_ptr, n0, N, k_lo, k_hi, stride_swn, stride_swk, FP4, BLOCK_N, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if PROMOTE:
            for kk in tl.static_range(BLOCK_K // 32):
                k1 = k0 + kk * 32
                if QX:
                    kg = k1 + tl.arange(0, 1) * 32
                    a, sb = _x_fp8(a_rows, row_ok[:, None] & (kg < k_hi)[None, :], kg, 1, BLOCK_M)
                    a, sa = tl.reshape(a, (BLOCK_M, 32)), e8m0_to_f32(tl.reshape(sb, (BLOCK_M,)))
                else:
                    offs_k = k1 + tl.arange(0, 32)
                    a = tl.load(a_rows[:, None] + offs_k[None, :], mask=row_ok[:, None] & (offs_k < k_hi)[None, :],
                                other=0)
                    sa = tl.load(sa_rows + k1 // 32, mask=row_ok & (tl.full([BLOCK_M], k1, tl.int32) < k_hi), other=0)
                    sa = e8m0_to_f32(sa.to(tl.int32))
                a = _e4m3_operand(a, DOT)
                acc = _promote(acc, a, sa, w_ptr, sw_ptr, n0, N, k1, k_hi, stride_wn, stride_swn, stride_swk, DOT,
                               BLOCK_N)
                if DUAL:
                    acc3 = _promote(acc3, a, sa, w3_ptr, sw3_ptr, n0, N, k1, k_hi, stride_wn, stride_swn, stride_swk,
                                    DOT, BLOCK_N)
        elif FP4 and E2M1 == 1:  # the activations exact in bf16 (E4M3 times a power of two)
            a = _a_block(a_rows, sa_rows, row_ok, k0, k_hi, QX, DOT, BLOCK_M, BLOCK_K).to(tl.bfloat16)
            wq, ws = _w_packed(w_ptr, sw_ptr, n0, N, k0, k_hi, stride_wn, stride_swn, stride_swk, BLOCK_N, BLOCK_K)
            acc = tl.dot_scaled(a, None, "bf16", wq, ws, "e2m1", acc)
            if DUAL:
                wq3, ws3 = _w_packed(w3_ptr, sw3_ptr, n0, N, k0, k_hi, stride_wn, stride_swn, stride_swk, BLOCK_N,
                                     BLOCK_K)
                acc3 = tl.dot_scaled(a, None, "bf16", wq3, ws3, "e2m1", acc3)
        elif PREFETCH:
            s = s_next
            s_next = _w_scales(sw_ptr, n0, N, k0 + BLOCK_K, k_hi, stride_swn, stride_swk, FP4, BLOCK_N, BLOCK_K)
            if DUAL:
                s3 = s3_next
                s3_next = _w_scales(sw3_ptr, n0, N, k0 + BLOCK_K, k_hi, stride_swn, stride_swk, FP4, BLOCK_N, BLOCK_K)
            a = _a_block(a_rows, sa_rows, row_ok, k0, k_hi, QX, DOT, BLOCK_M, BLOCK_K)
            if HALVES:
                a = _halves(a, BLOCK_M, BLOCK_K)
            acc = _mma(a, _w_decode(w_ptr, s, n0, N, k0, k_hi, stride_wn, FP4, DOT, BLOCK_N, BLOCK_K, W_E2M1), acc,
                       SWAP)
            if DUAL:
                acc3 = _mma(a, _w_decode(w3_ptr, s3, n0, N, k0, k_hi, stride_wn, FP4, DOT, BLOCK_N, BLOCK_K, W_E2M1),
                            acc3, SWAP)
        else:
            a = _a_block(a_rows, sa_rows, row_ok, k0, k_hi, QX, DOT, BLOCK_M, BLOCK_K)
            if HALVES:
                a = _halves(a, BLOCK_M, BLOCK_K)
            b = _w_block(w_ptr, sw_ptr, n0, N, k0, k_hi, stride_wn, stride_swn, stride_swk, FP4, DOT, BLOCK_N,
                         BLOCK_K, W_E2M1)
            acc = _mma(a, b, acc, SWAP)
            if DUAL:
                b3 = _w_block(w3_ptr, sw3_ptr, n0, N, k0, k_hi, stride_wn, stride_swn, stride_swk, FP4, DOT, BLOCK_N,
                              BLOCK_K, W_E2M1)
                acc3 = _mma(a, b3, acc3, SWAP)
    if SWAP:
        acc, acc3 = tl.trans(acc), tl.trans(acc3)
    return acc, acc3


@triton.jit
def _mma(a, w, acc, SWAP: tl.constexpr):
    """``acc + a @ w.T`` (activations [M, K], dequantized weights [N, K]); SWAP: ``acc + w @ a.T``,
    acc being the tile transposed. On sm_90 a 64-row tile's MMA is the warpgroup MMA, whose first
    operand may stay in registers while the second is read from shared memory: swapped, the decoded
    weights are that register operand as they come out of the decode, and the activations (loaded,
    not computed) the shared one, where unswapped the decoded weights are stored to shared memory
    block by block for the MMA to read back."""
    if SWAP:
        return tl.dot(w, tl.trans(a), acc)
    else:
        return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _k_loop(a_rows, sa_rows, row_ok, w_ptr, sw_ptr, w3_ptr, sw3_ptr, n0, N, k_lo, k_hi, stride_wn, stride_swn,
            stride_swk, FP4: tl.constexpr, PROMOTE: tl.constexpr, DUAL: tl.constexpr, DOT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QX: tl.constexpr = False,
            E2M1: tl.constexpr = 0):
    """fp32 [BLOCK_M, BLOCK_N] of xq @ w.T over K in [k_lo, k_hi) (and of xq @ w3.T when DUAL).
    QX: ``a_rows`` point at float activation rows, quantized to fp8 per 32 in registers (the bytes
    ``act_quant`` would store: one launch fewer; every program of a row re-quantizes its K range);
    QX 2 (:data:`ACT_DEQUANTIZED`): ``a_rows`` point at float rows of dequantized fp8 values.
    E2M1: how the MMA loop decodes fp4_w codes (0 bit by bit, 1 ``tl.dot_scaled``, 2 two a byte in
    packed registers; plus 8: the scales loaded a block ahead, :func:`_mma_k_loop`; plus 16: the packed
    decode's re-bias folded into the scales, :func:`_w_decode`; plus 32: both operands in
    :func:`_halves`' K order). Row tiles under 16 take the multiply-add loop (PROMOTE and DOT do not
    apply, of E2M1 only the word layout's 64), others the MMA loop."""
    if BLOCK_M < 16:
        acc, acc3 = _fma_k_loop(a_rows, sa_rows, row_ok, w_ptr, sw_ptr, w3_ptr, sw3_ptr, n0, N, k_lo, k_hi, stride_wn,
                                stride_swn, stride_swk, FP4, DUAL, BLOCK_M, BLOCK_N, BLOCK_K, QX, E2M1)
    else:
        acc, acc3 = _mma_k_loop(a_rows, sa_rows, row_ok, w_ptr, sw_ptr, w3_ptr, sw3_ptr, n0, N, k_lo, k_hi, stride_wn,
                                stride_swn, stride_swk, FP4, PROMOTE, DUAL, DOT, BLOCK_M, BLOCK_N, BLOCK_K, QX, E2M1)
    return acc, acc3


@triton.jit
def _linear_kernel(xq_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, k_split, n_splits,
                   stride_xm, stride_sxm, stride_wn, stride_swn, stride_om, stride_os,
                   FP4: tl.constexpr, PROMOTE: tl.constexpr, DOT: tl.constexpr, OUT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   QX: tl.constexpr, REDUCE: tl.constexpr, E2M1: tl.constexpr, SCALE_K: tl.constexpr = 1):
    """One output tile's K range. QX: xq_ptr holds the float x (quantized here). REDUCE: the tile's
    splits meet in :func:`.splitk.store_tile`; otherwise split s stores at out + s * stride_os.
    SCALE_K: the weight scales' stride along K (1: row major; the rows' count: K major)."""
    wait_inputs()
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # grouped order: GROUP_M row tiles share each weight tile in L2
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    n0 = ((pid % width) // size_m) * BLOCK_N
    k_lo = tl.program_id(1) * k_split
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r64 = rows.to(tl.int64)
    acc, _ = _k_loop(xq_ptr + r64 * stride_xm, sx_ptr + r64 * stride_sxm, rows < M, w_ptr, sw_ptr, w_ptr, sw_ptr,
                     n0, N, k_lo, tl.minimum(k_lo + k_split, K), stride_wn, stride_swn, SCALE_K,
                     FP4, PROMOTE, False, DOT, BLOCK_M, BLOCK_N, BLOCK_K, QX, E2M1)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ok = (rows < M)[:, None] & (offs_n < N)[None, :]
    out = out_ptr if REDUCE else out_ptr + tl.program_id(1) * stride_os
    store_tile(acc, out, ws_ptr, cnt_ptr, pid, tl.program_id(1), n_splits, rows, offs_n, ok, stride_om, M, N,
               OUT, REDUCE)
