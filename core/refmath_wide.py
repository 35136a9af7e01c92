"""Row-invariant arithmetic shared by the reference math (:mod:`flashrt.refmath`).

GEMMs, last-dim sums and the transcendental pointwise functions are evaluated wide (fp64 on CPU and
CUDA) and rounded to fp32, so that a row (a position, a head) gets the same bits whatever the other
rows of the call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# A GEMM's blocking depends on how many rows it has, so in fp32 one row rounds differently in a
# one-token step and in a chunk (a verify step, a prefill). Accumulating in fp64 and rounding to
# fp32 gives each row the same fp32 result whatever the other rows of the call (up to exact
# rounding ties): decode steps, verify chunks and prefills agree bit for bit. Devices without
# fast fp64 (NPUs) keep fp32.
_WIDE_DEVICES = ("cpu", "cuda")


def wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64) if t.device.type in _WIDE_DEVICES else t.to(torch.float32)


def linear_wide(x, weight) -> torch.Tensor:
    """``x @ weight.T`` accumulated wide (fp64 where :data:`_WIDE_DEVICES`), not rounded."""
    return F.linear(wide(x), wide(weight))


def linear32(x, weight) -> torch.Tensor:
    """``x @ weight.T`` of fp32-valued operands -> fp32, each row independent of the others."""
    return linear_wide(x, weight).to(torch.float32)


def row_sum(t: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dim, the same for a row whatever the other rows (a reduction's
    vectorization, and so its order, depends on the tensor's shape)."""
    return wide(t).sum(-1).to(torch.float32)


def mean_sq(t: torch.Tensor) -> torch.Tensor:
    """``mean(t ** 2)`` over the last dim (kept), row-invariant as :func:`row_sum`."""
    return (wide(t).pow(2).sum(-1, keepdim=True) / t.shape[-1]).to(torch.float32)


def pointwise(fn, t: torch.Tensor) -> torch.Tensor:
    """``fn(t)`` -> fp32, the same for an element wherever it sits in the tensor: CPU kernels run a
    transcendental function (sigmoid, silu, softplus) vectorized over a tensor's body and scalar
    over its tail, which round differently; evaluated wide and rounded to fp32 they agree."""
    return fn(wide(t)).to(torch.float32)
