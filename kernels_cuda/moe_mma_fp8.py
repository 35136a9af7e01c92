"""The K loop of :mod:`.moe_mma`'s kernels over an ``fp8_w`` expert (the shared expert, whose row tiles
follow the routed ones in the same launches), written in Gluon.

As for the routed fp4_w words, each warp owns 16 weight rows as the M of ``mma.sync`` m16n8k16 (bf16
operands, fp32 accumulation) and the row tile's activation rows are its N. The E4M3 bytes come through a
shared ring of asynchronous copies and are read in the bf16 operand's own layout (8 consecutive K bytes a
thread), so the packed decode (``codecs_e4m3``, four bytes a call, its 2**120 re-bias folded into the bf16
scale) writes each value where the MMA takes it: no permute, and the activations' K in its natural order.
A ring slot holds the same bytes as the fp4 kernels' (``16 * SUB`` K a slot), so the two loops of one
launch ask for the same shared memory. The products are exact in bf16 (a scale byte at most
``codecs_e4m3.FOLD_MAX_SCALE``) and summed in fp32.

``fp8_w`` scales are one UE8M0 byte a 32 x 32 tile: a warp's 16 rows share one a K slice, loaded from
global memory a trip before the slice is used (the trip's wait covers their latency).
"""
from __future__ import annotations

