"""fp4_w expert rows of a prefill chunk on the bf16 warpgroup MMA, the weights decoded into its register
operand with their block scales, the activations' round-trip values streamed beside them (sm_90, Gluon).

:mod:`.experts_qgmma_stream` runs the same tiles on the fp8 MMA, which needs each 32-wide K block's product
scaled by its rows' and tokens' scales in fp32 after the MMA retires: a multiply and an add an accumulator
element a block, more issue slots than the MMA and the decode together. Here the scales go into the
operands instead, where they are exact: an E2M1 code times its block's power of two is a bf16 value
(:func:`.codecs.e2m1_ordered_bf16`'s decode, the scale in its multiply), and an activation's fp8 round
trip (E4M3 times a power of two) is one too, so the MMA sums the same products the fp32 path sums and
nothing is scaled after it.

A program is ``num_warps / 4`` warpgroups over ``16 * num_warps`` weight rows (each the M of ``wgmma
m64nTOKENSk16``); a trip is 128 K: each row's 64 fp4 bytes and the row tile's 128 bf16 values a row,
copied into a ring of ``STAGES`` trips. A thread reads its two rows' 16 bytes at byte ``16t`` (``t``: its
lane in the quad, K block ``t`` of the trip, so one scale a row a trip) and decodes them into the
operand registers of K positions ``32a + 16c + 8g + 2t + h`` (:func:`position`); the activations are stored
in that order (:func:`.round_trip.stream_position`, by the launches that write them), so the weights keep
the layout every other path reads. A trip's two halves of 64 K are two MMAs: the second half decoded while
the first runs, both retired within the trip.
"""
from __future__ import annotations

from flashrt.kernels_cuda.attention_ws import AVAILABLE


