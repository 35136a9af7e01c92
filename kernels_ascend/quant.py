"""quantize, dequantize and linear on torch_npu operators (npu_dynamic_quant, npu_quant_matmul)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt import formats
from flashrt import refmath as ref
from flashrt.formats import QTensor
from flashrt.refmath_linear import per_group
from flashrt.refmath_wide import linear32

from .npu_runtime import dequantize as exact_dequantize
from .npu_runtime import fallback, npu_family, operator, via_torch

HALF = (torch.float16, torch.bfloat16)
DEQUANT_WHY = "elementwise decoding by integer ops and table look-ups (no operator decodes without float8 math)"
INT8_T_MIN_SCALE = torch.tensor(formats.spec("int8_t").amax_floor / formats.INT8_MAX).item()  # fp32


def _quant_rows_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 elements of ``x [..., N]`` for a per-row fp32 ``scale [...]``: nearest even, +-127."""
    return torch.round(x.to(torch.float32) / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)


def quant_rows(op: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_t`` of a bf16/fp16 ``x [..., N]`` (>= 2 dims) -> (int8 [..., N], fp32 scale [...]),
    for op ``op``.

    ``torch_npu.npu_dynamic_quant(x)`` computes scale = row amax / 127 (fp32) and
    y = round(x / scale). ``int8_t`` floors amax at 2**-126: since fp32 division is monotonic,
    ``max(op scale, fl(2**-126 / 127))`` is exactly the format's scale, and the rows below the floor
    (all-zero rows, where the operator divides 0 by 0, and denormal rows) get their elements
    recomputed in plain torch with a ``where`` (no host sync).
    """
    y, scale = operator(op, "npu_dynamic_quant")(x)
    small = scale < INT8_T_MIN_SCALE
    scale = scale.clamp_min(INT8_T_MIN_SCALE)
    y = torch.where(small.unsqueeze(-1), _quant_rows_torch(x, scale), y)
    return y, scale


def quantize_plan(x, fmt) -> str | None:
    if fmt != "int8_t":
        return f"no torch_npu operator produces {fmt!r} (its scale rule or packing differ)"
    if x.dtype not in HALF:
        return "npu_dynamic_quant takes only fp16/bf16 input"
    if x.dim() < 2:
        return "npu_dynamic_quant needs at least 2 dims"
    return None


def quantize(x, fmt):
    """``quantize`` -> ``torch_npu.npu_dynamic_quant`` for ``int8_t`` (see :func:`quant_rows`).

    Layout: ``x [..., N]`` as is; the operator's scale ``[...]`` is stored as ``[..., 1]``. Every
    other format, fp32 input or a 1-D x falls back to the plain-torch codec of
    :mod:`flashrt.formats` (``int8``: its power-of-two scale is not what npu_dynamic_quant
    computes; fp8/fp4: no operator).
    """
    why = quantize_plan(x, fmt)
    if why:
        fallback("quantize", why)
        return formats.quantize(x, fmt)
    y, scale = quant_rows("quantize", x)
    return QTensor(y, scale.unsqueeze(-1), fmt, x.shape)


def dequantize(q, dtype):
    """``dequantize``: plain torch (elementwise; no operator needed). Bytes are decoded with
    integer ops and table look-ups (``npu_runtime.dequantize``), never with float8 arithmetic."""
    fallback("dequantize", DEQUANT_WHY)
    return exact_dequantize(q, dtype)


def linear_plan(x, weight, out_dtype=None) -> str | None:
    if out_dtype not in (None, x.dtype):
        return "an output dtype other than x's: the sums rounded once to it, in plain torch"
    if not isinstance(weight, QTensor):
        return None if weight.dtype == x.dtype and x.dtype in HALF else "plain weight: fp32 matmul"
    if weight.fmt != "int8_w":
        return f"no FP8/FP4 matmul on the 910B ({weight.fmt}); the ascend910b profile stores int8_w"
    if x.dtype not in HALF:
        return "npu_quant_matmul returns fp16/bf16 only; an fp32 x would be rounded"
    return None


def quant_matmul(x2: torch.Tensor, w: QTensor) -> torch.Tensor:
    """``x2 [M, K]`` bf16/fp16 times ``int8_w [N, K]`` -> ``[M, N]`` in ``x2.dtype``."""
    xq, xs = quant_rows("linear", x2)
    scale = w.scale.view(-1)  # [N] bf16: exact per-channel scale; fp32 for an fp16 output
    if x2.dtype == torch.float16:
        scale = scale.to(torch.float32)
    return operator("linear", "npu_quant_matmul")(xq, w.data.t(), scale, pertoken_scale=xs, output_dtype=x2.dtype)


def linear_exact(x, weight: QTensor, out_dtype=None) -> torch.Tensor:
    """Plain-torch ``linear`` with a quantized weight, in ``out_dtype`` (default ``x.dtype``): ``x``
    quantized as ``refmath.activation_format`` says, both operands decoded by the exact byte decoders,
    multiplied row by row as the reference does (``linear32``: wide where the device has fp64, so a
    row's bits do not depend on the batch's blocking)."""
    xq = exact_dequantize(formats.quantize(x, ref.activation_format(weight)))
    return linear32(xq, exact_dequantize(weight)).to(out_dtype or x.dtype)


def linear(x, weight, out_dtype=None):
    """``linear``: plain weight -> ``F.linear`` (aclnnMatmul, fp32 accumulation on the cube);
    ``int8_w`` -> ``npu_dynamic_quant`` + ``torch_npu.npu_quant_matmul``.

    int8_w: ``x [..., K]`` is viewed ``[M, K]``, quantized per token (``int8_t``), and
    ``npu_quant_matmul(xq, w.data.t() [K, N] (a transposed view, no copy), scale=w.scale [N],
    pertoken_scale=xs [M], output_dtype=x.dtype)`` computes ``(xq @ wq) * scale[n] * xs[m]`` from an
    exact int32 accumulation, which is docs/ops.md's ``dequant(xq) @ dequant(w).T`` rounded once to
    ``x.dtype``. Falls back to plain torch for fp32 x (the operator has no fp32 output), for
    ``fp8_w``/``fp4_w`` weights (no FP8/FP4 on the 910B: reference numerics, fp8 activations) and
    for a plain weight whose dtype differs from x's (computed in fp32 as the reference does), and
    for an ``out_dtype`` other than x's.
    """
    why = linear_plan(x, weight, out_dtype)
    if why:
        fallback("linear", why)
        if isinstance(weight, QTensor) and weight.fmt == "int8_w":
            return linear_exact(x, weight, out_dtype)
        return ref.linear(x, weight, out_dtype)
    if not isinstance(weight, QTensor):
        via_torch("linear", "F.linear (aclnnMatmul)")
        return F.linear(x, weight)
    x2 = x.reshape(-1, x.shape[-1])
    return quant_matmul(x2, weight).reshape(*x.shape[:-1], weight.shape[0])


def grouped_linear(x, weight):
    """``grouped_linear``: one :func:`linear` per group (``F.linear`` for a plain weight in x's
    dtype), the outputs side by side."""
    via_torch("grouped_linear", "linear per group, then torch.cat")
    return per_group(linear, x, weight)


PLANS = {"quantize": quantize_plan, "dequantize": lambda *args: DEQUANT_WHY, "linear": linear_plan,
         "grouped_linear": lambda x, weight: linear_plan(x[..., 0, :], weight)}


FAMILY = npu_family("quant", {"quantize": quantize, "dequantize": dequantize, "linear": linear,
                              "grouped_linear": grouped_linear},
                    "quantize, dequantize, linear and grouped linear (npu_quant_matmul, npu_dynamic_quant)")
