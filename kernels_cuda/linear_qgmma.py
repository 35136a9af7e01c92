"""fp8_w ``linear`` over many rows on Hopper's fp8 warpgroup MMA, both operands streamed from shared memory
(sm_90, Gluon): the linear rule knob ``qgmma``.

The MMA tile of :mod:`.linear_kernel` promotes its accumulator after every 32-deep K slice (UE8M0 scales
per 32 activations and per 32 x 32 weight tile) through ``tl.dot``; at thousands of rows it reaches a
fraction of the fp8 MMA's rate. Here :mod:`.experts_qgmma_stream`'s K loop runs with the E4M3 weights as
the MMA's shared operand as they are: a program is ``num_warps / 4`` warpgroups over ``16 * num_warps``
weight rows (the M of ``wgmma m64nTOKENSk32``) and ``TOKENS`` activation rows (its N), the weight rows,
the activations' E4M3 codes (:func:`.round_trip.fp8_codes`, in K order) and their block scales through
one ring of trips of four K blocks; each block's product is scaled by its weight tile's and its rows'
scales in fp32 and summed in fp32, the accumulator then stored through shared memory in rows of the
output. Programs go in groups of ``GROUP`` activation tiles over each weight tile, so a weight tile is
read from memory about once a group.

At a few rows (a decode step's 16-64) the output tiles do not fill the SMs: with ``PER_SM`` set the plan
splits K into runs of whole trips so that about that many programs run an SM (the weight bytes in flight
are what bounds a launch there), and the splits of an output tile meet in its last program (the ticket of
:mod:`.splitk`: fp32 partials summed in split order, deterministic). A program's activation rows are the
least power of two from 16 that holds the launch's rows, up to ``TOKENS``. With ``TOKEN_GROUPS`` 2 a program's
two warpgroups sit side by side over its tokens on one 64-row weight tile (each ``wgmma m64n(TOKENS/2)k32``):
half the accumulator and half the scaling a thread, for the 32-64 rows of a decode step.
"""
from __future__ import annotations

import torch

from flashrt.kernels_cuda import pdl, splitk
from flashrt.kernels_cuda.experts_qgmma_stream import AVAILABLE, TRIP_BLOCKS
from flashrt.kernels_cuda.launch import TL_DTYPES, cdiv, next_pow2

TOKENS = (16, 32, 64, 128)  # activation rows a program
WARPS = (4, 8)  # warps a program: 64 or 128 weight rows (TOKEN_GROUPS 1)
TOKEN_GROUPS = (1, 2)  # warpgroups side by side over a program's tokens (2: 8 warps over 64 weight rows)
TRIP = 32 * TRIP_BLOCKS  # K a trip of the loop

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from flashrt.kernels_cuda.experts_qgmma_stream import loop, rows_layout, weight_copy_layout
    from flashrt.kernels_cuda.gemv_mma import meet_splits
    from flashrt.kernels_cuda.pdl import wait_inputs

    @gluon.jit
    def _kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, k_split, n_splits, stride_xm,
                stride_xsm, stride_wn, stride_sn, stride_sk, stride_om, TOKENS: gl.constexpr, STAGES: gl.constexpr,
                GROUP: gl.constexpr, INFLIGHT: gl.constexpr, num_warps: gl.constexpr, REDUCE: gl.constexpr = False,
                TOKEN_GROUPS: gl.constexpr = 1):
        """out [M, N] (its dtype) = x [M, K] @ W.T: x's E4M3 codes with fp32 block scales xs [M, K / 32], W's
        E4M3 bytes [N, K] with UE8M0 scale bytes [N / 32, K / 32] (``stride_sn`` / ``stride_sk`` apart).
        N a multiple of the program's rows, K and ``k_split`` of 128. ``program_id(1)`` is the K split; with
        REDUCE its fp32 partial goes to ``part`` [n_splits, M, N] and the output tile's last program (a
        ticket of ``cnt``, one counter a tile) sums them into ``out``. TOKEN_GROUPS 2: two warpgroups over one
        weight tile of 64 rows, each half of the tokens."""
        wait_inputs()
        ROWS: gl.constexpr = 16 * num_warps // TOKEN_GROUPS
        acc_l: gl.constexpr = rows_layout(TOKENS, num_warps, TOKEN_GROUPS)
        # GROUP activation tiles in a row over one weight tile, then the next weight tile
        pid = gl.program_id(0)
        tiles_m = gl.cdiv(M, TOKENS)
        per_group = GROUP * (N // ROWS)
        first = (pid // per_group) * GROUP
        size = gl.minimum(tiles_m - first, GROUP)
        m0 = (first + (pid % per_group) % size) * TOKENS
        n0 = ((pid % per_group) // size) * ROWS
        tok = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, acc_l))
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, weight_copy_layout(num_warps, True)))
        rows = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_l))
        split = gl.program_id(1)
        k_lo = split * k_split
        acc = loop(w_ptr + (n0 + r).to(gl.int64) * stride_wn + k_lo,
                   ws_ptr + (rows // 32).to(gl.int64) * stride_sn + (k_lo // 32) * stride_sk, stride_sk, xq_ptr + k_lo,
                   xs_ptr + k_lo // 32, tok.to(gl.int64), tok < M, stride_xm, stride_xsm,
                   gl.minimum(k_split, K - k_lo), TOKENS, STAGES, True, num_warps, True, INFLIGHT, TOKEN_GROUPS)
        # stored through shared memory: a thread's ROWS / 16 consecutive columns of one output row
        st: gl.constexpr = gl.BlockedLayout([ROWS // 16, 1], [16, 2], [1, num_warps], [0, 1])
        cols = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st))
        at = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, st))
        live = (at < M)[None, :]
        dst = out_ptr + at.to(gl.int64)[None, :] * stride_om + cols[:, None]
        if REDUCE:
            meet_splits(gl.convert_layout(acc, st), part_ptr + at.to(gl.int64)[None, :] * N + cols[:, None], dst, live,
                        cnt_ptr + pid, split, n_splits, M * N)
        else:
            gl.store(dst, gl.convert_layout(acc.to(out_ptr.dtype.element_ty), st), mask=live)


