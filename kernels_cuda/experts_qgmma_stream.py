"""fp4_w expert rows of a prefill chunk on the fp8 warpgroup MMA, the weights its register operand, the
activations streamed beside them (sm_90, Gluon); with ``FP8_W`` the same loop over E4M3 weight rows, the
MMA's shared operand as they are (:mod:`.linear_qgmma`).

:mod:`.experts_qgmma` keeps a program's activations in shared memory for its whole K range: a decode
step's 8 or 16 rows an expert, K split over programs whose fp32 partials are summed after. A prefill
chunk's row tiles (32-128 rows of one expert) would need that memory many times over, and a K split
would write fp32 partials the size of the output once a split. Here a program runs the whole K and its
row tile's activations come through the same ring of trips (four K blocks of 32) as its weight bytes:
asynchronous copies of the E4M3 codes of the rows the tile gathers (128 bytes a row a trip, whole
128-byte swizzle rows; each block's 32 bytes are a K slice of the MMA's B operand) and of their block
scales. The codes must arrive in the MMA's order (:func:`mma_position`: what :func:`.experts_qgmma.fill`
does in registers, the producer does when it stores them), so the copies move them as they are.

A program is ``num_warps / 4`` warpgroups over ``16 * num_warps`` weight rows (each warpgroup the M of
``wgmma m64nTOKENSk32``); the rows may come from two matrices (the up launch's W1 and W3 halves).
Each block's product is scaled in fp32 by its rows' and tokens' scales after its MMA retires; a trip's
four MMAs are in flight two at a time (``INFLIGHT`` 2: the older one's sum taken while the newer runs) or
one at a time, all retired within the trip (register operands of MMAs in flight across a loop's back edge
are not kept by ptxas).
One barrier a trip: after it every warp has its trip's copies and is done with the trip before, whose
slot the copies then issued refill.
"""
from __future__ import annotations

from flashrt.kernels_cuda.attention_ws import AVAILABLE

TRIP_BLOCKS = 4  # K blocks of 32 a trip: 128 codes of each row


