"""Emulated npu_rms_norm, npu_rotary_mul, npu_dynamic_quant, npu_quant_matmul (documented forms)."""
from __future__ import annotations

import torch

from . import _check, _record

HALF_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def npu_rms_norm(self, gamma, epsilon=1e-06):
    """(y, rstd): y = x * rsqrt(mean(x**2, -1) + eps) * gamma in fp32, cast to x.dtype."""
    _record("npu_rms_norm", self=self, gamma=gamma, epsilon=epsilon)
    _check(self.dtype in HALF_FLOAT, f"self dtype {self.dtype} not supported")
    _check(gamma.dtype == self.dtype, "gamma must have the dtype of self")
    _check(2 <= self.dim() <= 8, "self must have 2-8 dims")
    _check(tuple(gamma.shape) == tuple(self.shape[self.dim() - gamma.dim():]), "gamma must match the last dims")
    xf = self.to(torch.float32)
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.to(torch.float32)).to(self.dtype), rstd


def _rotate(x, mode):
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, -1)
        return torch.cat((-x2, x1), -1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """output = r1 * input + r2 * rotate(input); 'half' splits halves, 'interleave' pairs."""
    _record("npu_rotary_mul", input=input, r1=r1, r2=r2, rotary_mode=rotary_mode)
    _check(rotary_mode in ("half", "interleave"), f"rotary_mode {rotary_mode!r}")
    _check(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "input, r1, r2 must be 4-D")
    _check(input.dtype in HALF_FLOAT and r1.dtype == input.dtype == r2.dtype, "dtypes must match")
    _check(r1.shape == r2.shape, "r1 and r2 must have one shape")
    D = input.shape[-1]
    _check(D % 2 == 0 and D < 896 and r1.shape[-1] == D, "D must be even, < 896, and shared")
    if rotary_mode == "interleave":  # r layouts: 11SD (BNSD), 1S1D (BSND), S11D (SBND)
        s = tuple(r1.shape[:3])
        layouts = {(1, 1, input.shape[2]): input.shape[0] * input.shape[1],
                   (1, input.shape[1], 1): input.shape[0] * input.shape[2],
                   (input.shape[0], 1, 1): input.shape[1] * input.shape[2]}
        _check(s in layouts, f"interleave mode: r layout {tuple(r1.shape)} is not 11SD/1S1D/S11D for {tuple(input.shape)}")
        _check(layouts[s] < 1000, "interleave mode needs B * N < 1000")
    return r1 * input + r2 * _rotate(input, rotary_mode)


def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    """(y int8, scale fp32 [...]): per-token symmetric, scale = row_max(|x|) / 127, y = round(x / scale).

    round: nearest, ties to even (assumed; the formula says round). 0 / 0 rows: -128 (see module).
    """
    _record("npu_dynamic_quant", x=x, smooth_scales=smooth_scales, group_index=group_index, dst_type=dst_type)
    _check(x.dtype in (torch.float16, torch.bfloat16), "x must be float16 or bfloat16")
    _check(x.dim() > 1, "x must have more than 1 dim")
    _check(smooth_scales is None and group_index is None and dst_type in (None, torch.int8), "int8 only here")
    xf = x.to(torch.float32)
    scale = xf.abs().amax(-1) / 127.0
    y = torch.round(xf / scale.unsqueeze(-1))
    y = torch.nan_to_num(y, nan=-128.0).clamp(-128, 127).to(torch.int8)
    return y, scale


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None):
    """(x1 @ x2) accumulated in int32, times scale [n] (and pertoken_scale [m]), as output_dtype."""
    _record("npu_quant_matmul", x1=x1, x2=x2, scale=scale, offset=offset, pertoken_scale=pertoken_scale,
            bias=bias, output_dtype=output_dtype)
    _check(x1.dtype == torch.int8 and x2.dtype == torch.int8, "x1 and x2 must be int8 here")
    _check(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, "x1, x2 must have 2-6 dims")
    m, k = x1.shape[-2:]
    k2, n = x2.shape[-2:]
    _check(k == k2, f"K mismatch {k} vs {k2}")
    _check(scale.dim() == 1 and scale.shape[0] in (1, n), "scale must be [1] or [n]")
    _check(scale.dtype in (torch.float32, torch.bfloat16), "scale float32 / bfloat16 here (int64 needs trans_quant_param)")
    _check(offset is None and bias is None, "offset / bias not emulated")
    if pertoken_scale is not None:
        _check(pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == (m,), "pertoken_scale must be fp32 [m]")
        ok = {torch.bfloat16: (torch.float32, torch.bfloat16), torch.float16: (torch.float32,)}
        _check(scale.dtype in ok.get(output_dtype, ()), f"pertoken: output {output_dtype} with scale {scale.dtype}")
    acc = (x1.to(torch.float64) @ x2.to(torch.float64)).to(torch.float32)  # exact int32 sums
    out = acc * scale.to(torch.float32)
    if pertoken_scale is not None:
        out = out * pertoken_scale.unsqueeze(-1)
    return out.to(output_dtype or torch.int8)
