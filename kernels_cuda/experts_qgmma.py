"""fp4_w expert rows on Hopper's fp8 warpgroup MMA, the weights as its register operand (sm_90, Gluon).

The routed experts at decode are bound by their instructions, most of them the E2M1 -> bf16 decode
in front of ``mma.sync`` (:mod:`.moe_mma`, the 16-row tile of :mod:`.moe_kernels`). Here each
warpgroup owns 64 weight rows as the M of ``wgmma m64nNk32`` with E4M3 operands (tokens as its N,
8 or 16): an E2M1 code becomes an E4M3 byte by moving its bits alone (the three magnitude bits to
bits 4-2, the sign to bit 7: the code's value times 2**-6, exactly, subnormal 0.5 included), so one
32-bit word of eight codes in the standard nibbles decodes in seven integer instructions into two
operand registers (its even codes, its odd codes), against seventeen a word for the bf16 pairs. The
activations are the E4M3 codes of their fp8 round trip (:func:`.round_trip.fp8_codes`), the MMA's B
operand in shared memory, loaded once a program; each K block's product is scaled in fp32 by its
weight rows' and tokens' scales (both powers of two: exact) and summed in fp32.

A thread's 4-byte load of a row at byte ``4t`` of a 32-code block holds codes ``8t .. 8t + 7``: its
even codes go to the operand register of MMA K positions ``4t .. 4t + 3``, its odd codes to
``16 + 4t .. 16 + 4t + 3``. The activations are stored in shared memory in that order (MMA position
``16h + 4t + j`` holds K ``8t + 2j + h``), so the weights keep the layout every other path reads.

:func:`fill` and :func:`loop` are the activations' staging and the K loop of one expert tile;
:func:`experts_gemm` launches them over (expert, token tile) pairs with fp32 partials per K split
(summed by the caller): the building block ``benchmarks/experts_qgmma.py`` measures.
"""
from __future__ import annotations

import torch
import triton.language as tl

from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.attention_ws import AVAILABLE
from flashrt.kernels_cuda.launch import cdiv, next_pow2

ROWS = 64  # weight rows a program: the M of one warpgroup MMA
DECODE_SCALE = 2.0 ** 6  # the E4M3 bytes hold the E2M1 values times 2**-6
_DECODE_SCALE = tl.constexpr(DECODE_SCALE)
# one word of standard nibbles (code 2i in byte i's low nibble, 2i + 1 in its high one) into two registers
# of four E4M3 bytes: $0 its even codes (magnitude up by 2, sign up by 4), $1 its odd codes (magnitude down
# by 2, the sign in place)
DECODE_PTX = tl.constexpr("""{
.reg .b32 a, b, c;
shl.b32 a, $2, 2;
and.b32 a, a, 0x1C1C1C1C;
shl.b32 b, $2, 4;
lop3.b32 $0, b, 0x80808080, a, 0xEA;
shr.b32 c, $2, 2;
and.b32 c, c, 0x1C1C1C1C;
lop3.b32 $1, $2, 0x80808080, c, 0xEA;
}""")


