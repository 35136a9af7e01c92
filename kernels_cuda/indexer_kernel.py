"""Triton kernels of the indexer (launchers: :mod:`.indexer`): ``index_scores`` (fused dot, ReLU, head weights, head sum, visibility mask) and
``candidate_blocks`` (block max + the threshold select of :mod:`.topk` + expansion).

``index_scores``: one program per (batch, block of ``BLOCK_S`` queries, block of ``BLOCK_T``
keys) computes ``k_tile [BLOCK_T, Di] @ q_tile^T [Di, BLOCK_S * Hi]`` (the key tile is the A
operand, dequantized in registers; on sm_90 wgmma takes A from registers), then ReLU, times the
head weights, the sum over heads and the ``t < visible`` mask, and writes ``[BLOCK_T, BLOCK_S]``.
Tiles wholly past every query's ``visible`` skip the math. Paged keys (``PagedKeys``, the HKCP
index K) are read in place: each key row's address is ``block_table[b, t // P] * P + t % P`` in
the shared pool, computed in the kernel (no gathered copy). QTensor keys (``fp4_b32`` in the
model; ``fp4_b16``, ``fp8``, ``int8`` too) are read as stored: a ``[BLOCK_T, Di / block, bytes]``
tile and its ``[BLOCK_T, Di / block]`` scale bytes; packed E2M1 low / high nibbles (elements
``2i`` / ``2i + 1``) are decoded separately and interleaved with ``tl.join``, so one K = Di dot
consumes the values in element order.

Decoding (the indexer is memory-bound: the decode's instruction count, not the MMA, is what can
bind in decode, where each key meets only 32 heads):

- exact path (interpreter, fp32 / fp16 dots, and any tile with an extreme scale): code ``c`` as
  the fp16 bits ``(c & 7) << 9 | sign`` (its value times 2**-14; the 0.5 code is an fp16
  subnormal, kept by the fp16 -> fp32 conversion, where an fp32 subnormal would be flushed),
  times ``2**14 *`` the scale, in fp32;
- asm path (GPU, bf16 q; ``TILES asm_decode``): the packed E2M1 decode of :mod:`.codecs` turns 4
  packed bytes into their 8 codes' bf16 bit patterns ``(c & 7) << 6 | sign`` (the value times
  2**-126) times the bf16 scale ``2**(sb - 65)`` (bf16x2 multiplies keep subnormals); the dot result
  is scaled by ``2**64``. Exact whenever the tile's scale bytes lie in [66, 192] (scales 2**-61 .. 2**65);
  other tiles take the exact path. Fewer instructions per key than the exact path (docs/performance.md).

The dot runs in bf16 on the GPU when q is bf16 and k is fp4 or bf16 (every product is then exact
in fp32), in fp16 for fp16 q and k, else in fp32 with ``TILES fp32_precision`` (tf32x3: about
fp32 accuracy); always fp32 in the interpreter (its bf16 dot is wrong).
"""
from __future__ import annotations

import triton
import triton.language as tl

from flashrt.kernels_cuda.codecs import dequant_rows, e2m1_pairs_bf16
from flashrt.kernels_cuda.topk_kernel import _keys
from flashrt.kernels_cuda.pdl import wait_inputs

_MAX = tl.constexpr(2147483647)


_ASM_OFFSET = tl.constexpr(64)  # the asm path computes k * 2**-64 (its scales stay normal bf16)


@triton.jit
def _decode_exact(byte, sb, FMT: tl.constexpr, DOT: tl.constexpr):
    """[T, NB, bytes per block] stored bytes, [T, NB] scale bytes -> [T, NB * block] values in
    element order (FMT: ``codecs.CODES``), by the shared row decoder."""
    T: tl.constexpr = byte.shape[0]
    BLOCK: tl.constexpr = 16 if FMT == 2 else 32
    flat = tl.reshape(byte, [T, byte.shape[1] * byte.shape[2]])
    return dequant_rows(flat, sb, FMT, T, byte.shape[1] * BLOCK).to(DOT)


@triton.jit
def _decode_asm(byte, sb):
    """As _decode_exact times 2**-64, in bf16 (sm_90, or the interpreter emulating its PTX): the packed
    E2M1 decode (:func:`.codecs.e2m1_pairs_bf16`, its 2**126 re-bias folded into the scale) by the bf16
    scale 2**(sb - 1 - 64) (exact for sb in [66, 192])."""
    scale = ((sb + (126 - _ASM_OFFSET)) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)[:, :, None]
    lo, hi = e2m1_pairs_bf16(byte, tl.broadcast_to(scale, byte.shape), True)
    vals = tl.join(lo, hi)
    return tl.reshape(vals, [vals.shape[0], vals.shape[1] * 32])