from flashrt.kernels_cuda.attention_ws import AVAILABLE

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from flashrt.kernels_cuda.attention_ws import _async_load, _sync
    from flashrt.kernels_cuda.codecs_e4m3 import e4m3_pairs_bf16, e8m0_bf16_x2p120
    from flashrt.kernels_cuda.gemv_mma import _copy_layout

    @gluon.constexpr_function
    def mma_layout(num_warps):
        """The accumulators' layout: ``mma.sync`` m16n8 tiles, the warps along the weight rows."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])

    @gluon.jit
    def _weights(slot, u: gl.constexpr, scale, a_l: gl.constexpr):
        """K slice ``u`` of a ring slot ([BLOCK_N, 32] of its E4M3 bytes) times the rows' folded scales
        (bf16 [BLOCK_N] in ``SliceLayout(1, a_l)``): the A operand in bf16."""
        byte = slot.slice(32 * u, 32, dim=1).load(a_l)
        return e4m3_pairs_bf16(byte, gl.broadcast(scale[:, None], byte)[0], True)

    @gluon.jit
    def _fill(w1_slot, w3_slot, x_slot, w1_src, w3_src, x_src, k, k_hi, w_rows, cols_w, cols_x, TWO: gl.constexpr):
        """Start the copies of the K slices from ``k`` into a ring slot as one group: the weight bytes (W1,
        and W3 where TWO) and the activation rows; nothing from ``k_hi`` on (K is a multiple of 16, so a
        16-byte copy is all in or out)."""
        _async_load(w1_slot, w1_src + k, mask=w_rows & (k + cols_w < k_hi)[None, :])
        if TWO:
            _async_load(w3_slot, w3_src + k, mask=w_rows & (k + cols_w < k_hi)[None, :])
        _async_load(x_slot, x_src + k, mask=(k + cols_x < k_hi)[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _scale(s_ptr, s_off, s_rows, ks, k_hi, stride_swk):
        """The folded bf16 scales of the K slice from ``ks`` (codes) at rows ``s_off`` (their 32-row
        tiles); byte 0's where the slice is past ``k_hi`` (never used)."""
        u = gl.load(s_ptr + s_off + (ks // 32) * stride_swk, mask=s_rows & (ks < k_hi), other=0)
        return e8m0_bf16_x2p120(u.to(gl.int32))

    @gluon.jit
    def _scales(s1_ptr, s3_ptr, s_off, s_rows, k, k_hi, stride_swk, TWO: gl.constexpr, SUB: gl.constexpr):
        """The folded scales of the (one or two) K slices of the ring slot from ``k``: W1's first and
        second, W3's first and second (repeats where a slot holds one slice or there is no W3)."""
        a1 = _scale(s1_ptr, s_off, s_rows, k, k_hi, stride_swk)
        b1 = a1
        if SUB == 4:
            b1 = _scale(s1_ptr, s_off, s_rows, k + 32, k_hi, stride_swk)
        a3, b3 = a1, b1
        if TWO:
            a3 = _scale(s3_ptr, s_off, s_rows, k, k_hi, stride_swk)
            b3 = a3
            if SUB == 4:
                b3 = _scale(s3_ptr, s_off, s_rows, k + 32, k_hi, stride_swk)
        return a1, b1, a3, b3

    @gluon.jit
    def gemm(x_ptr, tok, stride_xm, w1_ptr, s1_ptr, w3_ptr, s3_ptr, stride_wn, stride_swn, stride_swk, n0, N, k_lo,
             k_hi, TWO: gl.constexpr, TOKENS: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr,
             EVEN: gl.constexpr, num_warps: gl.constexpr):
        """fp32 sums [16 * num_warps, TOKENS] (mma layout) of fp8_w weight rows ``n0 ..`` (W1, and W3 where
        TWO; ``w*_ptr`` at [N, K] E4M3 bytes, ``s*_ptr`` at their UE8M0 tile scales, 32-row-tile stride
        ``stride_swn``, K-slice stride ``stride_swk``) over the activation rows of tokens ``tok`` (in
        ``SliceLayout(1, _copy_layout(16 * SUB, 8, num_warps))``) for K in ``[k_lo, k_hi)``; (the W1 sums,
        the W3 sums or the W1 ones again). SUB is 2 or 4: a slot is ``SUB // 2`` K slices of 32, whose
        scales are loaded a trip ahead."""
        BLOCK_N: gl.constexpr = 16 * num_warps
        SLOT: gl.constexpr = 16 * SUB  # K elements (bytes of a weight row) a ring slot
        mma: gl.constexpr = mma_layout(num_warps)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        wc_l: gl.constexpr = _copy_layout(SLOT, 16, num_warps)
        xc_l: gl.constexpr = _copy_layout(SLOT, 8, num_warps)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        w1_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, SLOT], flat)
        w3_ring = gl.allocate_shared_memory(gl.uint8, [STAGES if TWO else 1, BLOCK_N, SLOT], flat)
        x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TOKENS, SLOT], flat)
        rows_w = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wc_l))
        cols_w = gl.arange(0, SLOT, layout=gl.SliceLayout(0, wc_l))
        w_off = rows_w.to(gl.int64)[:, None] * stride_wn + cols_w[None, :]
        w_rows = ((rows_w < N) | EVEN)[:, None]
        cols_x = gl.arange(0, SLOT, layout=gl.SliceLayout(0, xc_l))
        x_src = x_ptr + gl.convert_layout(tok, gl.SliceLayout(1, xc_l))[:, None] * stride_xm + cols_x[None, :]
        rows_s = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))
        s_off = (rows_s // 32).to(gl.int64) * stride_swn
        s_rows = (rows_s < N) | EVEN
        w1_src, w3_src = w1_ptr + w_off, w3_ptr + w_off
        for i in gl.static_range(STAGES - 1):
            _fill(w1_ring.index(i), w3_ring.index(i if TWO else 0), x_ring.index(i), w1_src, w3_src, x_src,
                  k_lo + SLOT * i, k_hi, w_rows, cols_w, cols_x, TWO)
        a1, b1, a3, b3 = _scales(s1_ptr, s3_ptr, s_off, s_rows, k_lo, k_hi, stride_swk, TWO, SUB)
        acc1 = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)
        acc3 = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)
        for j in range(0, (k_hi - k_lo + SLOT - 1) // SLOT):
            k0 = k_lo + SLOT * j
            ahead = (j + STAGES - 1) % STAGES
            _fill(w1_ring.index(ahead), w3_ring.index(ahead if TWO else 0), x_ring.index(ahead), w1_src, w3_src,
                  x_src, k0 + SLOT * (STAGES - 1), k_hi, w_rows, cols_w, cols_x, TWO)
            n1, m1, n3, m3 = _scales(s1_ptr, s3_ptr, s_off, s_rows, k0 + SLOT, k_hi, stride_swk, TWO, SUB)
            async_copy.wait_group(STAGES - 1)  # this thread's copies of slot j have landed
            _sync()  # and every thread's
            at = j % STAGES
            b = x_ring.index(at).slice(0, 32, dim=1).permute((1, 0)).load(b_l)
            acc1 = mma_v2(_weights(w1_ring.index(at), 0, a1, a_l), b, acc1)
            if TWO:
                acc3 = mma_v2(_weights(w3_ring.index(at), 0, a3, a_l), b, acc3)
            if SUB == 4:
                if k0 + 32 < k_hi:
                    b = x_ring.index(at).slice(32, 32, dim=1).permute((1, 0)).load(b_l)
                    acc1 = mma_v2(_weights(w1_ring.index(at), 1, b1, a_l), b, acc1)
                    if TWO:
                        acc3 = mma_v2(_weights(w3_ring.index(at), 1, b3, a_l), b, acc3)
            a1, b1, a3, b3 = n1, m1, n3, m3
            _sync()  # every warp has read the slot before a later trip's copies refill it
        async_copy.wait_group(0)  # no copy is left in flight when the ring is freed
        return acc1, acc3 if TWO else acc1
