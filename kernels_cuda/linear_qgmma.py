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
"""
from __future__ import annotations

import torch

from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.experts_qgmma_stream import AVAILABLE, TRIP_BLOCKS
from flashrt.kernels_cuda.launch import TL_DTYPES, cdiv

TOKENS = (32, 64, 128)  # activation rows a program
WARPS = (4, 8)  # warps a program: 64 or 128 weight rows

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from flashrt.kernels_cuda.experts_qgmma_stream import loop, rows_layout, weight_copy_layout
    from flashrt.kernels_cuda.pdl import wait_inputs

    @gluon.jit
    def _kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_xsm, stride_wn, stride_sn, stride_sk,
                stride_om, TOKENS: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, INFLIGHT: gl.constexpr,
                num_warps: gl.constexpr):
        """out [M, N] (its dtype) = x [M, K] @ W.T: x's E4M3 codes with fp32 block scales xs [M, K / 32], W's
        E4M3 bytes [N, K] with UE8M0 scale bytes [N / 32, K / 32] (``stride_sn`` / ``stride_sk`` apart).
        N a multiple of the program's rows, K of 128."""
        wait_inputs()
        ROWS: gl.constexpr = 16 * num_warps
        acc_l: gl.constexpr = rows_layout(TOKENS, num_warps)
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
        acc = loop(w_ptr + (n0 + r).to(gl.int64) * stride_wn, ws_ptr + (rows // 32).to(gl.int64) * stride_sn,
                   stride_sk, xq_ptr, xs_ptr, tok.to(gl.int64), tok < M, stride_xm, stride_xsm, K, TOKENS, STAGES,
                   True, num_warps, True, INFLIGHT)
        # stored through shared memory: a thread's ROWS / 16 consecutive columns of one output row
        st: gl.constexpr = gl.BlockedLayout([ROWS // 16, 1], [16, 2], [1, num_warps], [0, 1])
        out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), st)
        cols = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st))
        at = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, st))
        gl.store(out_ptr + at.to(gl.int64)[None, :] * stride_om + cols[:, None], out, mask=(at < M)[None, :])


def plan(m: int, n: int, k: int, tile: dict) -> dict | None:
    """The launch of ``m`` rows over an [n, k] fp8_w weight under ``tile`` (``TOKENS``, ``STAGES``,
    ``num_warps``, ``GROUP``, ``INFLIGHT``, ``maxnreg``: a register cap a thread or None), or None where the
    tile is not one the kernel takes, the ring is under two trips, K is not whole trips of 128 or the weight
    rows not whole programs."""
    rows = 16 * tile["num_warps"]
    if (tile["TOKENS"] not in TOKENS or tile["num_warps"] not in WARPS or tile["STAGES"] < 2
            or k % (32 * TRIP_BLOCKS) or n % rows):
        return None
    return dict(grid=(cdiv(m, tile["TOKENS"]) * (n // rows),),
                constexprs=dict(TOKENS=tile["TOKENS"], STAGES=tile["STAGES"], GROUP=tile["GROUP"],
                                INFLIGHT=tile["INFLIGHT"], num_warps=tile["num_warps"],
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
    _kernel[plan_["grid"]](xq, xs, data, scale, out, m, n, k, xq.stride(0), xs.stride(0), data.stride(0),
                           scale.stride(0), scale.stride(1), out.stride(0), **plan_["constexprs"],
                           **pdl.options(xq.device))
    return out