if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.language._core import shared_memory_descriptor

    from flashrt.kernels_cuda.attention_ws import _async_load, _sync
    from flashrt.kernels_cuda.pdl import wait_inputs

    if not hasattr(shared_memory_descriptor, "reinterpret"):  # Triton 3.6 names it _reinterpret, later ones not
        shared_memory_descriptor.reinterpret = shared_memory_descriptor._reinterpret

    _pow2 = gluon.constexpr_function(next_pow2)

    @gluon.constexpr_function
    def mma_layout(TOKENS):
        """The accumulators' layout: one warpgroup's m64nTOKENS tiles of ``wgmma``."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TOKENS, 32])

    @gluon.jit
    def _decode(byte):
        """uint8 bytes (four a register) -> (E4M3 of their even codes, of their odd codes), same shape."""
        p, q = gl.inline_asm_elementwise(DECODE_PTX, "=r,=r,r", [byte], dtype=(gl.uint8, gl.uint8), is_pure=True,
                                         pack=4)
        return p.to(gl.float8e4nv, bitcast=True), q.to(gl.float8e4nv, bitcast=True)

    @gluon.jit
    def _operand(byte, a_l: gl.constexpr):
        """A block's bytes ``[ROWS, 16]`` (a thread's 4 at ``4t``) -> its A operand ``[ROWS, 32]`` in ``a_l``."""
        ROWS: gl.constexpr = byte.shape[0]
        even, odd = _decode(byte)
        z = gl.permute(gl.join(even, odd), [0, 2, 1])  # (r, odd, 4t + j)
        return gl.convert_layout(gl.reshape(z, [ROWS, 32]), a_l, assert_trivial=True)  # position 16 odd + 4t + j

    @gluon.jit
    def _block(byte, x_smem, s_smem, kb, w_exp, a_l: gl.constexpr, cols_l: gl.constexpr, zero):
        """Start block ``kb``'s MMA over its weight bytes: (the product in flight, its scales [64, TOKENS]:
        the rows' UE8M0 ``w_exp`` times the tokens' scales)."""
        d = warpgroup_mma(_operand(byte, a_l), x_smem.index(kb).permute((1, 0)), zero, use_acc=False, is_async=True)
        w = ((w_exp & 0xFF) << 23).to(gl.float32, bitcast=True)
        return d, w[:, None] * s_smem.index(kb).load(cols_l)[None, :]

    @gluon.jit
    def _trip(b0, b1, b2, b3, sw, x_smem, s_smem, kb, a_l: gl.constexpr, cols_l: gl.constexpr, zero, acc):
        """Four blocks from ``kb``: their weight bytes ``b*`` and the rows' four scale bytes ``sw`` (one
        int32 word a row, block ``u``'s byte at bits ``8u``) into ``acc``."""
        d0, s0 = _block(b0, x_smem, s_smem, kb, sw, a_l, cols_l, zero)
        d1, s1 = _block(b1, x_smem, s_smem, kb + 1, sw >> 8, a_l, cols_l, zero)
        d2, s2 = _block(b2, x_smem, s_smem, kb + 2, sw >> 16, a_l, cols_l, zero)
        d3, s3 = _block(b3, x_smem, s_smem, kb + 3, sw >> 24, a_l, cols_l, zero)
        d0, d1, d2, d3 = warpgroup_mma_wait(0, deps=[d0, d1, d2, d3])
        return acc + d0 * s0 + d1 * s1 + d2 * s2 + d3 * s3

    @gluon.jit
    def _scale_word(s_src, kb, stride_sk, KMAJOR: gl.constexpr):
        """The rows' scale bytes of blocks ``kb .. kb + 3`` as one int32 a row: row major, the word at
        ``s_src`` (int32 words of four blocks); KMAJOR, four bytes ``stride_sk`` apart from ``s_src``."""
        if KMAJOR:
            b = s_src + kb * stride_sk
            word = (gl.load(b).to(gl.int32) | (gl.load(b + stride_sk).to(gl.int32) << 8)
                    | (gl.load(b + 2 * stride_sk).to(gl.int32) << 16) | (gl.load(b + 3 * stride_sk).to(gl.int32) << 24))
        else:
            word = gl.load(s_src + kb // 4)
        return word

    @gluon.jit
    def fill(x_ptr, xs_ptr, tok, stride_xm, stride_xsm, k_lo, nb, TOKENS: gl.constexpr, KB: gl.constexpr,
             num_warps: gl.constexpr):
        """(x smem [KB', TOKENS, 32] E4M3, scale smem [KB', TOKENS] fp32; KB' the least power of two at
        least KB): blocks ``k_lo / 32 ..`` of rows ``tok`` (int64 [TOKENS]) of x and xs, x's 32 codes a block
        in the MMA's order; blocks from ``nb`` on and lanes of negative ``tok`` are zero."""
        # all KB blocks in one load and one store each, through flat 2-D views of the 3-D buffers (the same
        # addresses: a block's [TOKENS, 32] bytes are whole swizzle atoms), not a store (and its barrier) a
        # block. Tensors take power-of-two shapes: KB rounded up (the blocks past nb are zero, never read)
        KBP: gl.constexpr = _pow2(KB)
        nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        xl: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, TOKENS, 32 // TOKENS], [num_warps, 1, 1], [2, 1, 0])
        tok_x = gl.convert_layout(tok, gl.SliceLayout(0, gl.SliceLayout(2, xl)))
        kb_x = gl.arange(0, KBP, layout=gl.SliceLayout(1, gl.SliceLayout(2, xl)))
        c_x = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl)))
        v = gl.load(x_ptr + gl.maximum(tok_x, 0)[None, :, None] * stride_xm + k_lo + kb_x[:, None, None] * 32
                    + c_x[None, None, :], mask=(tok_x >= 0)[None, :, None] & (kb_x < nb)[:, None, None], other=0.0)
        # K 8t + 2j + h to MMA position 16h + 4t + j: the decode's even / odd codes
        v = gl.reshape(gl.permute(gl.reshape(v, [KBP, TOKENS, 4, 4, 2]), [0, 1, 4, 2, 3]), [KBP * TOKENS, 32])
        x_smem = gl.allocate_shared_memory(gl.float8e4nv, [KBP, TOKENS, 32], nvmma)
        x_smem.reinterpret(gl.float8e4nv, [KBP * TOKENS, 32], nvmma).store(v)
        sl: gl.constexpr = gl.BlockedLayout([1, 1], [32 // TOKENS, TOKENS], [num_warps, 1], [1, 0])
        tok_s = gl.convert_layout(tok, gl.SliceLayout(0, sl))
        kb_s = gl.arange(0, KBP, layout=gl.SliceLayout(1, sl))
        sv = gl.load(xs_ptr + gl.maximum(tok_s, 0)[None, :] * stride_xsm + k_lo // 32 + kb_s[:, None],
                     mask=(tok_s >= 0)[None, :] & (kb_s < nb)[:, None], other=0.0)
        s_smem = gl.allocate_shared_memory(gl.float32, [KBP, TOKENS], flat)
        s_smem.reinterpret(gl.float32, [KBP * TOKENS], flat).store(gl.reshape(sv, [KBP * TOKENS]))
        fence_async_shared()
        _sync()
        return x_smem, s_smem

    @gluon.jit
    def loop(w_e, s_e, stride_wn, stride_sn, stride_sk, n0, k_lo, nb, x_smem, s_smem, TOKENS: gl.constexpr,
             KB: gl.constexpr, STAGES: gl.constexpr, KMAJOR: gl.constexpr, num_warps: gl.constexpr):
        """fp32 sums [64, TOKENS] (:func:`mma_layout`) of weight rows ``n0 ..`` of one expert over the ``nb``
        blocks (a multiple of 4, at most KB) from ``k_lo`` of :func:`fill`'s activations. ``w_e``: the
        expert's fp4_w bytes [N, K / 2]; ``s_e``: its scale bytes as int32 words [N, K / 128], or with
        KMAJOR its scale bytes K major (``stride_sk`` between blocks). Four blocks a trip; STAGES 0: a
        trip's weight bytes loaded where they are used, else through a ring of STAGES trips in shared
        memory."""
        acc_l: gl.constexpr = mma_layout(TOKENS)
        # the A operand's layout, also the weight bytes' [64, 16] a block: a thread's 4 bytes of a row hold the
        # codes of its two operand registers of that row
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
        cols_l: gl.constexpr = gl.SliceLayout(0, acc_l)
        rows_s = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
        if KMAJOR:
            s_src = s_e + rows_s.to(gl.int64) + (k_lo // 32) * stride_sk
        else:
            s_src = s_e + rows_s.to(gl.int64) * stride_sn + k_lo // 128
        zero = gl.zeros([64, TOKENS], gl.float32, acc_l)
        acc = gl.zeros([64, TOKENS], gl.float32, acc_l)
        w_row = w_e + k_lo // 2
        if STAGES == 0:  # each trip's weight bytes loaded into registers where they are decoded
            rows_w = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, a_l))
            cols_w = gl.arange(0, 16, layout=gl.SliceLayout(0, a_l))
            w_src = w_row + rows_w.to(gl.int64)[:, None] * stride_wn + cols_w[None, :]
            for kb in range(0, nb, 4):
                sw = _scale_word(s_src, kb, stride_sk, KMAJOR)
                acc = _trip(gl.load(w_src + kb * 16), gl.load(w_src + kb * 16 + 16), gl.load(w_src + kb * 16 + 32),
                            gl.load(w_src + kb * 16 + 48), sw, x_smem, s_smem, kb, a_l, cols_l, zero, acc)
        else:  # through a ring of STAGES trips in shared memory, filled by asynchronous copies
            cp_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
            rows_c = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, cp_l))
            cols_c = gl.arange(0, 64, layout=gl.SliceLayout(0, cp_l))
            c_src = w_row + rows_c.to(gl.int64)[:, None] * stride_wn + cols_c[None, :]
            # 16-byte chunks swizzled by row pair: a warp's 4-byte reads of 8 rows fall in distinct banks
            ring = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, 64], gl.SwizzledSharedLayout(16, 2, 4, [1, 0]))
            for i in gl.static_range(STAGES - 1):
                _async_load(ring.index(i), c_src + gl.minimum(4 * i, nb - 4) * 16)
                async_copy.commit_group()
            for kb in range(0, nb, 4):
                j = kb // 4
                # the trip STAGES - 1 ahead (the last trips copy the last one again: never read)
                ahead = gl.minimum(kb + 4 * (STAGES - 1), nb - 4)
                _async_load(ring.index((j + STAGES - 1) % STAGES), c_src + ahead * 16)
                async_copy.commit_group()
                sw = _scale_word(s_src, kb, stride_sk, KMAJOR)
                async_copy.wait_group(STAGES - 1)  # this thread's copies of trip j have landed
                _sync()  # and every thread's
                slot = ring.index(j % STAGES)
                acc = _trip(slot.slice(0, 16, dim=1).load(a_l), slot.slice(16, 16, dim=1).load(a_l),
                            slot.slice(32, 16, dim=1).load(a_l), slot.slice(48, 16, dim=1).load(a_l), sw, x_smem,
                            s_smem, kb, a_l, cols_l, zero, acc)
                _sync()  # every warp has read the slot before a later trip's copies refill it
            async_copy.wait_group(0)
        return acc

    @gluon.jit
    def _fp8_operand(byte, a_l: gl.constexpr):
        """A block's E4M3 weight bytes ``[64, 32]`` (a thread's 8 at ``8t``, K in order) -> its A operand in
        ``a_l``: the even bytes at MMA positions ``4t ..``, the odd ones at ``16 + 4t ..``, the order
        :func:`fill` stores the activations in."""
        z = gl.permute(gl.reshape(byte, [64, 4, 4, 2]), [0, 3, 1, 2])  # (r, h, t, j): K 8t + 2j + h
        return gl.convert_layout(gl.reshape(z, [64, 32]).to(gl.float8e4nv, bitcast=True), a_l, assert_trivial=True)

    @gluon.jit
    def loop_fp8(w_e, s_e, stride_wn, stride_st, stride_sk, n0, k_lo, nb, x_smem, s_smem, TOKENS: gl.constexpr,
                 num_warps: gl.constexpr):
        """:func:`loop` over an fp8_w weight (the shared expert): ``w_e`` its E4M3 bytes [N, K], ``s_e`` its
        UE8M0 scale bytes, one a 32-row tile (``stride_st`` apart) and K block (``stride_sk`` apart). The
        bytes are the MMA's operand as they are (no decode); each block's product is scaled by its tile's
        scale times the tokens' (which hold the fp4 decode's 2**6: taken back here). A block a trip, its
        bytes loaded where they are used."""
        acc_l: gl.constexpr = mma_layout(TOKENS)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
        w_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=8)
        cols_l: gl.constexpr = gl.SliceLayout(0, acc_l)
        rows_w = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, w_l))
        cols_w = gl.arange(0, 32, layout=gl.SliceLayout(0, w_l))
        w_src = w_e + k_lo + rows_w.to(gl.int64)[:, None] * stride_wn + cols_w[None, :]
        rows_s = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
        s_src = s_e + (rows_s // 32).to(gl.int64) * stride_st + (k_lo // 32) * stride_sk
        zero = gl.zeros([64, TOKENS], gl.float32, acc_l)
        acc = gl.zeros([64, TOKENS], gl.float32, acc_l)
        for kb in range(0, nb):
            a = _fp8_operand(gl.load(w_src + kb * 32), a_l)
            d = warpgroup_mma(a, x_smem.index(kb).permute((1, 0)), zero, use_acc=False, is_async=True)
            w = (gl.load(s_src + kb * stride_sk).to(gl.int32) << 23).to(gl.float32, bitcast=True)
            w = w * (1.0 / _DECODE_SCALE)
            sc = w[:, None] * s_smem.index(kb).load(cols_l)[None, :]
            d = warpgroup_mma_wait(0, deps=[d])
            acc += d * sc
        return acc

    @gluon.jit
    def _gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, tile_e_ptr, tile_tok_ptr, out_ptr, N, K, stride_xm, stride_xsm,
                     stride_we, stride_wn, stride_se, stride_sn, TOKENS: gl.constexpr, K_SPLIT: gl.constexpr,
                     STAGES: gl.constexpr, num_warps: gl.constexpr):
        """out[split, tile, c, n] = sum over the split's K of x[tok[c], k] * W[e, n, k] (fp32), for weight rows
        n of ``program_id(0)``, token tile ``program_id(1)`` (expert ``tile_e``, tokens ``tile_tok``, -1 none),
        K split ``program_id(2)``. x: E4M3 codes [T, K] with fp32 scales xs [T, K / 32] (times
        DECODE_SCALE); W: fp4_w bytes [E, N, K / 2] with UE8M0 scales read as int32 words
        [E, N, K / 128] (four blocks' bytes a word)."""
        wait_inputs()
        cols_l: gl.constexpr = gl.SliceLayout(0, mma_layout(TOKENS))
        n0 = gl.program_id(0) * 64
        tile = gl.program_id(1)
        k_lo = gl.program_id(2) * K_SPLIT
        e = gl.load(tile_e_ptr + tile).to(gl.int64)
        tok = gl.load(tile_tok_ptr + tile * TOKENS + gl.arange(0, TOKENS, layout=cols_l)).to(gl.int64)
        nb = gl.minimum(K_SPLIT, K - k_lo) // 32
        x_smem, s_smem = fill(x_ptr, xs_ptr, tok, stride_xm, stride_xsm, k_lo, nb, TOKENS, K_SPLIT // 32, num_warps)
        acc = loop(w_ptr + e * stride_we, ws_ptr + e * stride_se, stride_wn, stride_sn, 0, n0, k_lo, nb, x_smem,
                   s_smem, TOKENS, K_SPLIT // 32, STAGES, False, num_warps)
        rows = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma_layout(TOKENS)))
        cols = gl.arange(0, TOKENS, layout=cols_l)
        out = out_ptr + ((gl.program_id(2) * gl.num_programs(1) + tile) * TOKENS + cols.to(gl.int64))[None, :] * N
        gl.store(out + rows[:, None], acc, mask=(rows < N)[:, None] & (tok >= 0)[None, :])  # live lanes only


