"""``moe_experts`` for calls with many rows an expert (prefill), as two bf16 grouped GEMMs.

Past ``tiles.moe.grouped_min_rows`` pair rows per expert (mean), with bf16 ``x``, the per-tile
decode of :mod:`.moe_kernels` repeats each expert's weight decode for every 64-row tile. Here every
operand is made exact in bf16 once and ``torch._grouped_mm`` (CUTLASS on sm_90) multiplies:

1. the pairs sorted by expert (stable), the routed experts' and the shared expert's W1 / W3 rows
   dequantized to bf16 (E2M1 / E4M3 times a power of two: exact) as one ``[E (+1), 2I, D]`` stack;
2. x quantized to fp8 per 32 and back to bf16 (the values the kernels' fp8 activations stand
   for), gathered per pair, the shared expert's rows (every token) after them;
3. one grouped GEMM: gate and up, fp32 sums rounded to bf16 (x.dtype), as the kernels round them;
4. the SwiGLU in fp32 with each row's routing weight (1 for the shared rows), rounded to bf16,
   quantized to fp8 per 32 and back (the input W2 sees, as in the kernels): one launch
   (``_swiglu_fp8_kernel``, the up kernel's own SwiGLU), no fp32 intermediates;
5. one grouped GEMM over the dequantized W2 stack, rows rounded to bf16;
6. the kernels' combine: each token's slot rows summed in slot order in fp32, then its shared
   row, then ``add``, stored in ``out_dtype``.

The same roundings as the kernels' path; the fp32 sums run in cuBLAS's order. The dequantized
stacks are made per call (``3 * E * I * D`` bf16 values): worth it where many rows share each
expert's weights; the threshold is a profile's choice (None: never).
"""
from __future__ import annotations

import dataclasses

import torch

from flashrt.formats import QTensor
from flashrt.kernels_cuda import quant
from flashrt.kernels_cuda.launch import TL_DTYPES, cdiv
from flashrt.kernels_cuda.linear import fp8_rows_bf16
from flashrt.kernels_cuda.moe_kernels import _moe_combine_kernel, _swiglu_fp8_kernel
from flashrt.kernels_cuda import pdl

BF16 = torch.bfloat16


def available(x: torch.Tensor) -> bool:
    """Whether this torch has ``_grouped_mm`` (and the call's activations are bf16, whose roundings
    the GEMM output reproduces)."""
    return hasattr(torch, "_grouped_mm") and x.dtype == BF16


def stack_bytes(E: int, I: int, D: int, shared: bool) -> int:
    """Bytes of the bf16 weight stacks a call makes: W1, W3 and W2 of every expert (+ the shared one)."""
    return 3 * (E + shared) * I * D * 2


def weight_bf16(w: QTensor) -> torch.Tensor:
    """A stacked ``fp4_w`` / ``fp8_w`` weight [E, out, in] as bf16 (exact); ``fp4_w``'s bytes are
    ``fp4_b32``'s (E2M1 codes, one UE8M0 scale per 32 inputs)."""
    if w.fmt == "fp4_w":
        w = dataclasses.replace(w, fmt="fp4_b32")
    return quant.dequantize(w, BF16)


def _stack(ws: list[QTensor]) -> torch.Tensor:
    """The weights' bf16 stacks concatenated over experts (routed first, then the shared expert)."""
    parts = [weight_bf16(w) for w in ws]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def swiglu_fp8(gu: torch.Tensor, rw: torch.Tensor, limit: float, tile: dict) -> torch.Tensor:
    """h [rows, I] in gu's dtype from gate ‖ up sums ``gu`` [rows, 2I] and fp32 row weights ``rw``
    [rows]: the SwiGLU (clamped where ``limit`` > 0), rounded, quantized to fp8 per 32 and back."""
    rows, I = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, I, dtype=gu.dtype, device=gu.device)
    if rows:
        _swiglu_fp8_kernel[(cdiv(rows, tile["BLOCK_R"]), cdiv(I, tile["BLOCK_C"]))](
            gu, rw, out, rows, I, float(limit), gu.stride(0), out.stride(0), CLAMP=limit > 0,
            XDT=TL_DTYPES[gu.dtype], BLOCK_R=tile["BLOCK_R"], BLOCK_C=tile["BLOCK_C"], num_warps=tile["num_warps"],
            **pdl.options(gu.device))
    return out


def experts(x, weights, indices, w1, w3, w2, limit: float, add, out_dtype, shared, combine: dict,
            swiglu: dict) -> torch.Tensor:
    """``moe_experts`` (x [N, D] bf16; shared: (w1, w3, w2) of one expert, quantized, or None;
    ``combine`` / ``swiglu``: the moe family's combine and SwiGLU tiles)."""
    n, D = x.shape
    k, E, I = indices.shape[1], w1.shape[0], w1.shape[1]
    pairs = n * k
    flat = indices.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # pair ids by expert
    # rows per group without a host sync (torch.bincount reads its size back; a captured prefill
    # cannot): the routed experts' counts, then the shared expert's n rows
    counts = torch.zeros(E + (shared is not None), dtype=torch.int32, device=x.device)
    counts[:E].scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    rw = weights.reshape(-1).to(torch.float32)[order]
    xb = fp8_rows_bf16(x)
    a = xb[order // k]
    if shared is not None:
        counts[E:].fill_(n)  # a fill kernel; `counts[E] = n` copies a host scalar and syncs
        a = torch.cat([a, xb])
        rw = torch.cat([rw, rw.new_ones(n)])
    offs = counts.cumsum(0, dtype=torch.int32)
    up = [w1, w3] if shared is None else [w1, shared[0], w3, shared[1]]
    w13 = torch.cat([_stack(up[:len(up) // 2]), _stack(up[len(up) // 2:])], dim=1)  # [E(+1), 2I, D]
    gu = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs)  # [rows, 2I], fp32 sums rounded to bf16
    h = swiglu_fp8(gu, rw.contiguous(), limit, swiglu)  # the fp8 values W2 sees, in bf16
    w2s = _stack([w2] if shared is None else [w2, shared[2]])
    y = torch._grouped_mm(h, w2s.transpose(1, 2), offs=offs)  # [rows, D] bf16
    pos = torch.empty(pairs, dtype=torch.int32, device=x.device)
    pos.scatter_(0, order, torch.arange(pairs, dtype=torch.int32, device=x.device))  # pair -> its row of y
    out = torch.empty(n, D, dtype=out_dtype, device=x.device)
    add = add.contiguous() if add is not None else None
    block = combine["BLOCK_D"]
    _moe_combine_kernel[(n, cdiv(D, block))](
        y, pos, out, add if add is not None else out, D, k, y.stride(0), out.stride(0),
        add.stride(0) if add is not None else 0, pairs, BLOCK_D=block, HAS_ADD=add is not None, PAIRS=False,
        SHARED=shared is not None, num_warps=combine["num_warps"], **pdl.options(y.device))
    return out
