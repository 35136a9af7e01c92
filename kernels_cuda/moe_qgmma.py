"""``moe_experts``' routed fp4_w experts on the fp8 warpgroup MMA, the weights as its register operand
(sm_90, Gluon): the experts rule knob ``qgmma``.

The two launches of :mod:`.moe_mma` (up: W1 and W3, then the SwiGLU; down: W2, then each token's rows
summed) with :mod:`.experts_qgmma`'s K loop in place of ``mma.sync``: each program is one warpgroup over 64
weight rows, its row tile's activation rows the MMA's N (``TOKENS``, 8 or 16). The activations come as the
E4M3 codes and block scales of their fp8 round trip: x's by :func:`.round_trip.fp8_codes`, h's as the up
kernel's epilogue stores them (the SwiGLU of the full sums, rounded as the 16-row tile rounds it, then
quantized per 32 columns as ``act_quant`` quantizes it). The routing tables, the K split's tickets and
the combine's (:func:`.moe_mma.combines` tells whether its counters fit) are :mod:`.moe_mma`'s. The shared
expert's fp8_w rows go in the same launches after the routed ones where the caller passes its operands
(:func:`.moe_mma.shared_operands`; :func:`.experts_qgmma.loop_fp8`). The weights keep the standard nibbles
(not the word layout) and K is a multiple of 128 (four blocks a trip).
"""
from __future__ import annotations

import torch

from flashrt.kernels_cuda import pdl, splitk
from flashrt.kernels_cuda.experts_qgmma import _DECODE_SCALE, AVAILABLE, ROWS
from flashrt.kernels_cuda.launch import TL_DTYPES, cdiv
from flashrt.kernels_cuda.moe_mma import _or