def experts_gemm(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, tile_e: torch.Tensor,
                 tile_tok: torch.Tensor, k_split: int, stages: int = 4) -> torch.Tensor:
    """fp32 partials ``[splits, tiles, TOKENS, N]`` of each token tile's rows of x times its expert's
    weights (:func:`_gemm_kernel`): x E4M3 ``[T, K]`` with fp32 scales ``xs [T, K / 32]`` (times
    DECODE_SCALE), w fp4_w bytes ``[E, N, K / 2]`` (standard nibbles) with UE8M0 scale bytes
    ``ws [E, N, K / 32]``; ``tile_tok`` int32 ``[tiles, TOKENS]`` (TOKENS 8 or 16), -1 for none (its
    partials are left unwritten); ``k_split`` K a program (a multiple of 128 dividing K); ``stages`` 0:
    the weights loaded where used, else the depth of their ring."""
    E, N, KH = w.shape
    K = 2 * KH
    tiles, tokens = tile_tok.shape
    if stages not in (0, 2, 3, 4, 5, 6):
        raise ValueError(f"experts_gemm: expected stages 0 or 2-6, got {stages}")
    if tokens not in (8, 16):
        raise ValueError(f"experts_gemm: expected 8 or 16 tokens a tile, got {tokens}")
    if N % 64 or k_split % 128 or K % k_split:
        raise ValueError(f"experts_gemm: expected N a multiple of 64, k_split of 128 dividing K, got N {N}, K {K}, "
                         f"k_split {k_split}")
    if ws.shape != (E, N, K // 32) or not ws.is_contiguous():
        raise ValueError(f"experts_gemm: expected contiguous scale bytes {(E, N, K // 32)}, got {tuple(ws.shape)}")
    words = ws.view(torch.int32)
    splits = cdiv(K, k_split)
    out = torch.empty(splits, tiles, tokens, N, dtype=torch.float32, device=x.device)
    _gemm_kernel[(N // 64, tiles, splits)](
        x, xs, w, words, tile_e, tile_tok, out, N, K, x.stride(0), xs.stride(0), w.stride(0), w.stride(1),
        words.stride(0), words.stride(1), TOKENS=tokens, K_SPLIT=k_split, STAGES=stages, num_warps=4,
        **pdl.options(x.device))
    return out