@triton.jit
def _tile_quant(k_ptr, ks_ptr, q_rows, row_ok, offs_t, t_ok, sk_t, ss_t, sq_d, D: tl.constexpr,
                NB: tl.constexpr, BLOCK: tl.constexpr, BYTES: tl.constexpr, FMT: tl.constexpr,
                ONE: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr):
    """k tile [T, D] (QTensor, dequantized in registers) @ q^T [D, M] in one dot (K = NB * BLOCK):
    ``NB`` scale blocks of ``BLOCK`` elements held in ``BYTES`` bytes; ``ONE``: a scale byte of 1.0."""
    blk = tl.arange(0, NB)
    live = t_ok[:, None] & (blk < D // BLOCK)[None, :]
    offs = offs_t[:, None, None] * sk_t + (blk * BYTES)[None, :, None] + tl.arange(0, BYTES)[None, None, :]
    byte = tl.load(k_ptr + offs, mask=live[:, :, None], other=0)  # [T, NB, BYTES]
    sb = tl.load(ks_ptr + offs_t[:, None] * ss_t + blk[None, :], mask=live, other=ONE).to(tl.int32)
    d = tl.arange(0, NB * BLOCK)
    qt = tl.load(q_rows[None, :] + (d * sq_d)[:, None], mask=row_ok[None, :] & (d < D)[:, None], other=0.0)
    if ASM:  # fp4_b32, bf16 dot (fp32 under the interpreter, whose bf16 dot is not exact)
        if (tl.min(sb) >= _ASM_OFFSET + 2) & (tl.max(sb) <= _ASM_OFFSET + 128):
            dots = tl.dot(_decode_asm(byte, sb).to(DOT), qt.to(DOT)) * 1.8446744073709552e19  # 2**64
        else:
            dots = tl.dot(_decode_exact(byte, sb, FMT, DOT), qt.to(DOT), input_precision=PREC)
    else:
        dots = tl.dot(_decode_exact(byte, sb, FMT, DOT), qt.to(DOT), input_precision=PREC)
    return dots


@triton.jit
def _tile_plain(acc, k_ptr, q_rows, row_ok, offs_t, t_ok, sk_t, sk_d, sq_d,
                D: tl.constexpr, BLOCK_D: tl.constexpr, DK: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    for d0 in tl.static_range(0, BLOCK_D, DK):
        d = d0 + tl.arange(0, DK)
        kt = tl.load(k_ptr + offs_t[:, None] * sk_t + d[None, :] * sk_d, mask=t_ok[:, None] & (d < D)[None, :],
                     other=0.0)
        qt = tl.load(q_rows[None, :] + (d * sq_d)[:, None], mask=row_ok[None, :] & (d < D)[:, None], other=0.0)
        acc = tl.dot(kt.to(DOT), qt.to(DOT), acc, input_precision=PREC)
    return acc


# The key count and the output's row strides (which follow it) are not specialised on (== 1,
# % 16 == 0): a decode's key count grows by one entry a step, and a variant per class would be
# compiled mid-run. They only mask and address the scores written, a few per thread.
@triton.jit(do_not_specialize=("T", "so_b", "so_s"))
def _index_scores_kernel(q_ptr, k_ptr, ks_ptr, w_ptr, vis_ptr, out_ptr, bt_ptr, S, T, H,
                         sq_b, sq_s, sq_h, sq_d, sk_b, sk_t, sk_d, ss_b, ss_t, sw_b, sw_s, sw_h, sv_b, sv_s,
                         so_b, so_s, sbt_b, PAGE, w_scale, PAGED: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, DK: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, FMT: tl.constexpr, NB: tl.constexpr,
                         QBLOCK: tl.constexpr, QBYTES: tl.constexpr, ONE: tl.constexpr,
                         DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr):
    wait_inputs()
    b = tl.program_id(2).to(tl.int64)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    vis = tl.load(vis_ptr + b * sv_b + offs_s * sv_s, mask=offs_s < S, other=0)
    acc = tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.float32)
    if tl.program_id(0) * BLOCK_T < tl.max(vis):
        m = tl.arange(0, BLOCK_S * BLOCK_H)  # dot column = (query, head)
        s_of = tl.program_id(1) * BLOCK_S + m // BLOCK_H
        h_of = m % BLOCK_H
        row_ok = (s_of < S) & (h_of < H)
        q_rows = q_ptr + b * sq_b + s_of * sq_s + h_of * sq_h
        t_ok = offs_t < T
        rows_t = offs_t.to(tl.int64)  # the key rows' addresses: row t of this batch's keys ...
        if PAGED:  # ... or pool row block_table[b, t // PAGE] * PAGE + t % PAGE (the pool is shared)
            page = tl.load(bt_ptr + b * sbt_b + offs_t // PAGE, mask=t_ok, other=0)
            rows_t = page.to(tl.int64) * PAGE + offs_t % PAGE
        if FMT > 0:
            dots = _tile_quant(k_ptr + b * sk_b, ks_ptr + b * ss_b, q_rows, row_ok, rows_t, t_ok, sk_t, ss_t,
                               sq_d, D, NB, QBLOCK, QBYTES, FMT, ONE, DOT, PREC, ASM)
        else:
            dots = _tile_plain(tl.zeros([BLOCK_T, BLOCK_S * BLOCK_H], dtype=tl.float32), k_ptr + b * sk_b, q_rows,
                               row_ok, rows_t, t_ok, sk_t, sk_d, sq_d, D, BLOCK_D, DK, DOT, PREC)
        # the head weights in fp32 times their scale (the weights may arrive in the linear's dtype)
        w = tl.load(w_ptr + b * sw_b + s_of * sw_s + h_of * sw_h, mask=row_ok, other=0.0).to(tl.float32) * w_scale
        dots = tl.maximum(dots, 0.0) * w[None, :]
        acc = tl.sum(tl.reshape(dots, [BLOCK_T, BLOCK_S, BLOCK_H]), axis=2)
    res = tl.where(offs_t[:, None] < vis[None, :], acc, float("-inf"))
    mask = (offs_t[:, None] < T) & (offs_s[None, :] < S)
    rows = out_ptr + b * so_b + offs_s.to(tl.int64) * so_s  # S * T may pass 2**31 in prefill
    tl.store(rows[None, :] + offs_t[:, None], res, mask=mask)


# The row length and what follows it (block count, row strides) are not specialised on (== 1,
# % 16 == 0): a decode's rows grow by one entry a step, and a variant per class would be compiled
# mid-run. The loads and stores they address are not vectorised anyway (blocks of a runtime size;
# byte flags), and a warp's accesses stay contiguous.
@triton.jit(do_not_specialize=("T", "NB", "s_row", "k_row"))
def _block_keys_kernel(s_ptr, vis_ptr, key_ptr, flag_ptr, T, NB, bs, s_row, k_row,
                       BLOCKS: tl.constexpr, BJ: tl.constexpr):
    """Key of the max finite score of each block; the block holding visible - 1 -> MAX (pinned).
    Clears the blocks' flags (``[R, NB]`` bytes, row stride ``k_row``) for the select to mark."""
    wait_inputs()
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    best = tl.full([BLOCKS], -2147483648, tl.int32)
    for j0 in range(0, bs, BJ):
        j = j0 + tl.arange(0, BJ)
        pos = blk[:, None] * bs + j[None, :]
        ok = (j < bs)[None, :] & (pos < T)
        x = tl.load(s_ptr + r * s_row + pos, mask=ok, other=0.0)
        best = tl.maximum(best, tl.max(_keys(x, ok), axis=1))
    vis = tl.load(vis_ptr + r)
    best = tl.where((blk == (vis - 1) // bs) & (vis > 0), _MAX, best)
    tl.store(key_ptr + r * k_row + blk, best, mask=blk < NB)
    tl.store(flag_ptr + r * k_row + blk, tl.zeros([BLOCKS], tl.uint8), mask=blk < NB)


@triton.jit(do_not_specialize=("T", "f_row", "o_row"))
def _expand_kernel(flag_ptr, out_ptr, T, bs, f_row, o_row, BLOCK: tl.constexpr):
    wait_inputs()
    r = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = tl.load(flag_ptr + r * f_row + t // bs, mask=t < T, other=0)
    tl.store(out_ptr + r * o_row + t, keep, mask=t < T)
