"""Reference math of the quantization and linear ops: ``quantize``, ``dequantize``, ``linear``, and
the quantized-weight helpers the MoE math and backend adapters share (a cache of dequantized
weights, the activation format a quantized weight implies)."""
from __future__ import annotations

import weakref

import torch

from . import formats
from .formats import QTensor
from .refmath_wide import linear_wide


def quantize(x, fmt):
    return formats.quantize(x, fmt)


def dequantize(q, dtype):
    return formats.dequantize(q, dtype)


_WEIGHT_CACHE: dict[int, tuple] = {}  # id(data) -> (weakref(data), scale, shape, fp32 values)


def dequantized_weight(w: QTensor) -> torch.Tensor:
    """fp32 values of a quantized weight, kept while its storage lives (weights are immutable)."""
    key = id(w.data)
    hit = _WEIGHT_CACHE.get(key)
    if hit is None or hit[0]() is not w.data or hit[1] is not w.scale or hit[2] != tuple(w.shape):
        hit = (weakref.ref(w.data), w.scale, tuple(w.shape), formats.dequantize(w))
        _WEIGHT_CACHE[key] = hit
        weakref.finalize(w.data, _WEIGHT_CACHE.pop, key, None)
    return hit[3]


def activation_format(weight: QTensor) -> str:
    """What a quantized weight's input is quantized to: per-token int8 for ``int8_w``, else fp8."""
    return "int8_t" if weight.fmt == "int8_w" else "fp8"


def _linear_acc(x, weight) -> torch.Tensor:
    """``x @ weight.T`` accumulated wide, not rounded (fp8 activations for QTensor weights)."""
    if isinstance(weight, QTensor):
        xq = formats.dequantize(formats.quantize(x, activation_format(weight)))
        return linear_wide(xq, dequantized_weight(weight))
    return linear_wide(x, weight)


def linear_fp32(x, weight) -> torch.Tensor:
    """``x @ weight.T`` rounded once to fp32 from the wide accumulation (fp8 activations for
    QTensor weights)."""
    return _linear_acc(x, weight).to(torch.float32)


def grouped_linear(x, weight):
    return per_group(linear, x, weight)


def per_group(linear_fn, x, weight):
    """``grouped_linear`` by one ``linear_fn(x_g, weight_g)`` per group, the outputs side by side
    (the reference; the backends' fallback when a group cannot be one launch)."""
    out = weight.shape[0] // x.shape[-2]
    return torch.cat([linear_fn(x[..., g, :], weight[g * out:(g + 1) * out]) for g in range(x.shape[-2])], dim=-1)


def linear(x, weight, out_dtype=None):
    """``linear_fp32`` in ``out_dtype`` (default ``x.dtype``); an fp64 output gets the wide
    accumulation itself, not rounded to fp32: partial sums that tensor-parallel ranks add up (in
    fp64) and round once, as one process's whole sum is rounded."""
    out_dtype = out_dtype or x.dtype
    if out_dtype == torch.float64:
        return _linear_acc(x, weight).to(torch.float64)
    return linear_fp32(x, weight).to(out_dtype)