if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from flashrt.kernels_cuda.experts_qgmma import fill, loop, loop_fp8, mma_layout
    from flashrt.kernels_cuda.moe_mma import _tile_rows, down_finish, swiglu_blocks, up_split
    from flashrt.kernels_cuda.pdl import wait_inputs
    from flashrt.kernels_cuda.round_trip import mma_position, stream_position

    @gluon.jit
    def _up_finish(g, u, tables, rw_ptr, hq_ptr, hs_ptr, n0, I, limit, stride_hm, stride_hsm, PAIRS: gl.constexpr,
                   SHARED: gl.constexpr, TOKENS: gl.constexpr, CLAMP: gl.constexpr, XDT: gl.constexpr,
                   num_warps: gl.constexpr):
        """SwiGLU of the full gate / up sums ([64, TOKENS], :func:`.experts_qgmma.mma_layout`) as the 16-row
        tile's epilogue computes it, then h quantized per 32 columns: its E4M3 codes into ``hq`` and each
        block's scale times DECODE_SCALE into ``hs``. The sums go through shared memory into a layout whose
        32-column blocks lie along a warp's lanes."""
        blocks: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 32, 1], [1, 1, num_warps], [1, 2, 0])
        stage = gl.allocate_shared_memory(gl.float32, [2, 64, TOKENS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        h, e, recip, rows, row_ok = swiglu_blocks(g, u, stage, tables, rw_ptr, limit, PAIRS, SHARED, TOKENS, CLAMP,
                                                  XDT, 64, blocks)
        store_h(h, e, recip, rows, row_ok, hq_ptr, hs_ptr, n0, I, stride_hm, stride_hsm, 64, False, blocks)

    @gluon.jit
    def store_h(h, e, recip, rows, row_ok, hq_ptr, hs_ptr, n0, I, stride_hm, stride_hsm, BLOCK_N: gl.constexpr,
                MMA_ORDER: gl.constexpr, blocks: gl.constexpr, VALUES: gl.constexpr = False):
        """h [BLOCK_N / 32, 32, TOKENS] (``blocks``) of columns ``[n0, n0 + BLOCK_N)`` quantized per 32 columns
        (each block's scale exponent ``e`` and its reciprocal ``recip``): its E4M3 codes into ``hq`` rows
        ``rows`` (with MMA_ORDER each block's 32 codes in the MMA's order, :func:`.round_trip.mma_position`)
        and each block's scale times DECODE_SCALE into ``hs``. VALUES: the round trip's bf16 values into
        ``hq`` instead, in the bf16 stream order (:func:`.round_trip.stream_position`; ``hs`` unwritten)."""
        c0 = gl.arange(0, BLOCK_N // 32, layout=gl.SliceLayout(1, gl.SliceLayout(2, blocks)))
        c1 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, blocks)))
        cols = n0 + c0[:, None, None] * 32 + c1[None, :, None]
        ok = (cols < I) & row_ok[None, None, :]
        r64 = rows.to(gl.int64)
        codes = (h * recip[:, None, :]).to(gl.float8e4nv)
        scale = (e << 23).to(gl.float32, bitcast=True)
        if VALUES:
            v = codes.to(gl.float32) * scale[:, None, :]
            gl.store(hq_ptr + r64[None, None, :] * stride_hm + stream_position(cols), v.to(gl.bfloat16), mask=ok)
        else:
            if MMA_ORDER:
                at = n0 + c0[:, None, None] * 32 + mma_position(c1)[None, :, None]
            else:
                at = cols
            gl.store(hq_ptr + r64[None, None, :] * stride_hm + at, codes, mask=ok)
            blk = n0 // 32 + gl.arange(0, BLOCK_N // 32, layout=gl.SliceLayout(1, gl.SliceLayout(1, blocks)))
            gl.store(hs_ptr + r64[None, :] * stride_hsm + blk[:, None], scale * _DECODE_SCALE,
                     mask=(blk * 32 < I)[:, None] & row_ok[None, :])

    @gluon.jit
    def _up_kernel(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, w1_ptr, s1_ptr, w3_ptr,
                   s3_ptr, hq_ptr, hs_ptr, ws_ptr, cnt_ptr, E, I, D, limit, n_rows, n_pairs, TOPK, n_splits,
                   stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_hm,
                   stride_hsm, sw1_ptr, ss1_ptr, sw3_ptr, ss3_ptr, stride_s_wn, stride_s_st, stride_s_sk,
                   routed_tiles, TOKENS: gl.constexpr, K_SPLIT: gl.constexpr, STAGES: gl.constexpr,
                   PAIRS: gl.constexpr, SPLIT: gl.constexpr, CLAMP: gl.constexpr, XDT: gl.constexpr,
                   KMAJOR: gl.constexpr, SHARED: gl.constexpr, num_warps: gl.constexpr):
        """h of the tile's pair rows, columns ``[n0, n0 + 64)`` of I (:func:`_up_finish`): x codes [N, D] E4M3
        with scales xs [N, D / 32], W1 / W3 [E, I, D / 2] fp4_w (scales as :func:`.experts_qgmma.loop`
        reads them). SHARED: the row tiles from ``routed_tiles`` on are the shared expert's (fp8_w [I, D] at
        ``sw*_ptr``, tile scales at ``ss*_ptr``; :func:`.experts_qgmma.loop_fp8`), its rows ``n_pairs +
        token``. SPLIT: ws [splits, 2, n_rows, I] fp32 gate / up partials and a ticket counter per (row
        tile, column tile)."""
        wait_inputs()
        acc_l: gl.constexpr = mma_layout(TOKENS)
        t = gl.program_id(1)
        e = gl.load(tile_e_ptr + t, mask=t < routed_tiles, other=0)
        if e >= E:  # past the tables' last tile
            return
        n0 = gl.program_id(0) * 64
        k_lo = gl.program_id(2) * K_SPLIT
        nb = gl.minimum(K_SPLIT, D - k_lo) // 32
        tables = (tok_ptr, tile_row_ptr, row_end_ptr, TOPK, routed_tiles, n_pairs, n_rows)
        rows, row_ok, tok = _tile_rows(tables, PAIRS, SHARED, TOKENS, gl.SliceLayout(0, acc_l))
        # lanes past the tile load nothing (their sums are never stored)
        x_smem, s_smem = fill(xq_ptr, xs_ptr, gl.where(row_ok, tok, -1), stride_xm, stride_xsm, k_lo, nb, TOKENS,
                              K_SPLIT // 32, num_warps)
        if (t >= routed_tiles) if SHARED else False:
            g = loop_fp8(sw1_ptr, ss1_ptr, stride_s_wn, stride_s_st, stride_s_sk, n0, k_lo, nb, x_smem, s_smem,
                         TOKENS, num_warps)
            u = loop_fp8(sw3_ptr, ss3_ptr, stride_s_wn, stride_s_st, stride_s_sk, n0, k_lo, nb, x_smem, s_smem,
                         TOKENS, num_warps)
        else:
            ew, es = e.to(gl.int64) * stride_we, e.to(gl.int64) * stride_se
            g = loop(w1_ptr + ew, s1_ptr + es, stride_wn, stride_sn, stride_sk, n0, k_lo, nb, x_smem, s_smem, TOKENS,
                     K_SPLIT // 32, STAGES, KMAJOR, num_warps)
            u = loop(w3_ptr + ew, s3_ptr + es, stride_wn, stride_sn, stride_sk, n0, k_lo, nb, x_smem, s_smem, TOKENS,
                     K_SPLIT // 32, STAGES, KMAJOR, num_warps)
        if SPLIT:
            cols = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
            last, tile, g, u = up_split(g, u, ws_ptr, cnt_ptr, rows, row_ok, cols, I, n_rows, n_splits, acc_l, 64,
                                        TOKENS)
            if last:
                _up_finish(g, u, tables, rw_ptr, hq_ptr, hs_ptr, n0, I, limit, stride_hm, stride_hsm, PAIRS, SHARED,
                           TOKENS, CLAMP, XDT, num_warps)
                gl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")
        else:
            _up_finish(g, u, tables, rw_ptr, hq_ptr, hs_ptr, n0, I, limit, stride_hm, stride_hsm, PAIRS, SHARED, TOKENS,
                       CLAMP, XDT, num_warps)

    @gluon.jit
    def _down_kernel(hq_ptr, hs_ptr, tok_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, pos_ptr, w2_ptr, s2_ptr, y_ptr,
                     ws_ptr, cnt_ptr, out_ptr, add_ptr, comb_ptr, E, D, I, n_rows, n_pairs, TOPK, n_splits, stride_hm,
                     stride_hsm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_ym, stride_om,
                     stride_am, sw2_ptr, ss2_ptr, stride_s_wn, stride_s_st, stride_s_sk, routed_tiles,
                     TOKENS: gl.constexpr, K_SPLIT: gl.constexpr, STAGES: gl.constexpr, PAIRS: gl.constexpr,
                     SPLIT: gl.constexpr, COMBINE: gl.constexpr, HAS_ADD: gl.constexpr, XDT: gl.constexpr,
                     KMAJOR: gl.constexpr, SHARED: gl.constexpr, num_warps: gl.constexpr):
        """y rows of the tile's rows (rounded to XDT, y's dtype), columns ``[n0, n0 + 64)`` of D: W2 [E, D,
        I / 2] fp4_w over h's codes [n_rows, I] and scales [n_rows, I / 32]; SHARED: the row tiles from
        ``routed_tiles`` on are the shared expert's (fp8_w [D, I] at ``sw2_ptr``), its rows ``n_pairs +
        token``. SPLIT: ws [splits, n_rows, D] fp32 partials and a ticket counter per (row tile, column
        tile). COMBINE: then each token's rows summed into ``out`` (:func:`.moe_mma._combine`, a counter per
        (token, column tile) at ``comb_ptr``)."""
        wait_inputs()
        acc_l: gl.constexpr = mma_layout(TOKENS)
        t = gl.program_id(1)
        e = gl.load(tile_e_ptr + t, mask=t < routed_tiles, other=0)
        if e >= E:
            return
        n0 = gl.program_id(0) * 64
        k_lo = gl.program_id(2) * K_SPLIT
        nb = gl.minimum(K_SPLIT, I - k_lo) // 32
        tables = (tok_ptr, tile_row_ptr, row_end_ptr, TOPK, routed_tiles, n_pairs, n_rows)
        rows, row_ok, tok = _tile_rows(tables, PAIRS, SHARED, TOKENS, gl.SliceLayout(0, acc_l))
        h_rows = gl.where(row_ok, rows, -1).to(gl.int64)  # lanes past the tile load nothing
        x_smem, s_smem = fill(hq_ptr, hs_ptr, h_rows, stride_hm, stride_hsm, k_lo, nb, TOKENS, K_SPLIT // 32,
                              num_warps)
        if (t >= routed_tiles) if SHARED else False:
            acc = loop_fp8(sw2_ptr, ss2_ptr, stride_s_wn, stride_s_st, stride_s_sk, n0, k_lo, nb, x_smem, s_smem,
                           TOKENS, num_warps)
        else:
            acc = loop(w2_ptr + e.to(gl.int64) * stride_we, s2_ptr + e.to(gl.int64) * stride_se, stride_wn,
                       stride_sn, stride_sk, n0, k_lo, nb, x_smem, s_smem, TOKENS, K_SPLIT // 32, STAGES, KMAJOR,
                       num_warps)
        cols = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
        sums = (pos_ptr, out_ptr, add_ptr, comb_ptr, TOPK, n_pairs, D, stride_ym, stride_om, stride_am)
        down_finish(acc, y_ptr, ws_ptr, cnt_ptr, rows, row_ok, tok, cols, n_rows, n_splits, sums, PAIRS, SHARED,
                    SPLIT, COMBINE, HAS_ADD, XDT, acc_l, 64, TOKENS)


def supports(w1, w3, w2, D: int, I: int) -> bool:
    """Whether the kernels take these routed experts: fp4_w stacks in the standard nibbles with contiguous
    codes and scales K major or dense rows, w1 and w3 laid out alike, both K (D and I) multiples of 128."""
    ws = (w1, w3, w2)
    return (all(w.fmt == "fp4_w" and not w.e2m1_words and w.data.is_contiguous() and _scales_read(w.scale) for w in ws)
            and w1.data.stride() == w3.data.stride() and w1.scale.stride() == w3.scale.stride()
            and D % 128 == 0 and I % 128 == 0)  # (then both row counts are whole 64-row tiles too)


def _scales_read(scale: torch.Tensor) -> bool:
    """Whether :func:`_operands` reads these [E, rows, K / 32] scales: K major, or rows of dense bytes (read
    as int32 words)."""
    return scale.stride(1) == 1 or (scale.stride(2) == 1 and scale.stride(1) == scale.shape[2])


def _gemm_plan(cols: int, k: int, row_tiles: int, tile: dict, sms: int) -> dict:
    """One launch of ``cols`` weight rows over ``k`` for ``row_tiles`` row tiles: K split in multiples of
    128 as even as they go, at most ``max_k`` a program (its activations' shared memory is TOKENS bytes a
    code), aiming at ``per_sm`` programs an SM."""
    tiles = row_tiles * (cols // ROWS)
    split = max(1, min(k // 128, (sms * tile["per_sm"]) // max(tiles, 1)), cdiv(k, tile["max_k"]))
    k_split = cdiv(cdiv(k, split), 128) * 128  # the splits as even as multiples of 128 make them
    split = cdiv(k, k_split)
    if split > 1 and not splitk.fits(tiles):
        split, k_split = 0, 0  # no counters for the tickets: the caller keeps another path
    return dict(split=split, k_split=k_split, grid_cols=cols // ROWS,
                constexprs=dict(TOKENS=tile["TOKENS"], K_SPLIT=k_split, STAGES=tile["STAGES"], SPLIT=split > 1,
                                num_warps=4))


def plan(n: int, k: int, E: int, D: int, I: int, pairs: bool, tile: dict, sms: int, shared: bool = False
         ) -> dict | None:
    """The up and down launches of ``n`` tokens of ``k`` slots over ``E`` experts under ``tile``
    (``TOKENS`` rows a row tile, ``STAGES``, ``per_sm``, ``max_k``); ``pairs``: a row tile per (token, slot) pair,
    else the routing tables' tiles; ``shared``: the shared expert's row tiles (``TOKENS`` tokens each) after
    the routed ones. None where a K split would not have its ticket counters."""
    row_tiles = n * k if pairs else min(n * k, cdiv(n * k, tile["TOKENS"]) + E)
    grid_rows = row_tiles + (cdiv(n, tile["TOKENS"]) if shared else 0)
    up, down = _gemm_plan(I, D, grid_rows, tile, sms), _gemm_plan(D, I, grid_rows, tile, sms)
    if not up["split"] or not down["split"]:
        return None
    return dict(block_m=tile["TOKENS"], pairs=pairs, row_tiles=row_tiles, grid_rows=grid_rows, shared=shared, up=up,
                down=down)


def _operands(w):
    """(data, scale view, expert stride of the scale, its row stride, its K-block stride, K major) of an
    [E, rows, K] fp4_w stack: row-major scales as int32 words of four blocks, K-major ones as bytes."""
    scale = w.scale.view(torch.uint8)
    if scale.stride(2) == 1:
        words = scale.view(torch.int32)
        return w.data, words, words.stride(0), words.stride(1), 0, False
    return w.data, scale, scale.stride(0), 0, scale.stride(2), True


def experts(xq: torch.Tensor, xs: torch.Tensor, tab: dict, w1, w3, w2, limit: float, xdtype: torch.dtype, p: dict,
            n: int, k: int, out: torch.Tensor | None = None, add: torch.Tensor | None = None,
            shared: tuple | None = None) -> torch.Tensor:
    """The routed pair rows [n * k, D] in ``xdtype`` of x (its fp8 round trip as codes ``xq`` [n, D] and
    scales ``xs`` [n, D / 32] times DECODE_SCALE, :func:`.round_trip.fp8_codes`) through the fp4_w experts
    ``w1``, ``w3`` [E, I, D] and ``w2`` [E, D, I] (:func:`supports`) under plan ``p``, then, where the plan
    has the shared expert's tiles, its row of each token (``shared``: its operands,
    :func:`.moe_mma.shared_operands`); with ``out`` [n, D] (where :func:`.moe_mma.combines`), ``out`` instead: each
    token's rows summed in slot order, then its shared row, plus its ``add`` row (fp32 [n, D] or None), in
    out's dtype."""
    assert p["shared"] == (shared is not None), "the plan's shared tiles and the shared operands go together"
    E, I, D = w1.shape[0], w1.shape[1], xq.shape[1]
    rows = n * k + (n if shared is not None else 0)
    (o1, o3, o2) = shared if shared is not None else ((None, None, 0, 0, 0),) * 3
    d1, s1, se, sn, sk, kmajor = _operands(w1)
    d3, s3, *_ = _operands(w3)
    dev, xdt = xq.device, TL_DTYPES[xdtype]
    up, down = p["up"], p["down"]
    hq = torch.empty(rows, I, dtype=torch.float8_e4m3fn, device=dev)
    hs = torch.empty(rows, I // 32, dtype=torch.float32, device=dev)
    ws = torch.empty(up["split"], 2, rows, I, dtype=torch.float32, device=dev) if up["split"] > 1 else hs
    pool = splitk.counters(dev)
    _up_kernel[(up["grid_cols"], p["grid_rows"], up["split"])](
        xq, xs, tab["tok"], tab["rw"], tab["tile_e"], tab["tile_row"], tab["row_end"], d1, s1, d3, s3, hq, hs, ws,
        pool, E, I, D, limit, rows, n * k, k, up["split"], xq.stride(0), xs.stride(0), d1.stride(0), d1.stride(1),
        se, sn, sk, hq.stride(0), hs.stride(0), _or(o1[0], d1), _or(o1[1], d1), _or(o3[0], d1), _or(o3[1], d1),
        *o1[2:], p["row_tiles"], PAIRS=p["pairs"], CLAMP=limit > 0, XDT=xdt, KMAJOR=kmajor, SHARED=p["shared"],
        **up["constexprs"], **pdl.options(dev))
    d2, s2, se2, sn2, sk2, kmajor2 = _operands(w2)
    y = torch.empty(rows, D, dtype=xdtype, device=dev)
    ws = torch.empty(down["split"], rows, D, dtype=torch.float32, device=dev) if down["split"] > 1 else y
    reserved = n * down["grid_cols"] if out is not None else 0  # the combine's counters, then the split's
    _down_kernel[(down["grid_cols"], p["grid_rows"], down["split"])](
        hq, hs, tab["tok"], tab["tile_e"], tab["tile_row"], tab["row_end"], tab["pos"], d2, s2, y, ws, pool[reserved:],
        out if out is not None else y, add if add is not None else y, pool, E, D, I, rows, n * k, k, down["split"],
        hq.stride(0), hs.stride(0), d2.stride(0), d2.stride(1), se2, sn2, sk2, y.stride(0),
        out.stride(0) if out is not None else 0, add.stride(0) if add is not None else 0, _or(o2[0], d2),
        _or(o2[1], d2), *o2[2:], p["row_tiles"], PAIRS=p["pairs"], COMBINE=out is not None, HAS_ADD=add is not None,
        XDT=xdt, KMAJOR=kmajor2, SHARED=p["shared"], **down["constexprs"], **pdl.options(dev))
    return out if out is not None else y

