"""``moe_experts``' routed fp4_w experts of a prefill chunk on the fp8 warpgroup MMA, the weights its register
operand, the activations streamed (sm_90, Gluon): the experts rule knob ``qgmma`` with ``qgmma_tokens`` of
32 or 64.

:mod:`.moe_qgmma`'s two launches with :mod:`.experts_qgmma_stream`'s K loop: no K split; each program runs
the whole K of its weight rows for one row tile of the routing tables (``TOKENS`` pair rows of one expert),
its activations' codes and scales copied through the ring beside the weights.

- ``_up_kernel``: ``8 * num_warps`` columns of I a program, W1's rows in the first half of its M and W3's in
  the second (both over the same activations: one pass over x), then the SwiGLU of the full sums as the
  16-row tile computes it and h quantized per 32 columns, its codes stored in the MMA's order;
- ``_down_kernel``: ``16 * num_warps`` columns of D over h, each pair row rounded to x's dtype; each
  token's rows summed by the combine in the same launch where its counters fit, else by the combine
  launch.

x's codes come in the MMA's order too (:func:`.round_trip.fp8_codes` with ``mma_order``). The shared
expert is not in these launches (the caller runs it on the direct path).

With ``BF16`` (the rule's ``qgmma_bf16``) the same launches run :mod:`.experts_bf16_stream`'s K loop on the
bf16 MMA instead: the weights decoded with their block scales, x and h as their round trips' bf16 values in
that loop's order (:func:`.round_trip.fp8_round_trip` with ``stream_order``; the up launch stores h so), no
per-block scaling after the MMA.
"""
from __future__ import annotations

import torch

from flashrt.kernels_cuda import pdl, splitk
from flashrt.kernels_cuda.experts_qgmma_stream import AVAILABLE, TRIP_BLOCKS
from flashrt.kernels_cuda.launch import TL_DTYPES, cdiv
from flashrt.kernels_cuda.linear import FOLD_MAX_SCALE, scales_at_most
from flashrt.kernels_cuda.moe_qgmma import _operands

TOKENS = (32, 64)  # row tile sizes the launches take (at 128 the accumulators spill)
TOKENS2 = (16, 32)  # sizes of a row tile's second part the bf16 loop takes (its own, narrower MMA)
WARPS = (4, 8)  # warps a program: 64 or 128 weight rows


