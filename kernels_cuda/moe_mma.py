"""``moe_experts``' routed fp4_w experts at a few rows an expert on the tensor cores, the weights as the
MMA's M side (sm_80+, written in Gluon): the experts rule knob ``gemv_mma``.

The 16-row MMA tile of :mod:`.moe_kernels` is bound by its instructions at decode (the fp4 decode and
the moves around its ``tl.dot``), and 15 of its 16 rows do nothing at one token. Here, as in
:mod:`.gemv_mma`, each warp owns 16 weight rows as the M of ``mma.sync`` m16n8k16 (bf16 operands, fp32
accumulation) and a row tile's activation rows (up to ``TOKENS``: one expert's pair rows) are its N.
The weights come through a shared ring of asynchronous copies and are read in the 8-bit MMA operand's
layout, so each thread holds whole 32-bit words of eight E2M1 codes (the word layout,
:mod:`flashrt.e2m1_words`) of its two rows; the packed word decode (``codecs_words``, its re-bias
folded into the bf16 block scale) writes them straight into the bf16 operand registers, the codes in
element order (two a register), so the activations are taken in their own K order. One MMA
instruction covers 256 weight codes.

The activations arrive as the bf16 values of their fp8 round trip (``tiles.moe.act_dequantized``): x by
one launch before, h as the up kernel stores it. The products are exact and summed in fp32, as the 16-row
tile sums them.

- ``_up_kernel``: W1 and W3 rows ``[n0, n0 + 16 * num_warps)`` of the tile's expert over x, then the
  SwiGLU of the full sums (gate and up rounded to x.dtype, clamped, times the routing weight, rounded)
  and h's fp8 round trip per 32 columns, stored as bf16 values in pair-row order;
- ``_down_kernel``: W2 over h, each pair row's output rounded to x.dtype; where the counters fit, the
  program that stores a token's last row (a ticket per token and column tile) then sums its rows in slot
  order and adds its ``add`` row, as the combine kernel of :mod:`.moe_kernels` would.

A K split meets in the tile's last program (the tickets of :mod:`.splitk`, partials summed in split
order: deterministic).
"""
from __future__ import annotations

import math

import torch

from flashrt.kernels_cuda import pdl, splitk
from flashrt.kernels_cuda.attention_ws import AVAILABLE
from flashrt.kernels_cuda.gemv_mma import MIN_SLICES, ROWS_A_WARP, operand_kw
from flashrt.kernels_cuda.codecs_e4m3 import FOLD_MAX_SCALE as FP8_FOLD_MAX_SCALE
from flashrt.kernels_cuda.launch import TL_DTYPES, cdiv
from flashrt.kernels_cuda.linear import scales_at_most

