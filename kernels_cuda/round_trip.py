"""Activations through the fp8 round trip: every 32-wide block of a row (from column 0) quantized to
fp8 as ``act_quant`` quantizes it and decoded back, stored as the values it stands for (an E4M3 value
times a power of two: exact in bf16).

The GEMM loops that take their activations this way (``linear_kernel.ACT_DEQUANTIZED``: the experts'
``tiles.moe.act_dequantized``, the GEMV rules' ``gemv_round_trip`` knob) load them as they are instead
of quantizing them again in every program that reads a row, at the cost of this one launch. The GEMMs
whose MMA takes fp8 operands (:mod:`.experts_qgmma`) take the round trip as its E4M3 codes and block
scales instead (:func:`fp8_codes`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.codecs import block_scale, e4m3_rne, fake_blocks, to_out
from flashrt.kernels_cuda.launch import cdiv, last_dense
from flashrt.kernels_cuda.pdl import wait_inputs


@triton.jit
def _fp8_round_trip(v, OUT: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """fp32 ``v`` [R, C] (C whole blocks of 32) quantized to fp8 per 32 and decoded back, as OUT: the
    values the GEMMs' activation quantization hands the MMA (exact in bf16)."""
    b = tl.reshape(v, (R * C // 32, 32))
    _, scale, recip = block_scale(tl.max(tl.abs(b), axis=1), 1)
    return to_out(tl.reshape(fake_blocks(b, scale, recip, 1), (R, C)), OUT)


@triton.jit
def stream_position(c):
    """The stored position of column ``c`` (int tensor) in the bf16 MMA's order of
    :mod:`.experts_bf16_stream`: within each 128-wide trip K ``32t + 8a + 4c + 2g + h`` goes to ``32a + 16c +
    8g + 2t + h`` (:func:`.experts_bf16_stream.position`). Also called from the Gluon kernels that store h."""
    w = c % 128
    r = w % 32
    return c - w + 32 * (r // 8) + 16 * ((r % 8) // 4) + 8 * ((r % 4) // 2) + 2 * (w // 32) + r % 2


@triton.jit
def _fp8_round_trip_kernel(x_ptr, out_ptr, rows, D, stride_x, stride_out, STREAM_ORDER: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """x rows [rows, D] through the fp8 round trip (:func:`_fp8_round_trip`, blocks of 32 from column
    0) into out (its dtype; STREAM_ORDER: each 128-wide trip's values in the order of
    :func:`stream_position`, moved there in registers so the stores stay whole rows; BLOCK_C a multiple of
    128). One program: ``BLOCK_R`` rows x ``BLOCK_C`` columns."""
    wait_inputs()
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < D)[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
    out = _fp8_round_trip(x, out_ptr.dtype.element_ty, BLOCK_R, BLOCK_C)
    if STREAM_ORDER:  # K 32t + 8a + 4c + 2g + h of each trip to 32a + 16c + 8g + 2t + h
        out = tl.reshape(out, (BLOCK_R, BLOCK_C // 128, 4, 4, 2, 2, 2))  # (row, trip, t, a, c, g, h)
        out = tl.reshape(tl.permute(out, (0, 1, 3, 4, 5, 2, 6)), (BLOCK_R, BLOCK_C))
    tl.store(out_ptr + r[:, None] * stride_out + c[None, :], out, mask=ok)


def fp8_round_trip(x: torch.Tensor, tile: dict, stream_order: bool = False) -> torch.Tensor:
    """bf16 [N, D]: the values of x's [N, D] fp8 round trip (per 32 from column 0), one launch of
    ``tile`` (``BLOCK_R`` rows x ``BLOCK_C`` columns a program, ``num_warps``). ``stream_order``: each
    128-wide trip's values in the order the bf16 MMA of the streamed fp4 experts takes them
    (:func:`stream_position`; D a multiple of 128)."""
    if stream_order and x.shape[-1] % 128:
        raise ValueError(f"fp8_round_trip: stream_order expects a last dimension that is a multiple of 128, "
                         f"got {x.shape[-1]}")
    x = last_dense(x)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    cols = max(tile["BLOCK_C"], 128) if stream_order else tile["BLOCK_C"]  # whole trips a program
    grid = (cdiv(x.shape[0], tile["BLOCK_R"]), cdiv(x.shape[1], cols))
    _fp8_round_trip_kernel[grid](x, out, x.shape[0], x.shape[1], x.stride(0), out.stride(0),
                                 STREAM_ORDER=stream_order, BLOCK_R=tile["BLOCK_R"], BLOCK_C=cols,
                                 num_warps=tile["num_warps"], **pdl.options(x.device))
    return out


@triton.jit
def mma_position(c):
    """The stored position of column ``c`` (int tensor) in the fp8 MMA's order: within each 32-wide block K
    ``8t + 2j + h`` goes to ``16h + 4t + j`` (:func:`.experts_qgmma_stream.mma_position`, the order the
    fp4 experts' decode fills the MMA's operand in). Also called from the Gluon kernels that store codes."""
    w = c % 32
    return c - w + 16 * (w % 2) + 4 * (w // 8) + (w % 8) // 2


@triton.jit
def _fp8_codes_kernel(x_ptr, code_ptr, scale_ptr, rows, D, stride_x, stride_code, stride_scale, SCALE: tl.constexpr,
                      MMA_ORDER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """x rows [rows, D] (D a multiple of 32) quantized to fp8 per 32 as :func:`_fp8_round_trip` quantizes
    them: the E4M3 bytes into ``code`` [rows, D] (MMA_ORDER: each block's in the fp8 MMA's order, see
    :func:`fp8_codes`) and each block's scale times ``SCALE`` into ``scale`` [rows, D / 32] fp32. One
    program: ``BLOCK_R`` rows x ``BLOCK_C`` columns."""
    wait_inputs()
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < D)[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.reshape(x, (BLOCK_R * BLOCK_C // 32, 32))
    _, scale, recip = block_scale(tl.max(tl.abs(b), axis=1), 1)
    code = e4m3_rne(tl.minimum(tl.maximum(b * recip[:, None], -448.0), 448.0))
    at = c
    if MMA_ORDER:
        at = mma_position(c)
    tl.store(code_ptr + r[:, None] * stride_code + at[None, :], tl.reshape(code, (BLOCK_R, BLOCK_C)).to(tl.uint8),
             mask=ok)
    g = tl.program_id(1) * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    tl.store(scale_ptr + r[:, None] * stride_scale + g[None, :], tl.reshape(scale * SCALE, (BLOCK_R, BLOCK_C // 32)),
             mask=(r < rows)[:, None] & (g < D // 32)[None, :])


def fp8_codes(x: torch.Tensor, tile: dict, scale: float = 1.0, mma_order: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes ``float8_e4m3fn [N, D]``, fp32 block scales times ``scale`` ``[N, D / 32]``) of x's
    [N, D] fp8 round trip (D a multiple of 32): code times block scale is the value :func:`fp8_round_trip`
    stores. ``mma_order``: each block's 32 codes stored in the order the fp8 MMA of the fp4 experts takes
    them (K ``8t + 2j + h`` at position ``16h + 4t + j``, :func:`.experts_qgmma_stream.mma_position`). One
    launch of ``tile`` (as :func:`fp8_round_trip`'s)."""
    if x.shape[-1] % 32:
        raise ValueError(f"fp8_codes: expected a last dimension that is a multiple of 32, got {x.shape[-1]}")
    x = last_dense(x)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.float32, device=x.device)
    grid = (cdiv(x.shape[0], tile["BLOCK_R"]), cdiv(x.shape[1], tile["BLOCK_C"]))
    _fp8_codes_kernel[grid](x, codes, scales, x.shape[0], x.shape[1], x.stride(0), codes.stride(0), scales.stride(0),
                            SCALE=float(scale), MMA_ORDER=mma_order, BLOCK_R=tile["BLOCK_R"], BLOCK_C=tile["BLOCK_C"],
                            num_warps=tile["num_warps"], **pdl.options(x.device))
    return codes.view(torch.float8_e4m3fn), scales
