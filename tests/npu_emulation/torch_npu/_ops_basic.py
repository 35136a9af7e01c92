"""Emulated npu_rms_norm, npu_rotary_mul, npu_clipped_swiglu, npu_gather_sparse_index (torch_npu 2.14.0
schemas; math and constraints from the operator documentation shipped in the wheel)."""
from __future__ import annotations

import torch

from ._emulated import check, operator

HALF_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
GATHER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool, torch.float64, torch.complex64, torch.complex128)


@operator
def npu_rms_norm(self, gamma, epsilon=1e-06):
    """(y, rstd): y = x * rsqrt(mean(x**2) + eps) * gamma in fp32, cast to x.dtype; the mean runs
    over the last ``gamma.dim()`` dims and rstd keeps those dims as 1 (the meta function's shape)."""
    check(self.dtype in HALF_FLOAT, f"self dtype {self.dtype} not supported")
    check(gamma.dtype == self.dtype, "gamma must have the dtype of self")
    check(2 <= self.dim() <= 8, "self must have 2-8 dims")
    check(tuple(gamma.shape) == tuple(self.shape[self.dim() - gamma.dim():]), "gamma must match the last dims")
    xf = self.to(torch.float32)
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.to(torch.float32)).to(self.dtype), rstd


def _rotate(x, mode):
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, -1)
        return torch.cat((-x2, x1), -1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)


@operator
def npu_rotary_mul(self, r1, r2, rotary_mode="half", rotate=None):
    """output = r1 * self + r2 * rotate(self); 'half' splits halves, 'interleave' pairs."""
    check(rotary_mode in ("half", "interleave"), f"rotary_mode {rotary_mode!r}")
    check(rotate is None, "rotate (a rotation matrix) is not emulated")
    check(self.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "self, r1, r2 must be 4-D")
    check(self.dtype in HALF_FLOAT and r1.dtype == self.dtype == r2.dtype, "dtypes must match")
    check(r1.shape == r2.shape, "r1 and r2 must have one shape")
    D = self.shape[-1]
    check(D % 2 == 0 and D < 896 and r1.shape[-1] == D, "D must be even, < 896, and shared")
    if rotary_mode == "interleave":  # r layouts: 11SD (BNSD), 1S1D (BSND), S11D (SBND)
        s = tuple(r1.shape[:3])
        layouts = {(1, 1, self.shape[2]): self.shape[0] * self.shape[1],
                   (1, self.shape[1], 1): self.shape[0] * self.shape[2],
                   (self.shape[0], 1, 1): self.shape[1] * self.shape[2]}
        check(s in layouts, f"interleave mode: r layout {tuple(r1.shape)} is not 11SD/1S1D/S11D for {tuple(self.shape)}")
        check(layouts[s] < 1000, "interleave mode needs B * N < 1000")
    return r1 * self + r2 * _rotate(self, rotary_mode)


@operator
def npu_clipped_swiglu(x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True):
    """The documented steps: x folded to [pre, cut * after] around ``dim``; rows past
    sum(group_index) skipped (their output is undefined: NaN here); A, B = even / odd elements
    (interleaved) or the two halves; A = min(A, limit), B = clamp(B, -limit, limit);
    y = A * sigmoid(alpha * A) * (B + bias), in fp32, cast to x.dtype, the ``dim`` size halved."""
    check(x.dtype in HALF_FLOAT, f"x dtype {x.dtype} not supported")
    check(x.dim() > 1 and x.is_contiguous(), "x must have more than 1 dim and be contiguous")
    check(-x.dim() <= dim < x.dim() and x.shape[dim] % 2 == 0, "dim must index x and its size must be even")
    d = dim % x.dim()
    pre = 1
    for s in x.shape[:d]:
        pre *= s
    flat = x.reshape(pre, -1).to(torch.float32)
    rows = pre
    if group_index is not None:
        check(group_index.dtype == torch.int64 and group_index.dim() == 1, "group_index must be int64 1-D")
        rows = int(group_index.sum())
        check(0 <= rows <= pre, "sum(group_index) must not exceed the folded rows")
    h = flat.shape[1] // 2
    a, b = (flat[:rows, ::2], flat[:rows, 1::2]) if interleaved else (flat[:rows, :h], flat[:rows, h:])
    a, b = a.clamp(max=limit), b.clamp(-limit, limit)
    y = torch.full((pre, h), float("nan"))
    y[:rows] = a * torch.sigmoid(alpha * a) * (b + bias)
    shape = list(x.shape)
    shape[d] //= 2
    return y.to(x.dtype).reshape(shape)


@operator
def npu_gather_sparse_index(input, index):
    """out = input[index] along dim 0: shape index.shape + input.shape[1:]."""
    check(input.dtype in GATHER_DTYPES, f"input dtype {input.dtype} not supported")
    check(index.dtype in (torch.int64, torch.int32) and index.dim() <= 8, "index must be int64/int32, <= 8 dims")
    check(input.dim() + index.dim() - 1 <= 8, "index.dim + input.dim - 1 must be <= 8")
    check(input.dim() >= 1, "a 0-dim input is not emulated")
    check(index.numel() == 0 or bool(((index >= 0) & (index < input.shape[0])).all()),
          "index values must lie in [0, input.shape[0] - 1] (no negative indices)")
    return input[index.long()]