def position(k: int) -> int:
    """The MMA position (0-127) of a trip's K ``k`` (0-127): ``k = 32t + 8a + 4c + 2g + h`` (thread ``t``
    of the quad decodes K ``32t ..``) sits at ``32a + 16c + 8g + 2t + h``, the k16 step ``2a + c``, register
    half ``g`` and lane ``t`` of the bf16 MMA's A fragment. Its twin for kernels:
    :func:`.round_trip.stream_position`."""
    t, r = divmod(k, 32)
    return 32 * (r // 8) + 16 * ((r % 8) // 4) + 8 * ((r % 4) // 2) + 2 * t + r % 2


if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

    from flashrt.kernels_cuda.attention_ws import _async_load, _sync
    from flashrt.kernels_cuda.codecs import E2M1_ORDERED_FOLDED_PTX, E2M1_ORDERED_PTX, e8m0_bf16, e8m0_bf16_x2p126
    from flashrt.kernels_cuda.experts_qgmma_stream import weight_copy_layout

    @gluon.constexpr_function
    def acc_layout(TOKENS, num_warps):
        """The accumulators' layout: ``num_warps / 4`` warpgroups' m64nTOKENS bf16 MMA tiles stacked along M."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, TOKENS, 16])

    @gluon.constexpr_function
    def _warp_rows(num_warps, rank):
        """Linear-layout bases of the warps: 16 weight rows each (the M of a warp's share of the MMA)."""
        bases = []
        w = 1
        while w < num_warps:
            bases.append([16 * w] + [0] * (rank - 1))
            w *= 2
        return bases

    @gluon.constexpr_function
    def _lanes(rank):
        """Lane bases: bits 0-1 the quad lane ``t`` (dim 1), bits 2-4 rows 1, 2, 4 (the A fragment's)."""
        z = [0] * (rank - 2)
        return [[0, 1] + z, [0, 2] + z, [1, 0] + z, [2, 0] + z, [4, 0] + z]

    @gluon.constexpr_function
    def row_bytes_layout(num_warps):
        """A trip's weight bytes ``[ROWS, 64]``: lane ``4i + t`` holds bytes ``16t ..`` of rows ``16w + i`` and
        ``16w + i + 8`` (the A fragment's rows), 16 contiguous bytes a row (one 16-byte shared load)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]], lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
            warp_bases=_warp_rows(num_warps, 2), block_bases=[], shape=[16 * num_warps, 64])

    @gluon.constexpr_function
    def trip_layout(num_warps):
        """:func:`row_bytes_layout` seen as ``[ROWS, 4, 2, 8]`` (row, lane ``t``, half, byte)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [8, 0, 0, 0]], lane_bases=_lanes(4),
            warp_bases=_warp_rows(num_warps, 4), block_bases=[], shape=[16 * num_warps, 4, 2, 8])

    @gluon.constexpr_function
    def bytes_layout(num_warps):
        """A half trip's weight bytes ``[ROWS, 4, 8]`` (row, lane ``t``, byte of the lane's eight)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]], lane_bases=_lanes(3),
            warp_bases=_warp_rows(num_warps, 3), block_bases=[], shape=[16 * num_warps, 4, 8])

    @gluon.jit
    def _decode(byte, scale, FOLD: gl.constexpr):
        """bytes [ROWS, 4, 8] (:func:`bytes_layout`) and their bf16 scales (same shape) -> (codes 0-3, codes
        4-7) of each four bytes times their scales (:func:`.codecs.e2m1_ordered_bf16`)."""
        return gl.inline_asm_elementwise(E2M1_ORDERED_FOLDED_PTX if FOLD else E2M1_ORDERED_PTX,
                                         "=r,=r,=r,=r,r,r,r", [byte, scale], dtype=(gl.bfloat16, gl.bfloat16),
                                         is_pure=True, pack=4)

    @gluon.jit
    def _operand(byte, scale, a_l: gl.constexpr, FOLD: gl.constexpr):
        """A half trip's bytes [ROWS, 4, 8] (lane ``t``'s bytes of K ``32t + 16u ..``, ``u`` the half) and their
        scales -> the MMA's A operand [ROWS, 64] in ``a_l``: K ``32t + 16u + 8a + 4c + 2g + h`` at position
        ``32a + 16c + 8g + 2t + h`` of the half (:func:`position`)."""
        ROWS: gl.constexpr = byte.shape[0]
        lo, hi = _decode(byte, scale, FOLD)  # element 4a + j: K 8a + j (lo) and 8a + 4 + j (hi) of the lane's
        z = gl.reshape(gl.join(lo, hi), [ROWS, 4, 2, 2, 2, 2])  # (row, t, a, g, h, c)
        z = gl.permute(z, [0, 2, 5, 3, 1, 4])  # (row, a, c, g, t, h)
        return gl.convert_layout(gl.reshape(z, [ROWS, 64]), a_l, assert_trivial=True)

    @gluon.jit
    def _scales(s_rows, kb, stride_sk, t, KMAJOR: gl.constexpr, FOLD: gl.constexpr):
        """The bf16 scale [ROWS, 4] of each row's K block ``kb + t`` (lane ``t``'s block of the trip): row
        major, from the rows' int32 words of four blocks; KMAJOR, bytes ``stride_sk`` apart. FOLD: times
        2**126 (the decode's re-bias; scale bytes up to 128)."""
        if KMAJOR:
            u = gl.load(s_rows[:, None] + (kb + t)[None, :] * stride_sk).to(gl.int32)
        else:
            u = (gl.load(s_rows + kb // 4)[:, None] >> (8 * t)[None, :]) & 0xFF
        if FOLD:
            scale = e8m0_bf16_x2p126(u)
        else:
            scale = e8m0_bf16(u)
        return scale

    @gluon.jit
    def _copy_trip(w_ring, x_ring, x2_ring, slot, w_src, x_src, x_ok, x2_src, x2_ok, kb, TOKENS2: gl.constexpr):
        """Issue the copies of the trip from K block ``kb`` into ring slot ``slot``: the rows' fp4 bytes and
        the row tile's bf16 values, with TOKENS2 its second part's (lanes past the tile's rows copy
        nothing)."""
        _async_load(w_ring.index(slot), w_src + kb * 16)
        _async_load(x_ring.index(slot), x_src + kb * 32, mask=x_ok)
        if TOKENS2 > 0:
            _async_load(x2_ring.index(slot), x2_src + kb * 32, mask=x2_ok)
        async_copy.commit_group()

    @gluon.jit
    def _x_source(x_ptr, tok, row_ok, stride_xm, TOKENS: gl.constexpr, num_warps: gl.constexpr):
        """Pointers [TOKENS, 128] to a row tile's first trip of x and the mask of the rows it holds."""
        xl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # 256 bytes a row a trip
        tok_x = gl.convert_layout(tok, gl.SliceLayout(1, xl))
        x_ok = gl.convert_layout(row_ok, gl.SliceLayout(1, xl))[:, None]
        x_src = x_ptr + tok_x[:, None] * stride_xm + gl.arange(0, 128, layout=gl.SliceLayout(0, xl))[None, :]
        return x_src, x_ok

    @gluon.jit
    def loop(w_rows, s_rows, stride_sk, x_ptr, tok, row_ok, stride_xm, K, TOKENS: gl.constexpr,
             STAGES: gl.constexpr, KMAJOR: gl.constexpr, FOLD: gl.constexpr, num_warps: gl.constexpr,
             part2=None, TOKENS2: gl.constexpr = 0):
        """fp32 sums [16 * num_warps, TOKENS] (:func:`acc_layout`) over K of fp4_w weight rows times a row
        tile's activations. ``w_rows``: int64-addressed pointers [ROWS] (``SliceLayout(1,
        weight_copy_layout)``) to each row's bytes at K 0 (standard nibbles); ``s_rows``: pointers [ROWS]
        (``SliceLayout(1, SliceLayout(2, bytes_layout))``) to each row's scales (int32 words of four blocks,
        or with KMAJOR bytes ``stride_sk`` apart); x: bf16 values [T, K] in :func:`position` order within each
        trip; ``tok`` (int64 [TOKENS], any layout): the tile's rows of x, ``row_ok`` which lanes hold one.
        K a multiple of 128; STAGES >= 2 trips in the ring; FOLD: every scale byte at most 128.

        TOKENS2 > 0: the row tile has a second part of TOKENS2 rows (``part2``: its rows of x, their mask and
        ``two``), summed by a second, narrower MMA over the same decoded weights where ``two`` (a scalar: the
        part holds a row;
        else its sums are zeros and its MMA and copies skipped: the loop is compiled both ways and the
        program takes one); returns both parts' sums, the second [16 * num_warps, TOKENS2]. One program
        covers up to TOKENS + TOKENS2 rows of an expert with one pass over its weights, where tiles of
        TOKENS + TOKENS2 rows on one MMA would multiply the padding of the experts holding fewer."""
        ROWS: gl.constexpr = 16 * num_warps
        wl: gl.constexpr = weight_copy_layout(num_warps)
        w_src = w_rows[:, None] + gl.arange(0, 64, layout=gl.SliceLayout(0, wl))[None, :]
        x_src, x_ok = _x_source(x_ptr, tok, row_ok, stride_xm, TOKENS, num_warps)
        # 16-byte chunks swizzled by row pair: a warp's 16-byte reads of 8 rows fall in distinct banks
        w_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, 64], gl.SwizzledSharedLayout(16, 2, 4, [1, 0]))
        nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TOKENS, 128], nvmma)
        rings = (w_ring, x_ring, w_src, x_src, x_ok)
        if TOKENS2 > 0:
            tok2, row_ok2, two = part2
            x2_src, x2_ok = _x_source(x_ptr, tok2, row_ok2, stride_xm, TOKENS2, num_warps)
            x2 = (gl.allocate_shared_memory(gl.bfloat16, [STAGES, TOKENS2, 128], nvmma), x2_src, x2_ok)
            if two:
                acc, acc2 = _trips(rings, x2, s_rows, stride_sk, K, TOKENS, STAGES, KMAJOR, FOLD, num_warps, TOKENS2)
            else:
                acc = _trips(rings, x2, s_rows, stride_sk, K, TOKENS, STAGES, KMAJOR, FOLD, num_warps, 0)
                acc2 = gl.zeros([ROWS, TOKENS2], gl.float32, acc_layout(TOKENS2, num_warps))
            result = (acc, acc2)
        else:
            result = _trips(rings, (x_ring, x_src, x_ok), s_rows, stride_sk, K, TOKENS, STAGES, KMAJOR, FOLD,
                            num_warps, 0)  # no second part: its ring and copies unused
        return result

    @gluon.jit
    def _trips(rings, x2, s_rows, stride_sk, K, TOKENS: gl.constexpr, STAGES: gl.constexpr, KMAJOR: gl.constexpr,
               FOLD: gl.constexpr, num_warps: gl.constexpr, TOKENS2: gl.constexpr):
        """:func:`loop`'s trips over K: the sums [ROWS, TOKENS], with TOKENS2 also the second part's
        [ROWS, TOKENS2] (``x2``: its ring, copy sources and row mask) from the same decoded operands."""
        ROWS: gl.constexpr = 16 * num_warps
        acc_l: gl.constexpr = acc_layout(TOKENS, num_warps)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        b3: gl.constexpr = bytes_layout(num_warps)
        rl: gl.constexpr = row_bytes_layout(num_warps)
        t4: gl.constexpr = trip_layout(num_warps)
        w_ring, x_ring, w_src, x_src, x_ok = rings
        x2_ring, x2_src, x2_ok = x2
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, b3)))
        if TOKENS2 > 0:
            acc2_l: gl.constexpr = acc_layout(TOKENS2, num_warps)
            a2_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc2_l, k_width=2)
            acc2 = gl.zeros([ROWS, TOKENS2], gl.float32, acc2_l)
        nb = K // 32
        for i in gl.static_range(STAGES - 1):
            _copy_trip(w_ring, x_ring, x2_ring, i, w_src, x_src, x_ok, x2_src, x2_ok, gl.minimum(4 * i, nb - 4),
                       TOKENS2)
        acc = gl.zeros([ROWS, TOKENS], gl.float32, acc_l)
        s_next = _scales(s_rows, 0, stride_sk, t, KMAJOR, FOLD)
        for kb in range(0, nb, 4):
            j = kb // 4
            # the rows' scales a trip ahead of their use (plain loads: their latency behind this trip)
            s = gl.expand_dims(s_next, 2)
            s_next = _scales(s_rows, gl.minimum(kb + 4, nb - 4), stride_sk, t, KMAJOR, FOLD)
            async_copy.wait_group(STAGES - 2)  # this thread's copies of trip j have landed
            _sync()  # every thread's have, and every warp is done with trip j - 1, whose slot is refilled below
            ahead = gl.minimum(kb + 4 * (STAGES - 1), nb - 4)
            _copy_trip(w_ring, x_ring, x2_ring, (j + STAGES - 1) % STAGES, w_src, x_src, x_ok, x2_src, x2_ok, ahead,
                       TOKENS2)
            slot = j % STAGES
            w = gl.convert_layout(gl.reshape(w_ring.index(slot).load(rl), [ROWS, 4, 2, 8]), t4, assert_trivial=True)
            w0, w1 = gl.split(gl.permute(w, [0, 1, 3, 2]))  # the two halves, each [ROWS, 4, 8]
            w0 = gl.convert_layout(w0, b3, assert_trivial=True)
            w1 = gl.convert_layout(w1, b3, assert_trivial=True)
            x_slot = x_ring.index(slot)
            s0, w0 = gl.broadcast(s, w0)
            a0 = _operand(w0, s0, a_l, FOLD)
            acc = warpgroup_mma(a0, x_slot.slice(0, 64, dim=1).permute((1, 0)), acc, is_async=True)
            if TOKENS2 > 0:
                acc2 = warpgroup_mma(gl.convert_layout(a0, a2_l, assert_trivial=True),
                                     x2_ring.index(slot).slice(0, 64, dim=1).permute((1, 0)), acc2, is_async=True)
            s1, w1 = gl.broadcast(s, w1)
            a1 = _operand(w1, s1, a_l, FOLD)
            acc = warpgroup_mma(a1, x_slot.slice(64, 64, dim=1).permute((1, 0)), acc, is_async=True)
            if TOKENS2 > 0:
                acc2 = warpgroup_mma(gl.convert_layout(a1, a2_l, assert_trivial=True),
                                     x2_ring.index(slot).slice(64, 64, dim=1).permute((1, 0)), acc2, is_async=True)
                acc, acc2 = warpgroup_mma_wait(0, deps=[acc, acc2])
            else:
                acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)
        if TOKENS2 > 0:
            result = (acc, acc2)
        else:
            result = acc
        return result