def mma_position(k: int) -> int:
    """The position within a 32-wide block at which the MMA's operands hold K ``k`` (0-31) of it: the
    decode of a thread's word of eight codes ``8t .. 8t + 7`` fills positions ``4t ..`` with its even codes
    and ``16 + 4t ..`` with its odd ones, so K ``8t + 2j + h`` sits at ``16h + 4t + j``. The kernels that
    store codes in this order call its twin :func:`.round_trip.mma_position`."""
    return 16 * (k % 2) + 4 * (k // 8) + (k % 8) // 2


if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

    from flashrt.kernels_cuda.attention_ws import _async_load, _sync
    from flashrt.kernels_cuda.experts_qgmma import _operand

    @gluon.constexpr_function
    def rows_layout(TOKENS, num_warps, TOKEN_GROUPS=1):
        """The accumulators' layout: ``num_warps / 4`` warpgroups' ``wgmma`` tiles, stacked along M (m64nTOKENS),
        or with TOKEN_GROUPS 2 two warpgroups side by side over the tokens (each m64n(TOKENS / 2), one weight tile
        of 64 rows)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps // TOKEN_GROUPS, TOKEN_GROUPS],
                                         instr_shape=[16, TOKENS // TOKEN_GROUPS, 32])

    @gluon.constexpr_function
    def weight_copy_layout(num_warps, FP8_W=False):
        """A trip's weight bytes ``[16 * num_warps, 64]`` (fp4: four threads a row) or ``[16 * num_warps,
        128]`` (FP8_W: eight threads a row) in 16-byte copies."""
        return gl.BlockedLayout([1, 16], [4, 8] if FP8_W else [8, 4], [num_warps, 1], [1, 0])

    @gluon.jit
    def _scale_bytes(s_rows, kb, stride_sk, KMAJOR: gl.constexpr):
        """The rows' scale bytes of blocks ``kb .. kb + 3`` (int32 each, the byte in bits 0-7, higher bits
        ignored): K major, four loads ``stride_sk`` apart; else one int32 word of four blocks (the layouts
        :func:`.experts_qgmma._scale_word` reads)."""
        if KMAJOR:
            b = s_rows + kb * stride_sk
            s0 = gl.load(b).to(gl.int32)
            s1 = gl.load(b + stride_sk).to(gl.int32)
            s2 = gl.load(b + 2 * stride_sk).to(gl.int32)
            s3 = gl.load(b + 3 * stride_sk).to(gl.int32)
        else:
            s0 = gl.load(s_rows + kb // 4)
            s1 = s0 >> 8
            s2 = s0 >> 16
            s3 = s0 >> 24
        return s0, s1, s2, s3

    @gluon.jit
    def _promote(acc, d, w_byte, s_row):
        """``acc`` plus a retired block product ``d`` times its rows' UE8M0 scales (``w_byte``, bits 0-7 of
        an int32 a row) and its tokens' scales (``s_row``, fp32 [TOKENS] in the columns' layout)."""
        w = ((w_byte & 0xFF) << 23).to(gl.float32, bitcast=True)
        return acc + d * (w[:, None] * s_row[None, :])

    @gluon.jit
    def _mma(w_slot, x_slot, u: gl.constexpr, a_l: gl.constexpr, zero, FP8_W: gl.constexpr):
        """Start block ``u``'s MMA of a trip: E4M3 weights straight from shared memory (FP8_W), else the fp4
        bytes decoded into the register operand."""
        if FP8_W:
            a = w_slot.slice(32 * u, 32, dim=1)
        else:
            a = _operand(w_slot.slice(16 * u, 16, dim=1).load(a_l), a_l)
        return warpgroup_mma(a, x_slot.slice(32 * u, 32, dim=1).permute((1, 0)), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _trip(w_slot, x_slot, s_flat, s0, sw, a_l: gl.constexpr, cols_l: gl.constexpr, zero, acc,
              FP8_W: gl.constexpr, INFLIGHT: gl.constexpr):
        """A trip's four blocks into ``acc``: weights ``w_slot`` ([ROWS, 64] fp4 bytes, or [ROWS, 128] E4M3
        with FP8_W), activation codes ``x_slot`` [TOKENS, 128] (block ``u`` in bytes ``32u ..``), token
        scales rows ``s0 + u`` of ``s_flat``, the rows' scale bytes ``sw`` (:func:`_scale_bytes`). INFLIGHT
        2: two MMAs in flight, the older one's product scaled and summed while the newer runs; 1: each
        waited for where it is issued (one product's registers fewer)."""
        if INFLIGHT == 1:
            for u in gl.static_range(4):
                d = warpgroup_mma_wait(0, deps=[_mma(w_slot, x_slot, u, a_l, zero, FP8_W)])
                acc = _promote(acc, d, sw[u], s_flat.index(s0 + u).load(cols_l))
        else:
            d0 = _mma(w_slot, x_slot, 0, a_l, zero, FP8_W)
            d1 = _mma(w_slot, x_slot, 1, a_l, zero, FP8_W)
            d0 = warpgroup_mma_wait(1, deps=[d0])
            acc = _promote(acc, d0, sw[0], s_flat.index(s0 + 0).load(cols_l))
            d2 = _mma(w_slot, x_slot, 2, a_l, zero, FP8_W)
            d1 = warpgroup_mma_wait(1, deps=[d1])
            acc = _promote(acc, d1, sw[1], s_flat.index(s0 + 1).load(cols_l))
            d3 = _mma(w_slot, x_slot, 3, a_l, zero, FP8_W)
            d2 = warpgroup_mma_wait(1, deps=[d2])
            acc = _promote(acc, d2, sw[2], s_flat.index(s0 + 2).load(cols_l))
            d3 = warpgroup_mma_wait(0, deps=[d3])
            acc = _promote(acc, d3, sw[3], s_flat.index(s0 + 3).load(cols_l))
        return acc

    @gluon.jit
    def _copy_trip(w_ring, x_ring, s_ring, slot, w_src, x_src, s_src, x_ok, s_ok, kb, FP8_W: gl.constexpr):
        """Issue the copies of the trip from block ``kb`` into ring slot ``slot``: weight bytes, activation
        codes, token scales (lanes past the tile's rows copy nothing: zeros, never stored)."""
        _async_load(w_ring.index(slot), w_src + kb * (32 if FP8_W else 16))
        _async_load(x_ring.index(slot), x_src + kb * 32, mask=x_ok)
        _async_load(s_ring.index(slot), s_src + kb, mask=s_ok)
        async_copy.commit_group()

    @gluon.jit
    def loop(w_rows, s_rows, stride_sk, x_ptr, xs_ptr, tok, row_ok, stride_xm, stride_xsm, K,
             TOKENS: gl.constexpr, STAGES: gl.constexpr, KMAJOR: gl.constexpr, num_warps: gl.constexpr,
             FP8_W: gl.constexpr = False, INFLIGHT: gl.constexpr = 2, TOKEN_GROUPS: gl.constexpr = 1):
        """fp32 sums [16 * num_warps, TOKENS] (:func:`rows_layout`) over K of weight rows times a row tile's
        activations. ``w_rows``: int64-addressed pointers [ROWS] (``SliceLayout(1, weight_copy_layout)``)
        to each row's fp4_w bytes at K 0 (standard nibbles; the activations then in the MMA's order), or
        with FP8_W its E4M3 bytes (the MMA's shared operand as they are; the activations in K order), one
        UE8M0 scale a row and K block either way (an fp8_w tile's rows share theirs); ``s_rows``: pointers
        [ROWS] (``SliceLayout(1, rows_layout)``) to each row's scales (:func:`_scale_bytes`: int32 words of
        four blocks, or with KMAJOR bytes ``stride_sk`` apart); x: E4M3 codes [T, K] in the
        MMA's order within each block with fp32 scales xs [T, K / 32]; ``tok`` (int64 [TOKENS], any layout):
        the tile's rows of x, ``row_ok`` which lanes hold one. K a multiple of 128; STAGES >= 2 trips in the
        ring; INFLIGHT block MMAs in flight (:func:`_trip`); TOKEN_GROUPS 2: the warpgroups split the tokens, not
        the rows (:func:`rows_layout`; ``16 * num_warps / 2`` rows)."""
        ROWS: gl.constexpr = 16 * num_warps // TOKEN_GROUPS
        acc_l: gl.constexpr = rows_layout(TOKENS, num_warps, TOKEN_GROUPS)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
        cols_l: gl.constexpr = gl.SliceLayout(0, acc_l)
        wl: gl.constexpr = weight_copy_layout(num_warps, FP8_W)
        xl: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])  # 128 bytes a row a trip
        sl: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])  # [4, TOKENS] fp32
        w_src = w_rows[:, None] + gl.arange(0, 128 if FP8_W else 64, layout=gl.SliceLayout(0, wl))[None, :]
        tok_x = gl.convert_layout(tok, gl.SliceLayout(1, xl))
        x_ok = gl.convert_layout(row_ok, gl.SliceLayout(1, xl))[:, None]
        x_src = x_ptr + tok_x[:, None] * stride_xm + gl.arange(0, 128, layout=gl.SliceLayout(0, xl))[None, :]
        tok_s = gl.convert_layout(tok, gl.SliceLayout(0, sl))
        s_ok = gl.convert_layout(row_ok, gl.SliceLayout(0, sl))[None, :]
        s_src = xs_ptr + tok_s[None, :] * stride_xsm + gl.arange(0, 4, layout=gl.SliceLayout(1, sl))[:, None]
        nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        if FP8_W:  # the MMA's A operand: 128-byte swizzled rows
            w_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, ROWS, 128], nvmma)
        else:  # 16-byte chunks swizzled by row pair: a warp's 4-byte reads of 8 rows fall in distinct banks
            w_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 64], gl.SwizzledSharedLayout(16, 2, 4, [1, 0]))
        x_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TOKENS, 128], nvmma)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        s_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 4, TOKENS], flat)
        # a block's scales a row (a layout one rank short of the shape: index gives the row)
        s_flat = s_ring.reinterpret(gl.float32, [STAGES * 4, TOKENS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        nb = K // 32
        for i in gl.static_range(STAGES - 1):
            _copy_trip(w_ring, x_ring, s_ring, i, w_src, x_src, s_src, x_ok, s_ok, gl.minimum(4 * i, nb - 4), FP8_W)
        zero = gl.zeros([ROWS, TOKENS], gl.float32, acc_l)
        acc = gl.zeros([ROWS, TOKENS], gl.float32, acc_l)
        sw_next = _scale_bytes(s_rows, 0, stride_sk, KMAJOR)
        for kb in range(0, nb, 4):
            j = kb // 4
            # the rows' scales a trip ahead of their use (plain loads: their latency behind this trip)
            sw = sw_next
            sw_next = _scale_bytes(s_rows, gl.minimum(kb + 4, nb - 4), stride_sk, KMAJOR)
            async_copy.wait_group(STAGES - 2)  # this thread's copies of trip j have landed
            # every thread's have, and every warp is done with trip j - 1, whose slot the copies below refill
            _sync()
            # the trip STAGES - 1 ahead (the last trips copy the last one again: never read)
            ahead = gl.minimum(kb + 4 * (STAGES - 1), nb - 4)
            _copy_trip(w_ring, x_ring, s_ring, (j + STAGES - 1) % STAGES, w_src, x_src, s_src, x_ok, s_ok, ahead,
                       FP8_W)
            slot = j % STAGES
            acc = _trip(w_ring.index(slot), x_ring.index(slot), s_flat, slot * 4, sw, a_l, cols_l, zero, acc, FP8_W,
                        INFLIGHT)
        async_copy.wait_group(0)
        return acc