if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from flashrt.kernels_cuda import experts_bf16_stream as bf16
    from flashrt.kernels_cuda.attention_ws import _sync
    from flashrt.kernels_cuda.experts_qgmma_stream import loop, rows_layout, weight_copy_layout
    from flashrt.kernels_cuda.moe_mma import _tile_rows, down_finish, swiglu_staged
    from flashrt.kernels_cuda.moe_qgmma import store_h
    from flashrt.kernels_cuda.pdl import wait_inputs

    @gluon.constexpr_function
    def _acc_layout(TOKENS, num_warps, BF16):
        return bf16.acc_layout(TOKENS, num_warps) if BF16 else rows_layout(TOKENS, num_warps)

    @gluon.jit
    def _sums(w_rows, s_rows, stride_sk, x_ptr, xs_ptr, tok, row_ok, stride_xm, stride_xsm, K, TOKENS: gl.constexpr,
              STAGES: gl.constexpr, KMAJOR: gl.constexpr, INFLIGHT: gl.constexpr, BF16: gl.constexpr,
              FOLD: gl.constexpr, num_warps: gl.constexpr, part2=None, TOKENS2: gl.constexpr = 0):
        """The K loop of either MMA (``s_rows``: the rows' scale pointers, :func:`_scale_rows`, in the
        accumulators' row layout; moved into the one the loop reads them in). TOKENS2 (the bf16 loop only):
        the tile's second part too, ``part2`` its (tokens, row mask, whether it holds a row); returns both
        parts' sums."""
        if BF16:
            r_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, bf16.bytes_layout(num_warps)))
            acc = bf16.loop(w_rows, gl.convert_layout(s_rows, r_l), stride_sk, x_ptr, tok, row_ok, stride_xm, K,
                            TOKENS, STAGES, KMAJOR, FOLD, num_warps, part2, TOKENS2)
        else:
            acc = loop(w_rows, s_rows, stride_sk, x_ptr, xs_ptr, tok, row_ok, stride_xm, stride_xsm, K, TOKENS,
                       STAGES, KMAJOR, num_warps, False, INFLIGHT)
        return acc

    @gluon.jit
    def _scale_rows(s_ptr, n, stride_sn, KMAJOR: gl.constexpr):
        """Pointers to the scales of weight rows ``n`` (K major: bytes; else int32 words of four blocks)."""
        return s_ptr + (n.to(gl.int64) if KMAJOR else n.to(gl.int64) * stride_sn)

    @gluon.jit
    def _up_kernel(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, w1_ptr, s1_ptr, w3_at,
                   s3_at, hq_ptr, hs_ptr, E, I, D, limit, n_rows, n_pairs, TOPK, stride_xm, stride_xsm, stride_we,
                   stride_wn, stride_se, stride_sn, stride_sk, stride_hm, stride_hsm, routed_tiles,
                   TOKENS: gl.constexpr, STAGES: gl.constexpr, PAIRS: gl.constexpr, CLAMP: gl.constexpr,
                   XDT: gl.constexpr, KMAJOR: gl.constexpr, INFLIGHT: gl.constexpr, BF16: gl.constexpr,
                   FOLD: gl.constexpr, num_warps: gl.constexpr, TOKENS2: gl.constexpr = 0):
        """h of the tile's pair rows, columns ``[n0, n0 + 8 * num_warps)`` of I: x codes [N, D] E4M3 in the
        MMA's order with scales xs [N, D / 32] (times DECODE_SCALE), W1 / W3 [E, I, D / 2] fp4_w (scales as
        :func:`.experts_qgmma._scale_word` reads them), W3 and its scales ``w3_at`` and ``s3_at`` elements
        past W1's (offsets, not pointers: the copies' 16-byte alignment stays provable); h's codes
        [n_rows, I] in the MMA's order, its scales [n_rows, I / 32] (times DECODE_SCALE). BF16: x [N, D] and
        h [n_rows, I] the round trips' bf16 values in the bf16 stream order (``xs_ptr`` and ``hs_ptr`` unread);
        FOLD: every scale byte of W1 and W3 at most 128. TOKENS2 (BF16 only): row tiles of TOKENS + TOKENS2
        rows, the second part on its own narrower MMA (:func:`.experts_bf16_stream.loop`)."""
        wait_inputs()
        ROWS: gl.constexpr = 16 * num_warps
        HALF: gl.constexpr = ROWS // 2
        acc_l: gl.constexpr = _acc_layout(TOKENS, num_warps, BF16)
        t = gl.program_id(1)
        e = gl.load(tile_e_ptr + t)
        if e >= E:  # past the tables' last tile
            return
        n0 = gl.program_id(0) * HALF
        tables = (tok_ptr, tile_row_ptr, row_end_ptr, TOPK, routed_tiles, n_pairs, n_rows)
        rows, row_ok, tok = _tile_rows(tables, PAIRS, False, TOKENS, gl.SliceLayout(0, acc_l))
        ew, es = e.to(gl.int64) * stride_we, e.to(gl.int64) * stride_se
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, weight_copy_layout(num_warps)))
        w_rows = w1_ptr + (ew + (n0 + r % HALF).to(gl.int64) * stride_wn + (r // HALF).to(gl.int64) * w3_at)
        r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_l))
        s_rows = _scale_rows(s1_ptr + es + (r_s // HALF).to(gl.int64) * s3_at, n0 + r_s % HALF, stride_sn, KMAJOR)
        h_out = (tables, rw_ptr, limit, hq_ptr, hs_ptr, n0, I, stride_hm, stride_hsm)
        if TOKENS2 > 0:
            _, ok2, tok2, two = _second_part(tables, TOKENS, TOKENS2, _acc_layout(TOKENS2, num_warps, BF16))
            acc, acc2 = _sums(w_rows, s_rows, stride_sk, xq_ptr, xs_ptr, tok, row_ok, stride_xm, stride_xsm, D, TOKENS,
                              STAGES, KMAJOR, INFLIGHT, BF16, FOLD, num_warps, (tok2, ok2, two), TOKENS2)
        else:
            acc = _sums(w_rows, s_rows, stride_sk, xq_ptr, xs_ptr, tok, row_ok, stride_xm, stride_xsm, D, TOKENS,
                        STAGES, KMAJOR, INFLIGHT, BF16, FOLD, num_warps)
        _up_store(acc, h_out, PAIRS, CLAMP, XDT, BF16, TOKENS, 0, num_warps)
        if TOKENS2 > 0:
            if two:
                _up_store(acc2, h_out, PAIRS, CLAMP, XDT, BF16, TOKENS2, TOKENS, num_warps)

    @gluon.jit
    def _second_part(tables, TOKENS: gl.constexpr, TOKENS2: gl.constexpr, acc2_l: gl.constexpr):
        """(rows, row mask, tokens, whether it holds a row) of the TOKENS2 rows of a routed tile past its
        first TOKENS, in the columns of ``acc2_l``."""
        rows2, ok2, tok2 = _tile_rows(tables, False, False, TOKENS2, gl.SliceLayout(0, acc2_l), TOKENS)
        return rows2, ok2, tok2, gl.max(ok2.to(gl.int32), axis=0) > 0

    @gluon.jit
    def _up_store(acc, h_out, PAIRS: gl.constexpr, CLAMP: gl.constexpr, XDT: gl.constexpr, BF16: gl.constexpr,
                  TOKENS: gl.constexpr, FIRST: gl.constexpr, num_warps: gl.constexpr):
        """The SwiGLU of gate / up sums ``acc`` [ROWS, TOKENS] (W1's rows the first half, W3's the second) of the
        tile's rows from its FIRST-th on, h quantized and stored (``h_out``: the tables, routing weights,
        limit, h's pointers, the columns' first, I and h's strides)."""
        tables, rw_ptr, limit, hq_ptr, hs_ptr, n0, I, stride_hm, stride_hsm = h_out
        HALF: gl.constexpr = 8 * num_warps
        # the gate rows and the up rows through shared memory, into a layout whose 32-column blocks lie along
        # a warp's lanes
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        stage = gl.allocate_shared_memory(gl.float32, [2, HALF, TOKENS], flat)
        stage.reinterpret(gl.float32, [2 * HALF, TOKENS], flat).store(acc)
        _sync()
        blocks: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 32, 1], [1, 1, num_warps], [1, 2, 0])
        h, ex, recip, rows_b, ok_b = swiglu_staged(stage, tables, rw_ptr, limit, PAIRS, False, TOKENS, CLAMP, XDT,
                                                   HALF, blocks, FIRST)
        store_h(h, ex, recip, rows_b, ok_b, hq_ptr, hs_ptr, n0, I, stride_hm, stride_hsm, HALF, True, blocks, BF16)

    @gluon.jit
    def _down_kernel(hq_ptr, hs_ptr, tok_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, pos_ptr, w2_ptr, s2_ptr, y_ptr,
                     out_ptr, add_ptr, comb_ptr, E, D, I, n_rows, n_pairs, TOPK, stride_hm, stride_hsm, stride_we,
                     stride_wn, stride_se, stride_sn, stride_sk, stride_ym, stride_om, stride_am, routed_tiles,
                     TOKENS: gl.constexpr, STAGES: gl.constexpr, PAIRS: gl.constexpr, COMBINE: gl.constexpr,
                     HAS_ADD: gl.constexpr, XDT: gl.constexpr, KMAJOR: gl.constexpr, INFLIGHT: gl.constexpr,
                     BF16: gl.constexpr, FOLD: gl.constexpr, num_warps: gl.constexpr, TOKENS2: gl.constexpr = 0):
        """y rows of the tile's pair rows (rounded to XDT, y's dtype), columns ``[n0, n0 + 16 * num_warps)`` of
        D: W2 [E, D, I / 2] fp4_w over h's codes [n_rows, I] (the MMA's order) and scales [n_rows, I / 32].
        COMBINE: then each token's rows summed into ``out`` (:func:`.moe_mma._combine`, a counter per (token,
        column tile) at ``comb_ptr``). BF16: h [n_rows, I] bf16 values in the bf16 stream order (``hs_ptr``
        unread); FOLD: every scale byte of W2 at most 128. TOKENS2: as :func:`_up_kernel`'s."""
        wait_inputs()
        ROWS: gl.constexpr = 16 * num_warps
        acc_l: gl.constexpr = _acc_layout(TOKENS, num_warps, BF16)
        t = gl.program_id(1)
        e = gl.load(tile_e_ptr + t)
        if e >= E:
            return
        n0 = gl.program_id(0) * ROWS
        tables = (tok_ptr, tile_row_ptr, row_end_ptr, TOPK, routed_tiles, n_pairs, n_rows)
        rows, row_ok, tok = _tile_rows(tables, PAIRS, False, TOKENS, gl.SliceLayout(0, acc_l))
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, weight_copy_layout(num_warps)))
        w_rows = w2_ptr + e.to(gl.int64) * stride_we + (n0 + r).to(gl.int64) * stride_wn
        r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_l))
        s_rows = _scale_rows(s2_ptr + e.to(gl.int64) * stride_se, n0 + r_s, stride_sn, KMAJOR)
        cols = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_l))
        sums = (pos_ptr, out_ptr, add_ptr, comb_ptr, TOPK, n_pairs, D, stride_ym, stride_om, stride_am)
        if TOKENS2 > 0:
            acc2_l: gl.constexpr = _acc_layout(TOKENS2, num_warps, BF16)
            rows2, ok2, tok2, two = _second_part(tables, TOKENS, TOKENS2, acc2_l)
            acc, acc2 = _sums(w_rows, s_rows, stride_sk, hq_ptr, hs_ptr, rows.to(gl.int64), row_ok, stride_hm,
                              stride_hsm, I, TOKENS, STAGES, KMAJOR, INFLIGHT, BF16, FOLD, num_warps,
                              (rows2.to(gl.int64), ok2, two), TOKENS2)
        else:
            acc = _sums(w_rows, s_rows, stride_sk, hq_ptr, hs_ptr, rows.to(gl.int64), row_ok, stride_hm, stride_hsm,
                        I, TOKENS, STAGES, KMAJOR, INFLIGHT, BF16, FOLD, num_warps)
        down_finish(acc, y_ptr, y_ptr, comb_ptr, rows, row_ok, tok, cols, n_rows, 1, sums, PAIRS, False, False,
                    COMBINE, HAS_ADD, XDT, acc_l, ROWS, TOKENS)
        if TOKENS2 > 0:
            if two:
                cols2 = gl.convert_layout(cols, gl.SliceLayout(1, acc2_l))
                down_finish(acc2, y_ptr, y_ptr, comb_ptr, rows2, ok2, tok2, cols2, n_rows, 1, sums, PAIRS, False,
                            False, COMBINE, HAS_ADD, XDT, acc2_l, ROWS, TOKENS2)