KW = 8  # consecutive K elements a thread in the bf16 operands: one word of eight codes (Triton <= 3.6 takes it)

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from flashrt.kernels_cuda.attention_ws import _async_load, _sync
    from flashrt.kernels_cuda.codecs import e8m0_bf16_x2p126, to_out
    from flashrt.kernels_cuda.codecs_words import e2m1_words_bf16
    from flashrt.kernels_cuda.gemv_mma import _copy_layout, block_exp
    from flashrt.kernels_cuda.moe_mma_fp8 import gemm as gemm_fp8
    from flashrt.kernels_cuda.moe_mma_fp8 import mma_layout as _mma_layout
    from flashrt.kernels_cuda.pdl import wait_inputs


    @gluon.jit
    def _origin(BLOCK_N: gl.constexpr, k_split, kb_split):
        """(first weight row, first K code, first K byte of a weight row) of this program."""
        split = gl.program_id(2)
        return gl.program_id(0) * BLOCK_N, split * k_split, split * kb_split

    @gluon.jit
    def _tile_rows(tables, PAIRS: gl.constexpr, SHARED: gl.constexpr, TOKENS: gl.constexpr, layout,
                   FIRST: gl.constexpr = 0):
        """(rows [TOKENS] in ``layout``, row mask, token of each row int64) of row tile ``program_id(1)``:
        PAIRS, pair ``t`` alone (token ``t // TOPK``); else the routing tables' tile; SHARED, the tiles from
        ``routed_tiles`` on: the shared expert's rows ``n_pairs + token``, TOKENS tokens a tile. Lanes past
        the tile read its last row's token (never stored). ``tables``: (tok, tile_row, row_end pointers,
        TOPK, routed_tiles, n_pairs, n_rows). FIRST: the tile's rows from its FIRST-th on (a tile's second
        part, routed tiles only)."""
        tok_ptr, tile_row_ptr, row_end_ptr, TOPK, routed_tiles, n_pairs, n_rows = tables
        t = gl.program_id(1)
        lanes = gl.arange(0, TOKENS, layout=layout)
        if PAIRS:
            row0 = t
            end = t + 1
        else:
            routed = t < routed_tiles
            row0 = gl.load(tile_row_ptr + t, mask=routed, other=0)
            end = gl.load(row_end_ptr + t, mask=routed, other=1)
        if SHARED:
            shared = t >= routed_tiles
            row0 = gl.where(shared, n_pairs + (t - routed_tiles) * TOKENS, row0)
            end = gl.where(shared, n_rows, end)
        rows = row0 + FIRST + lanes
        last = gl.minimum(rows, end - 1)
        if PAIRS:
            tok = last // TOPK
        else:
            tok = gl.load(tok_ptr + last, mask=last < n_pairs, other=0)
        if SHARED:
            tok = gl.where(last >= n_pairs, last - n_pairs, tok)
        return rows, rows < end, tok.to(gl.int64)

    @gluon.jit
    def _weights(slot, u: gl.constexpr, scale, a8: gl.constexpr, a_l: gl.constexpr, BLOCK_N: gl.constexpr):
        """K slice ``u`` of a weight ring slot ([BLOCK_N, 16] bytes of E2M1 words) times its rows' folded
        scales (bf16 [BLOCK_N] in ``SliceLayout(1, a8)``): the A operand in bf16, in K order."""
        byte = slot.slice(16 * u, 16, dim=1).load(a8)
        first, second = e2m1_words_bf16(byte, gl.broadcast(scale[:, None], byte)[0], True)
        # first[r, 4w + i] / second[r, 4w + i]: code i / 4 + i of word w; relabelled into element order
        a = gl.permute(gl.reshape(gl.join(first, second), [BLOCK_N, 4, 4, 2]), [0, 1, 3, 2])
        return gl.convert_layout(gl.reshape(a, [BLOCK_N, 32]), a_l, assert_trivial=True)

    @gluon.jit
    def _activations(slot, u: gl.constexpr, b_l: gl.constexpr):
        """K slice ``u`` of an activation ring slot ([TOKENS, 32 * SUB] bf16) as the B operand [32, TOKENS]."""
        return slot.slice(32 * u, 32, dim=1).permute((1, 0)).load(b_l)

    @gluon.jit
    def _copy(w_slot, w_src, kb, kb_hi, w_rows, w_cols):
        """The weight bytes from byte ``kb`` of each row (K slices of 16 bytes) into a ring slot; none from
        ``kb_hi`` on. Byte offsets are passed as such (not halved codes) so that the compiler sees them
        divisible by 16: whole 16-byte copies."""
        _async_load(w_slot, w_src + kb, mask=w_rows & (kb + w_cols < kb_hi)[None, :])

    @gluon.jit
    def _scales(ring, at, src, k, k_hi, stride_swk, rows_ok, SUB: gl.constexpr):
        """The K-major scale bytes of the ``SUB`` slices from ``k`` (codes) into ring slot ``at`` (its runs
        ``at * SUB ..``); none from ``k_hi`` on."""
        for u in gl.static_range(SUB):
            _async_load(ring.index(at * SUB + u), src + (k // 32 + u) * stride_swk, mask=rows_ok & (k + 32 * u < k_hi))

    @gluon.jit
    def _fill(rings, srcs, masks, at, k, kb, k_hi, kb_hi, stride_swk, TWO: gl.constexpr, KMAJOR: gl.constexpr,
              SUB: gl.constexpr):
        """Start the copies of the K slices from ``k`` (codes; byte ``kb`` of a weight row) into ring slot
        ``at`` as one group: the weight bytes (W1, and W3 where TWO), the activation rows and, where KMAJOR,
        the scale bytes. ``rings``: (W1, W3, activations, W1 scales, W3 scales) rings; ``srcs``: their
        sources at the run's start; ``masks``: (weight rows, weight byte columns, activation columns, scale
        rows)."""
        w1_ring, w3_ring, x_ring, s1_ring, s3_ring = rings
        w1_src, w3_src, x_src, s1_src, s3_src = srcs
        w_rows, cols_w, cols_x, sc_rows = masks
        _copy(w1_ring.index(at), w1_src, kb, kb_hi, w_rows, cols_w)
        if TWO:
            _copy(w3_ring.index(at), w3_src, kb, kb_hi, w_rows, cols_w)
        _async_load(x_ring.index(at), x_src + k, mask=(k + cols_x < k_hi)[None, :])
        if KMAJOR:
            _scales(s1_ring, at, s1_src, k, k_hi, stride_swk, sc_rows, SUB)
            if TWO:
                _scales(s3_ring, at, s3_src, k, k_hi, stride_swk, sc_rows, SUB)
        async_copy.commit_group()

    @gluon.jit
    def _gemm(x_ptr, tok, stride_xm, w1_ptr, s1_ptr, w3_ptr, s3_ptr, stride_wn, stride_swn, stride_swk, n0, N, k_lo,
              k_hi, kb_lo, kb_hi, TWO: gl.constexpr, TOKENS: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr,
              EVEN: gl.constexpr, EVEN_K: gl.constexpr, KMAJOR: gl.constexpr, num_warps: gl.constexpr):
        """fp32 sums [16 * num_warps, TOKENS] (mma layout) of weight rows ``n0 ..`` (W1, and W3 where TWO;
        ``w*_ptr`` / ``s*_ptr`` at the expert's data and scales) over the activation rows of tokens ``tok``
        for K in ``[k_lo, k_hi)``; (the W1 sums, the W3 sums or the W1 ones again). KMAJOR: the scales are
        K major (row stride 1), so a slot's scale bytes, ``SUB`` runs of ``16 * num_warps`` rows, come
        through the ring with the weights (a load where each slice is used would wait for memory every
        trip); else they are loaded where each slice is used."""
        BLOCK_N: gl.constexpr = 16 * num_warps
        SLOT: gl.constexpr = 32 * SUB  # K elements a ring slot
        mma: gl.constexpr = _mma_layout(num_warps)
        a8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        wc_l: gl.constexpr = _copy_layout(SLOT // 2, 16, num_warps)
        xc_l: gl.constexpr = _copy_layout(SLOT, 8, num_warps)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        w1_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, SLOT // 2], flat)
        w3_ring = gl.allocate_shared_memory(gl.uint8, [STAGES if TWO else 1, BLOCK_N, SLOT // 2], flat)
        x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TOKENS, SLOT], flat)
        rows_w = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wc_l))
        cols_w = gl.arange(0, SLOT // 2, layout=gl.SliceLayout(0, wc_l))
        w_off = rows_w.to(gl.int64)[:, None] * stride_wn + cols_w[None, :]
        w_rows = ((rows_w < N) | EVEN)[:, None]
        cols_x = gl.arange(0, SLOT, layout=gl.SliceLayout(0, xc_l))
        x_src = x_ptr + gl.convert_layout(tok, gl.SliceLayout(1, xc_l))[:, None] * stride_xm + cols_x[None, :]
        rows_s = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a8))
        s_off = rows_s.to(gl.int64) * stride_swn
        s_rows = (rows_s < N) | EVEN
        # the scale bytes' ring: a run of BLOCK_N rows a slice, SUB runs a slot (N is a multiple of 32, so a
        # 16-byte copy is all in or out)
        sc_l: gl.constexpr = gl.BlockedLayout([16], [32], [num_warps], [0])
        line: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        s1_ring = gl.allocate_shared_memory(gl.uint8, [STAGES * SUB if KMAJOR else 1, BLOCK_N], line)
        s3_ring = gl.allocate_shared_memory(gl.uint8, [STAGES * SUB if KMAJOR and TWO else 1, BLOCK_N], line)
        rows_c = n0 + gl.arange(0, BLOCK_N, layout=sc_l)
        sc_rows = (rows_c < N) | EVEN

        rings = (w1_ring, w3_ring, x_ring, s1_ring, s3_ring)
        srcs = (w1_ptr + w_off, w3_ptr + w_off, x_src, s1_ptr + rows_c, s3_ptr + rows_c)
        masks = (w_rows, cols_w, cols_x, sc_rows)
        for i in gl.static_range(STAGES - 1):
            _fill(rings, srcs, masks, i, k_lo + SLOT * i, kb_lo + SLOT // 2 * i, k_hi, kb_hi, stride_swk, TWO, KMAJOR,
                  SUB)
        acc1 = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)
        acc3 = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)
        for j in range(0, (k_hi - k_lo + SLOT - 1) // SLOT):
            k0 = k_lo + SLOT * j
            _fill(rings, srcs, masks, (j + STAGES - 1) % STAGES, k0 + SLOT * (STAGES - 1),
                  kb_lo + SLOT // 2 * (j + STAGES - 1), k_hi, kb_hi, stride_swk, TWO, KMAJOR, SUB)
            async_copy.wait_group(STAGES - 1)  # this thread's copies of slot j have landed
            _sync()  # and every thread's
            at = j % STAGES
            for u in gl.static_range(SUB):
                ks = k0 + 32 * u
                if EVEN_K or ks < k_hi:
                    b = _activations(x_ring.index(at), u, b_l)
                    if KMAJOR:
                        s = s1_ring.index(at * SUB + u).load(gl.SliceLayout(1, a8)).to(gl.int32)
                    else:
                        s = gl.load(s1_ptr + s_off + (ks // 32) * stride_swk, mask=s_rows, other=0).to(gl.int32)
                    acc1 = mma_v2(_weights(w1_ring.index(at), u, e8m0_bf16_x2p126(s), a8, a_l, BLOCK_N), b, acc1)
                    if TWO:
                        if KMAJOR:
                            s = s3_ring.index(at * SUB + u).load(gl.SliceLayout(1, a8)).to(gl.int32)
                        else:
                            s = gl.load(s3_ptr + s_off + (ks // 32) * stride_swk, mask=s_rows, other=0).to(gl.int32)
                        acc3 = mma_v2(_weights(w3_ring.index(at), u, e8m0_bf16_x2p126(s), a8, a_l, BLOCK_N), b,
                                      acc3)
            _sync()  # every warp has read the slot before a later trip's copies refill it
        async_copy.wait_group(0)  # no copy is left in flight when the ring is freed
        return acc1, acc3 if TWO else acc1

    @gluon.jit
    def _last_of_split(part, ok, plane, cnt_ptr, n_splits, acc):
        """Store this split's partial ``acc`` at ``part`` (split ``program_id(2)``, splits ``plane`` apart)
        and draw the tile's ticket: (whether this program drew the last one, the tile's counter)."""
        gl.store(part + gl.program_id(2).to(gl.int64) * plane, acc, mask=ok)
        _sync()  # every thread's partial is stored before the ticket publishes them
        tile = cnt_ptr + gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        last = gl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == n_splits - 1
        return last, tile

    @gluon.jit
    def up_split(g, u, ws_ptr, cnt_ptr, rows, row_ok, cols, I, n_rows, n_splits, layout: gl.constexpr,
                 BLOCK_N: gl.constexpr, TOKENS: gl.constexpr):
        """An up program's gate / up partials ``g``, ``u`` ([BLOCK_N, TOKENS] in ``layout``, rows ``rows`` at
        columns ``cols`` of I) stored at ``ws_ptr`` ([splits, 2, n_rows, I] fp32) and the (row tile, column
        tile) ticket drawn: (whether this program drew the last one, the tile's counter, and where it did the
        full sums of every split, else ``g``, ``u``)."""
        ok = (cols < I)[:, None] & row_ok[None, :]
        plane = n_rows * I  # one [n_rows, I] partial
        part = ws_ptr + rows.to(gl.int64)[None, :] * I + cols[:, None]
        gl.store(part + (gl.program_id(2).to(gl.int64) * 2 + 1) * plane, u, mask=ok)
        last, tile = _last_of_split(part, ok, 2 * plane, cnt_ptr, n_splits, g)
        if last:
            g = _split_sum(part, ok, 2 * plane, n_splits, layout, BLOCK_N, TOKENS)
            u = _split_sum(part + plane, ok, 2 * plane, n_splits, layout, BLOCK_N, TOKENS)
        return last, tile, g, u

    @gluon.jit
    def _split_sum(part, ok, plane, n_splits, layout: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr):
        """The partials at ``part`` summed in split order (read past L1: other programs wrote them)."""
        total = gl.zeros([BLOCK_N, TOKENS], gl.float32, layout)
        for s in range(n_splits):
            total += gl.load(part + s * plane, mask=ok, other=0.0, cache_modifier=".cg")
        return total

    @gluon.jit
    def _up_kernel(x_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                   h_ptr, ws_ptr, cnt_ptr, E, I, D, D_BYTES, limit, n_rows, n_pairs, TOPK, k_split, kb_split, n_splits,
                   stride_xm, stride_we, stride_wn, stride_se, stride_swn, stride_swk, stride_hm,
                   sw1_ptr, ss1_ptr, sw3_ptr, ss3_ptr, stride_s_wn, stride_s_swn, stride_s_swk, routed_tiles,
                   TOKENS: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr, PAIRS: gl.constexpr,
                   SPLIT: gl.constexpr, CLAMP: gl.constexpr, XDT: gl.constexpr, EVEN: gl.constexpr,
                   EVEN_K: gl.constexpr, KMAJOR: gl.constexpr, SHARED: gl.constexpr, num_warps: gl.constexpr):
        """h rows of the tile's pairs, columns ``[n0, n0 + 16 * num_warps)`` of I: x [N, D] bf16 (the
        fp8 round trip's values), W1 / W3 [E, I, D / 2] E2M1 words with UE8M0 scales (row stride
        ``stride_swn``, K-slice stride ``stride_swk``), h [n_rows, I] bf16. SHARED: the row tiles from
        ``routed_tiles`` on are the shared expert's (fp8_w [I, D] at ``sw*_ptr``, tile scales at ``ss*_ptr``;
        :mod:`.moe_mma_fp8`), its rows ``n_pairs + token``. SPLIT: ws [splits, 2, n_rows, I] fp32 gate / up
        partials and a ticket counter per (row tile, column tile)."""
        wait_inputs()
        BLOCK_N: gl.constexpr = 16 * num_warps
        mma: gl.constexpr = _mma_layout(num_warps)
        t = gl.program_id(1)
        e = gl.load(tile_e_ptr + t, mask=t < routed_tiles, other=0)
        if e >= E:  # past the tables' last tile
            return
        n0, k_lo, kb_lo = _origin(BLOCK_N, k_split, kb_split)
        xc_l: gl.constexpr = _copy_layout(32 * SUB, 8, num_warps)
        tables = (tok_ptr, tile_row_ptr, row_end_ptr, TOPK, routed_tiles, n_pairs, n_rows)
        _, _, tok = _tile_rows(tables, PAIRS, SHARED, TOKENS, gl.SliceLayout(1, xc_l))
        k_hi = gl.minimum(k_lo + k_split, D)
        if (t >= routed_tiles) if SHARED else False:
            g, u = gemm_fp8(x_ptr, tok, stride_xm, sw1_ptr, ss1_ptr, sw3_ptr, ss3_ptr, stride_s_wn, stride_s_swn,
                            stride_s_swk, n0, I, k_lo, k_hi, True, TOKENS, STAGES, SUB, EVEN, num_warps)
        else:
            ew = e.to(gl.int64) * stride_we
            es = e.to(gl.int64) * stride_se
            g, u = _gemm(x_ptr, tok, stride_xm, w1_ptr + ew, s1_ptr + es, w3_ptr + ew, s3_ptr + es, stride_wn,
                         stride_swn, stride_swk, n0, I, k_lo, k_hi, kb_lo, gl.minimum(kb_lo + kb_split, D_BYTES), True,
                         TOKENS, STAGES, SUB, EVEN, EVEN_K, KMAJOR, num_warps)
        stage = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, TOKENS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        if SPLIT:
            rows, row_ok, _ = _tile_rows(tables, PAIRS, SHARED, TOKENS, gl.SliceLayout(0, mma))
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
            last, tile, g, u = up_split(g, u, ws_ptr, cnt_ptr, rows, row_ok, cols, I, n_rows, n_splits, mma, BLOCK_N,
                                        TOKENS)
            if last:
                _up_finish(g, u, stage, tables, rw_ptr, h_ptr, n0, I, limit, stride_hm, PAIRS, SHARED, TOKENS, CLAMP,
                           XDT, num_warps)
                gl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")
        else:
            _up_finish(g, u, stage, tables, rw_ptr, h_ptr, n0, I, limit, stride_hm, PAIRS, SHARED, TOKENS, CLAMP, XDT,
                       num_warps)

    @gluon.jit
    def swiglu_blocks(g, u, stage, tables, rw_ptr, limit, PAIRS: gl.constexpr, SHARED: gl.constexpr,
                      TOKENS: gl.constexpr, CLAMP: gl.constexpr, XDT: gl.constexpr, BLOCK_N: gl.constexpr,
                      blocks: gl.constexpr):
        """The SwiGLU of the full gate / up sums ([BLOCK_N, TOKENS], any layout) as the 16-row tile's epilogue
        computes it, through shared memory (``stage`` [2, BLOCK_N, TOKENS] fp32) into ``blocks`` (a layout of
        [BLOCK_N / 32, 32, TOKENS] whose 32-column blocks lie along a warp's lanes): (h fp32, each block's
        fp8 scale exponent and its reciprocal [BLOCK_N / 32, TOKENS], the tile's rows and their mask)."""
        stage.index(0).store(g)
        stage.index(1).store(u)
        _sync()
        return swiglu_staged(stage, tables, rw_ptr, limit, PAIRS, SHARED, TOKENS, CLAMP, XDT, BLOCK_N, blocks)

    @gluon.jit
    def swiglu_staged(stage, tables, rw_ptr, limit, PAIRS: gl.constexpr, SHARED: gl.constexpr, TOKENS: gl.constexpr,
                      CLAMP: gl.constexpr, XDT: gl.constexpr, BLOCK_N: gl.constexpr, blocks: gl.constexpr,
                      FIRST: gl.constexpr = 0):
        """:func:`swiglu_blocks` from the gate / up sums already in ``stage`` (every thread's stores behind a
        barrier) of the tile's rows from its FIRST-th on (:func:`_tile_rows`)."""
        g = stage.index(0).reshape([BLOCK_N // 32, 32, TOKENS]).load(blocks)
        u = stage.index(1).reshape([BLOCK_N // 32, 32, TOKENS]).load(blocks)
        lane_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, blocks))
        rows, row_ok, _ = _tile_rows(tables, PAIRS, SHARED, TOKENS, lane_l, FIRST)
        rw = gl.load(rw_ptr + rows, mask=row_ok & (rows < tables[5]), other=1.0)  # the shared rows' weight: 1
        g = to_out(g, XDT).to(gl.float32)
        u = to_out(u, XDT).to(gl.float32)
        if CLAMP:
            g = gl.minimum(g, limit)
            u = gl.minimum(gl.maximum(u, -limit), limit)
        h = to_out(g / (1.0 + gl.exp(-g)) * u * rw[None, None, :], XDT).to(gl.float32)
        e, recip = block_exp(gl.max(gl.abs(h), axis=1))
        return h, e, recip, rows, row_ok

    @gluon.jit
    def _up_finish(g, u, stage, tables, rw_ptr, h_ptr, n0, I, limit, stride_hm, PAIRS: gl.constexpr,
                   SHARED: gl.constexpr, TOKENS: gl.constexpr, CLAMP: gl.constexpr, XDT: gl.constexpr,
                   num_warps: gl.constexpr):
        """SwiGLU of the full gate / up sums (mma layout [16 * num_warps, TOKENS]) as the 16-row tile's
        epilogue computes it, h's fp8 round trip per 32 columns, stored as bf16 values. The sums go
        through shared memory (``stage``) into a layout whose 32-column blocks lie along a warp's lanes."""
        BLOCK_N: gl.constexpr = 16 * num_warps
        blocks: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 32, 1], [1, 1, num_warps], [1, 2, 0])
        h, e, recip, rows, row_ok = swiglu_blocks(g, u, stage, tables, rw_ptr, limit, PAIRS, SHARED, TOKENS, CLAMP,
                                                  XDT, BLOCK_N, blocks)
        q = (h * recip[:, None, :]).to(gl.float8e4nv).to(gl.float32)
        h = q * (e << 23).to(gl.float32, bitcast=True)[:, None, :]
        c0 = gl.arange(0, BLOCK_N // 32, layout=gl.SliceLayout(1, gl.SliceLayout(2, blocks)))
        c1 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, blocks)))
        cols = n0 + c0[:, None, None] * 32 + c1[None, :, None]
        ok = (cols < I) & row_ok[None, None, :]
        gl.store(h_ptr + rows.to(gl.int64)[None, None, :] * stride_hm + cols, h.to(h_ptr.dtype.element_ty), mask=ok)

    @gluon.jit
    def _down_kernel(h_ptr, tok_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, pos_ptr, w2_ptr, s2_ptr, y_ptr, ws_ptr,
                     cnt_ptr, out_ptr, add_ptr, comb_ptr, E, D, I, I_BYTES, n_rows, n_pairs, TOPK, k_split, kb_split,
                     n_splits, stride_hm, stride_we, stride_wn, stride_se, stride_swn, stride_swk, stride_ym, stride_om,
                     stride_am, sw2_ptr, ss2_ptr, stride_s_wn, stride_s_swn, stride_s_swk, routed_tiles,
                     TOKENS: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr, PAIRS: gl.constexpr,
                     SPLIT: gl.constexpr, COMBINE: gl.constexpr, HAS_ADD: gl.constexpr, XDT: gl.constexpr,
                     EVEN: gl.constexpr, EVEN_K: gl.constexpr, KMAJOR: gl.constexpr, SHARED: gl.constexpr,
                     num_warps: gl.constexpr):
        """y rows of the tile's rows (rounded to XDT, y's dtype), columns ``[n0, n0 + 16 * num_warps)`` of
        D: W2 [E, D, I / 2] E2M1 words over h [n_rows, I] bf16; SHARED: the row tiles from ``routed_tiles``
        on are the shared expert's (fp8_w [D, I] at ``sw2_ptr``, :mod:`.moe_mma_fp8`), its rows
        ``n_pairs + token``. SPLIT: ws [splits, n_rows, D] fp32 partials and a ticket counter per (row tile,
        column tile) at ``cnt_ptr``. COMBINE: then each token's rows summed into ``out`` (:func:`_combine`,
        a counter per (token, column tile) at ``comb_ptr``)."""
        wait_inputs()
        BLOCK_N: gl.constexpr = 16 * num_warps
        mma: gl.constexpr = _mma_layout(num_warps)
        t = gl.program_id(1)
        e = gl.load(tile_e_ptr + t, mask=t < routed_tiles, other=0)
        if e >= E:
            return
        n0, k_lo, kb_lo = _origin(BLOCK_N, k_split, kb_split)
        xc_l: gl.constexpr = _copy_layout(32 * SUB, 8, num_warps)
        tables = (tok_ptr, tile_row_ptr, row_end_ptr, TOPK, routed_tiles, n_pairs, n_rows)
        h_rows, _, _ = _tile_rows(tables, PAIRS, SHARED, TOKENS, gl.SliceLayout(1, xc_l))
        h_rows = gl.minimum(h_rows, n_rows - 1).to(gl.int64)  # lanes past the tile read a stored row
        k_hi = gl.minimum(k_lo + k_split, I)
        if (t >= routed_tiles) if SHARED else False:
            acc = gemm_fp8(h_ptr, h_rows, stride_hm, sw2_ptr, ss2_ptr, sw2_ptr, ss2_ptr, stride_s_wn, stride_s_swn,
                           stride_s_swk, n0, D, k_lo, k_hi, False, TOKENS, STAGES, SUB, EVEN, num_warps)[0]
        else:
            ew = e.to(gl.int64) * stride_we
            es = e.to(gl.int64) * stride_se
            acc = _gemm(h_ptr, h_rows, stride_hm, w2_ptr + ew, s2_ptr + es, w2_ptr, s2_ptr, stride_wn, stride_swn,
                        stride_swk, n0, D, k_lo, k_hi, kb_lo, gl.minimum(kb_lo + kb_split, I_BYTES), False, TOKENS,
                        STAGES, SUB, EVEN, EVEN_K, KMAJOR, num_warps)[0]
        rows, row_ok, tok = _tile_rows(tables, PAIRS, SHARED, TOKENS, gl.SliceLayout(0, mma))
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        sums = (pos_ptr, out_ptr, add_ptr, comb_ptr, TOPK, n_pairs, D, stride_ym, stride_om, stride_am)
        down_finish(acc, y_ptr, ws_ptr, cnt_ptr, rows, row_ok, tok, cols, n_rows, n_splits, sums, PAIRS, SHARED,
                    SPLIT, COMBINE, HAS_ADD, XDT, mma, BLOCK_N, TOKENS)

    @gluon.jit
    def down_finish(acc, y_ptr, ws_ptr, cnt_ptr, rows, row_ok, tok, cols, n_rows, n_splits, sums, PAIRS: gl.constexpr,
                    SHARED: gl.constexpr, SPLIT: gl.constexpr, COMBINE: gl.constexpr, HAS_ADD: gl.constexpr,
                    XDT: gl.constexpr, layout: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr):
        """A down program's end: its sums ``acc`` [BLOCK_N, TOKENS] (``layout``) of rows ``rows`` (``row_ok``,
        tokens ``tok``) at columns ``cols`` stored as y rows in XDT, once a K split's partials are summed
        (SPLIT: fp32 partials at ``ws_ptr``, a ticket counter per (row tile, column tile) at ``cnt_ptr``), then
        with COMBINE each token's rows summed into out (:func:`_combine`; ``sums`` as it takes them)."""
        D, stride_ym = sums[6], sums[7]
        ok = (cols < D)[:, None] & row_ok[None, :]
        y_at = y_ptr + rows.to(gl.int64)[None, :] * stride_ym + cols[:, None]
        if SPLIT:
            plane = n_rows * D
            part = ws_ptr + rows.to(gl.int64)[None, :] * D + cols[:, None]
            last, tile = _last_of_split(part, ok, plane, cnt_ptr, n_splits, acc)
            if last:
                acc = _split_sum(part, ok, plane, n_splits, layout, BLOCK_N, TOKENS)
                gl.store(y_at, to_out(acc, XDT).to(y_ptr.dtype.element_ty), mask=ok)
                if COMBINE:
                    _combine(y_ptr, row_ok, tok, cols, sums, PAIRS, SHARED, HAS_ADD, layout, BLOCK_N, TOKENS)
                gl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")
        else:
            gl.store(y_at, to_out(acc, XDT).to(y_ptr.dtype.element_ty), mask=ok)
            if COMBINE:
                _combine(y_ptr, row_ok, tok, cols, sums, PAIRS, SHARED, HAS_ADD, layout, BLOCK_N, TOKENS)

    @gluon.jit
    def _combine(y_ptr, row_ok, tok, cols, sums, PAIRS: gl.constexpr, SHARED: gl.constexpr, HAS_ADD: gl.constexpr,
                 layout: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr):
        """The combine kernel's sum in the down kernel: each of the tile's tokens draws a ticket of its
        (token, column tile) counter once its rows' y are stored; the program drawing a token's last (its
        TOPK-th, or with SHARED its TOPK + 1-th) sums the token's rows in slot order (row
        ``pos[tok * TOPK + s]``; PAIRS: ``tok * TOPK + s``), then its shared row ``n_pairs + tok`` (SHARED),
        adds its ``add`` row after the sum (HAS_ADD), stores it in out's dtype and puts the counter back.
        ``sums``: (pos, out, add, counter pointers, TOPK, n_pairs, D, y's, out's and add's row strides)."""
        pos_ptr, out_ptr, add_ptr, comb_ptr, TOPK, n_pairs, D, stride_ym, stride_om, stride_am = sums
        _sync()  # every thread's rows are stored before the tickets publish them
        slot = comb_ptr + tok * gl.num_programs(0) + gl.program_id(0)
        one = gl.full(tok.shape, 1, gl.int32, tok.type.layout)
        arrivals = TOPK + 1 if SHARED else TOPK
        last = row_ok & (gl.atomic_add(slot, one, mask=row_ok, sem="acq_rel", scope="gpu") == arrivals - 1)
        ok = (cols < D)[:, None] & last[None, :]
        total = gl.zeros([BLOCK_N, TOKENS], gl.float32, layout)
        for s in range(TOPK):
            if PAIRS:
                p = tok * TOPK + s
            else:
                p = gl.load(pos_ptr + tok * TOPK + s, mask=last, other=0).to(gl.int64)
            total += gl.load(y_ptr + p[None, :] * stride_ym + cols[:, None], mask=ok, other=0.0,
                             cache_modifier=".cg").to(gl.float32)
        if SHARED:
            total += gl.load(y_ptr + (n_pairs + tok)[None, :] * stride_ym + cols[:, None], mask=ok, other=0.0,
                             cache_modifier=".cg").to(gl.float32)
        if HAS_ADD:
            total += gl.load(add_ptr + tok[None, :] * stride_am + cols[:, None], mask=ok, other=0.0)
        gl.store(out_ptr + tok[None, :] * stride_om + cols[:, None], to_out(total, out_ptr.dtype.element_ty), mask=ok)
        gl.atomic_xchg(slot, one * 0, mask=last, sem="relaxed", scope="gpu")

def usable() -> bool:
    """Whether this Triton builds the kernels: Gluon, and 8 consecutive K elements a thread in a 16-bit MMA
    operand (Triton 3.7 on refuses them; each thread's operand must hold whole words of codes)."""
    return AVAILABLE and operand_kw(KW) == KW


def _gemm_plan(cols: int, k: int, row_tiles: int, tile: dict, sms: int) -> dict:
    """Splits and constexprs of one launch: ``cols`` weight rows over ``k`` for ``row_tiles`` row tiles
    (an upper bound where the routing tables decide), K split into whole ring slots aiming at ``per_sm``
    programs an SM, at least :data:`MIN_SLICES` K slices a split."""
    warps, sub = tile["num_warps"], tile["SUB"]
    tiles = row_tiles * cdiv(cols, ROWS_A_WARP * warps)
    slices = cdiv(k, 32)
    split = max(1, min(slices // max(MIN_SLICES, sub), (sms * tile["per_sm"]) // max(tiles, 1)))
    k_split = cdiv(cdiv(slices, split), sub) * sub * 32
    split = cdiv(k, k_split)
    if split > 1 and not splitk.fits(tiles):
        split, k_split = 1, cdiv(k, 32 * sub) * 32 * sub
    return dict(split=split, k_split=k_split, grid_cols=cdiv(cols, ROWS_A_WARP * warps),
                constexprs=dict(TOKENS=tile["TOKENS"], STAGES=tile["STAGES"], SUB=sub, SPLIT=split > 1,
                                EVEN=cols % (ROWS_A_WARP * warps) == 0, EVEN_K=k % (32 * sub) == 0, num_warps=warps))


def takes_shared(tile: dict) -> bool:
    """Whether launches under ``tile`` can run the shared expert's rows: its fp8 ring slots hold whole K
    slices (``SUB`` 2 or 4, :mod:`.moe_mma_fp8`)."""
    return tile["SUB"] in (2, 4)


def plan(n: int, k: int, E: int, D: int, I: int, pairs: bool, tile: dict, sms: int, shared: bool = False) -> dict:
    """The up and down launches of ``n`` tokens of ``k`` slots over ``E`` experts ([I, D] and [D, I]
    weights) under ``tile`` (``num_warps``, ``TOKENS``: rows a row tile, ``STAGES``, ``SUB``, ``per_sm``);
    ``pairs``: a row tile per (token, slot) pair, else the routing tables' tiles of ``TOKENS`` rows;
    ``shared``: the shared expert's row tiles (``TOKENS`` tokens each) after the routed ones (where
    :func:`takes_shared`)."""
    assert not shared or takes_shared(tile), tile
    row_tiles = n * k if pairs else min(n * k, cdiv(n * k, tile["TOKENS"]) + E)
    grid_rows = row_tiles + (cdiv(n, tile["TOKENS"]) if shared else 0)
    return dict(block_m=tile["TOKENS"], pairs=pairs, row_tiles=row_tiles, grid_rows=grid_rows, shared=shared,
                up=_gemm_plan(I, D, grid_rows, tile, sms), down=_gemm_plan(D, I, grid_rows, tile, sms))


def _operands(w):
    """(data, scale) uint8 views of an [E, rows, K] fp4_w expert stack and the scale's (expert, row,
    K-slice) strides (row major or K major)."""
    scale = w.scale.view(torch.uint8)
    return w.data, scale, scale.stride(0), scale.stride(1), scale.stride(2)


def _shared_operands(w, rows: int, k: int) -> tuple | None:
    """(data, scale) uint8 views of one fp8_w expert weight ([rows, k], or [1, rows, k]) and the data's row
    stride, the scale's 32-row-tile and K-slice strides, where the kernels can read it: 16-byte rows
    (whole copies), a scale byte at most ``codecs_e4m3.FOLD_MAX_SCALE`` (the decode folds its re-bias into
    it); else None."""
    if not (tuple(w.shape[-2:]) == (rows, k) and math.prod(w.shape[:-2]) == 1
            and scales_at_most((w,), "fp8_w", FP8_FOLD_MAX_SCALE)):
        return None
    data, scale = w.data.view(torch.uint8), w.scale.view(torch.uint8)
    data, scale = data.reshape(data.shape[-2:]), scale.reshape(scale.shape[-2:])
    if data.stride(1) != 1 or data.stride(0) % 16 or data.data_ptr() % 16 or k % 16:
        return None
    return data, scale, data.stride(0), scale.stride(0), scale.stride(1)


def shared_operands(shared, I: int, D: int) -> tuple | None:
    """The operands (:func:`_shared_operands`) of the shared expert's w1, w3 [I, D] and w2 [D, I] where
    the kernels take its rows (fp8_w, w1 and w3 laid out alike), else None."""
    ops = [_shared_operands(w, *dims) for w, dims in zip(shared, ((I, D), (I, D), (D, I)))]
    if any(o is None for o in ops) or ops[0][2:] != ops[1][2:]:
        return None
    return tuple(ops)


def experts(xq: torch.Tensor, tab: dict, w1, w3, w2, limit: float, xdtype: torch.dtype, p: dict, n: int, k: int,
            out: torch.Tensor | None = None, add: torch.Tensor | None = None, shared: tuple | None = None
            ) -> torch.Tensor:
    """The routed pair rows [n * k, D] in ``xdtype`` (pair order, or the tables' sorted order) of ``xq``
    [n, D] (the fp8 round trip's bf16 values) through the fp4_w experts ``w1``, ``w3`` [E, I, D] and
    ``w2`` [E, D, I] (E2M1 words, scales at most :data:`.linear.FOLD_MAX_SCALE`) under plan ``p``, then,
    where the plan has the shared expert's tiles, its row of each token (``shared``: its operands,
    :func:`shared_operands`); with ``out`` [n, D] (where :func:`combines`), ``out`` instead: each token's
    rows summed in slot order, then its shared row, plus its ``add`` row (fp32 [n, D] or None), in out's
    dtype."""
    assert p["shared"] == (shared is not None), "the plan's shared tiles and the shared operands go together"
    E, I, D = w1.shape[0], w1.shape[1], xq.shape[1]
    rows = n * k + (n if shared is not None else 0)
    (o1, o3, o2) = shared if shared is not None else ((None, None, 0, 0, 0),) * 3
    d1, s1, se, swn, swk = _operands(w1)
    d3, s3, *_ = _operands(w3)
    assert d1.stride() == d3.stride() and s1.stride() == s3.stride(), "w1 and w3 must share a layout"
    dev, xdt = xq.device, TL_DTYPES[xdtype]
    up, down = p["up"], p["down"]
    h = torch.empty(rows, I, dtype=torch.bfloat16, device=dev)
    ws = torch.empty(up["split"], 2, rows, I, dtype=torch.float32, device=dev) if up["split"] > 1 else h
    pool = splitk.counters(dev)
    _up_kernel[(up["grid_cols"], p["grid_rows"], up["split"])](
        xq, tab["tok"], tab["rw"], tab["tile_e"], tab["tile_row"], tab["row_end"], d1, s1, d3, s3, h, ws, pool, E, I, D,
        D // 2, limit, rows, n * k, k, up["k_split"], up["k_split"] // 2, up["split"], xq.stride(0), d1.stride(0),
        d1.stride(1), se, swn, swk, h.stride(0), _or(o1[0], d1), _or(o1[1], s1), _or(o3[0], d1), _or(o3[1], s1),
        *o1[2:], p["row_tiles"], PAIRS=p["pairs"], CLAMP=limit > 0, XDT=xdt, KMAJOR=swn == 1,
        SHARED=p["shared"], **up["constexprs"], **pdl.options(dev))
    d2, s2, se2, swn2, swk2 = _operands(w2)
    y = torch.empty(rows, D, dtype=xdtype, device=dev)
    ws = torch.empty(down["split"], rows, D, dtype=torch.float32, device=dev) if down["split"] > 1 else y
    reserved = n * down["grid_cols"] if out is not None else 0  # the combine's counters, then the split's
    _down_kernel[(down["grid_cols"], p["grid_rows"], down["split"])](
        h, tab["tok"], tab["tile_e"], tab["tile_row"], tab["row_end"], tab["pos"], d2, s2, y, ws, pool[reserved:],
        out if out is not None else y, add if add is not None else y, pool, E, D, I, I // 2, rows, n * k, k,
        down["k_split"], down["k_split"] // 2, down["split"], h.stride(0), d2.stride(0), d2.stride(1), se2, swn2, swk2,
        y.stride(0), out.stride(0) if out is not None else 0, add.stride(0) if add is not None else 0,
        _or(o2[0], d2), _or(o2[1], s2), *o2[2:], p["row_tiles"], PAIRS=p["pairs"], COMBINE=out is not None,
        HAS_ADD=add is not None, XDT=xdt, KMAJOR=swn2 == 1, SHARED=p["shared"], **down["constexprs"],
        **pdl.options(dev))
    return out if out is not None else y


def _or(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """``t``, or where there is none a tensor standing in for it (never read)."""
    return stand_in if t is None else t


def combines(p: dict, n: int) -> bool:
    """Whether the down launch of plan ``p`` over ``n`` tokens can sum each token's rows itself: a ticket
    counter for each (token, column tile) and each split tile within :data:`.splitk.POOL`."""
    down = p["down"]
    split_tiles = down["grid_cols"] * p["grid_rows"] if down["split"] > 1 else 0
    return splitk.fits(n * down["grid_cols"] + split_tiles)