def plan(m: int, n: int, k: int, tile: dict, sms: int = 0) -> dict | None:
    """The launch of ``m`` rows over an [n, k] fp8_w weight under ``tile`` (``TOKENS``: activation rows a
    program at most, ``STAGES``, ``num_warps``, ``GROUP``, ``INFLIGHT``, ``maxnreg``: a register cap a thread
    or None, ``PER_SM``: programs aimed at an SM by splitting K, or None for no split; ``TOKEN_GROUPS``, 1 or
    2: warpgroups side by side over the tokens, 2 with 8 warps only), or None where the tile is not one the
    kernel takes, the ring is under two trips, K is not whole trips of 128 or the weight rows not whole
    programs. ``sms``: the device's SMs (``PER_SM`` only)."""
    groups = tile.get("TOKEN_GROUPS", 1)
    rows = 16 * tile["num_warps"] // groups
    if (tile["TOKENS"] not in TOKENS or tile["num_warps"] not in WARPS or tile["STAGES"] < 2
            or k % TRIP or n % rows or groups not in TOKEN_GROUPS or rows < 64):
        return None
    tokens = min(tile["TOKENS"], max(TOKENS[0], next_pow2(m)))
    tiles = cdiv(m, tokens) * (n // rows)
    split = 1
    if tile.get("PER_SM"):
        trips = k // TRIP
        split = max(1, min(trips, (sms * tile["PER_SM"]) // tiles))
        split = cdiv(trips, cdiv(trips, split))  # whole trips a split, none empty
    k_split = cdiv(k // TRIP, split) * TRIP
    reduce = split > 1
    if reduce and not splitk.fits(tiles):
        return None
    return dict(grid=(tiles, split), split=split, k_split=k_split, reduce=reduce,
                constexprs=dict(TOKENS=tokens, STAGES=tile["STAGES"], GROUP=tile["GROUP"], INFLIGHT=tile["INFLIGHT"],
                                num_warps=tile["num_warps"], **({"REDUCE": True} if reduce else {}),
                                **({"TOKEN_GROUPS": groups} if groups > 1 else {}),
                                **({"maxnreg": tile["maxnreg"]} if tile["maxnreg"] else {})))


def launch(xq: torch.Tensor, xs: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, plan_: dict,
           out_dtype: torch.dtype) -> torch.Tensor:
    """[M, N] in ``out_dtype``: x's E4M3 codes ``xq`` [M, K] (K order) and fp32 block scales ``xs`` [M, K / 32]
    times an fp8_w weight's E4M3 bytes ``data`` [N, K] (rows dense) and UE8M0 scale bytes ``scale`` [N / 32,
    K / 32] (any strides), under ``plan_`` (:func:`plan`)."""
    (m, k), n = xq.shape, data.shape[0]
    assert TL_DTYPES[out_dtype] is not None and data.stride(1) == 1 and xq.stride(1) == 1
    if data.stride(0) % 16 or data.data_ptr() % 16:  # rows the 16-byte copies cannot take as they are
        data = data.clone(memory_format=torch.contiguous_format)  # dense rows of K (a multiple of 128) bytes
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if plan_["reduce"]:
        part = torch.empty(plan_["split"], m, n, dtype=torch.float32, device=xq.device)
        cnt = splitk.counters(xq.device)
    else:
        part = cnt = out
    _kernel[plan_["grid"]](xq, xs, data, scale, out, part, cnt, m, n, k, plan_["k_split"], plan_["split"],
                           xq.stride(0), xs.stride(0), data.stride(0), scale.stride(0), scale.stride(1), out.stride(0),
                           **plan_["constexprs"], **pdl.options(xq.device))
    return out