def plan(n: int, k: int, E: int, D: int, I: int, pairs: bool, tile: dict) -> dict | None:
    """The up and down launches of ``n`` tokens of ``k`` slots over ``E`` experts under ``tile`` (``TOKENS``
    rows a row tile, ``STAGES`` ring trips, ``num_warps``, ``INFLIGHT`` block MMAs in flight, ``maxnreg``: a
    register cap a thread or None, ``BF16``: the bf16 MMA's loop, ``TOKENS2``: with it, the rows of a row
    tile's second part, 0 for none; ``min_k``: the least K of either GEMM the launches take, 0 for any);
    ``pairs``: a row tile per (token, slot) pair, else the routing tables'
    tiles (of TOKENS + TOKENS2 rows). None where the tile is not one these launches take (TOKENS, warps,
    TOKENS2), the ring is not at least two trips, or a K is not a whole number of trips or under ``min_k``."""
    rows = 16 * tile["num_warps"]
    bf16 = bool(tile.get("BF16"))
    # a second part only on the bf16 loop over the routing tables' tiles (a pair's tile holds one row)
    second = tile.get("TOKENS2", 0) if bf16 and not pairs else 0
    if (tile["TOKENS"] not in TOKENS or tile["num_warps"] not in WARPS or tile["STAGES"] < 2
            or second not in (0, *TOKENS2) or min(D, I) < tile.get("min_k", 0)
            or D % (32 * TRIP_BLOCKS) or I % (32 * TRIP_BLOCKS) or I % (rows // 2) or D % rows):
        return None
    block_m = tile["TOKENS"] + second
    row_tiles = n * k if pairs else min(n * k, cdiv(n * k, block_m) + E)
    # the bf16 loop has no blocks in flight to count: one variant of it
    cap = {"maxnreg": tile["maxnreg"]} if tile["maxnreg"] else {}
    constexprs = dict(TOKENS=tile["TOKENS"], STAGES=tile["STAGES"], INFLIGHT=1 if bf16 else tile["INFLIGHT"],
                      BF16=bf16, TOKENS2=second, num_warps=tile["num_warps"], **cap)
    # split 1: no K split (what moe_mma.combines counts)
    return dict(stream=True, bf16=bf16, block_m=block_m, pairs=pairs, row_tiles=row_tiles, grid_rows=row_tiles,
                shared=False, up=dict(split=1, grid_cols=I // (rows // 2), constexprs=constexprs),
                down=dict(split=1, grid_cols=D // rows, constexprs=constexprs))


def _past(b: torch.Tensor, a: torch.Tensor) -> int:
    """How many elements of a's dtype ``b`` starts past ``a`` (b and a alike: W3 and W1, or their scales)."""
    at, size = b.data_ptr() - a.data_ptr(), a.element_size()
    assert b.dtype == a.dtype and at % size == 0, "w1 and w3 (and their scales) must be laid out alike"
    return at // size


def experts(xq: torch.Tensor, xs: torch.Tensor, tab: dict, w1, w3, w2, limit: float, xdtype: torch.dtype, p: dict,
            n: int, k: int, out: torch.Tensor | None = None, add: torch.Tensor | None = None,
            shared: tuple | None = None) -> torch.Tensor:
    """The routed pair rows [n * k, D] in ``xdtype`` of x (its fp8 round trip as codes ``xq`` [n, D] in the MMA's
    order and scales ``xs`` [n, D / 32] times DECODE_SCALE: :func:`.round_trip.fp8_codes` with ``mma_order``;
    under a plan of the bf16 loop its values ``xq`` [n, D] in that loop's order and ``xs`` None:
    :func:`.round_trip.fp8_round_trip` with ``stream_order``)
    through the fp4_w experts ``w1``, ``w3`` [E, I, D] and ``w2`` [E, D, I] (:func:`.moe_qgmma.supports`)
    under plan ``p`` (:func:`plan`); with ``out`` [n, D] (where :func:`.moe_mma.combines`), ``out`` instead:
    each token's rows summed in slot order, plus its ``add`` row (fp32 [n, D] or None), in out's dtype."""
    assert shared is None and not p["shared"], "the streamed launches take no shared expert"
    E, I, D = w1.shape[0], w1.shape[1], xq.shape[1]
    rows = n * k
    d1, s1, se, sn, sk, kmajor = _operands(w1)
    d3, s3, *_ = _operands(w3)
    dev, xdt = xq.device, TL_DTYPES[xdtype]
    if p["bf16"]:  # h's values in the loop's order; no scale arrays (their pointers stand in, unread)
        xs = xq
        hq = hs = torch.empty(rows, I, dtype=torch.bfloat16, device=dev)
    else:
        hq = torch.empty(rows, I, dtype=torch.float8_e4m3fn, device=dev)
        hs = torch.empty(rows, I // 32, dtype=torch.float32, device=dev)
    fold = p["bf16"] and scales_at_most((w1, w3), "fp4_w", FOLD_MAX_SCALE)
    _up_kernel[(p["up"]["grid_cols"], p["grid_rows"])](
        xq, xs, tab["tok"], tab["rw"], tab["tile_e"], tab["tile_row"], tab["row_end"], d1, s1, _past(d3, d1),
        _past(s3, s1), hq, hs, E, I, D,
        limit, rows, rows, k, xq.stride(0), xs.stride(0), d1.stride(0), d1.stride(1), se, sn, sk, hq.stride(0),
        hs.stride(0), p["row_tiles"], PAIRS=p["pairs"], CLAMP=limit > 0, XDT=xdt, KMAJOR=kmajor, FOLD=fold,
        **p["up"]["constexprs"], **pdl.options(dev))
    d2, s2, se2, sn2, sk2, kmajor2 = _operands(w2)
    y = torch.empty(rows, D, dtype=xdtype, device=dev)
    pool = splitk.counters(dev)
    fold_down = p["bf16"] and scales_at_most((w2,), "fp4_w", FOLD_MAX_SCALE)
    _down_kernel[(p["down"]["grid_cols"], p["grid_rows"])](
        hq, hs, tab["tok"], tab["tile_e"], tab["tile_row"], tab["row_end"], tab["pos"], d2, s2, y,
        out if out is not None else y, add if add is not None else y, pool, E, D, I, rows, rows, k, hq.stride(0),
        hs.stride(0), d2.stride(0), d2.stride(1), se2, sn2, sk2, y.stride(0), out.stride(0) if out is not None else 0,
        add.stride(0) if add is not None else 0, p["row_tiles"], PAIRS=p["pairs"], COMBINE=out is not None,
        HAS_ADD=add is not None, XDT=xdt, KMAJOR=kmajor2, FOLD=fold_down, **p["down"]["constexprs"],
        **pdl.options(dev))
    return out if out is not None else y
