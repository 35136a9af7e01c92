"""Emulated npu_dynamic_quant and npu_quant_matmul (torch_npu 2.14.0 schemas, documented forms)."""
from __future__ import annotations

import torch

from ._emulated import check, operator, scalar_type


@operator
def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    """(y int8, scale fp32 [...]): per-token symmetric, scale = row_max(|x|) / 127, y = round(x / scale).

    round: nearest, ties to even (assumed; the formula says round). 0 / 0 rows: -128 (see the
    package docstring)."""
    check(input.dtype in (torch.float16, torch.bfloat16), "input must be float16 or bfloat16")
    check(input.dim() > 1, "input must have more than 1 dim")
    check(smooth_scales is None and group_index is None, "smooth_scales / group_index are not emulated")
    check(scalar_type(dst_type) in (None, torch.int8) and quant_mode == "pertoken", "int8 per token only here")
    xf = input.to(torch.float32)
    scale = xf.abs().amax(-1) / 127.0
    y = torch.round(xf / scale.unsqueeze(-1))
    y = torch.nan_to_num(y, nan=-128.0).clamp(-128, 127).to(torch.int8)
    return y, scale


@operator
def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
                     y_scale=None):
    """(x1 @ x2) accumulated in int32, times scale [n] (and pertoken_scale [m]), as output_dtype."""
    out_dtype = scalar_type(output_dtype)
    check(x1.dtype == torch.int8 and x2.dtype == torch.int8, "x1 and x2 must be int8 here")
    check(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, "x1, x2 must have 2-6 dims")
    m, k = x1.shape[-2:]
    k2, n = x2.shape[-2:]
    check(k == k2, f"K mismatch {k} vs {k2}")
    check(scale.dim() == 1 and scale.shape[0] in (1, n), "scale must be [1] or [n]")
    check(scale.dtype in (torch.float32, torch.bfloat16), "scale float32 / bfloat16 here (int64 needs trans_quant_param)")
    check(offset is None and bias is None and y_scale is None and group_sizes is None, "offset / bias / y_scale / groups not emulated")
    check(x1_dtype is None and x2_dtype is None and scale_dtype is None and pertoken_scale_dtype is None,
          "the *_dtype overrides (int4 / fp4 / hifloat8 inputs) are not emulated")
    if pertoken_scale is not None:
        check(pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == (m,), "pertoken_scale must be fp32 [m]")
        ok = {torch.bfloat16: (torch.float32, torch.bfloat16), torch.float16: (torch.float32,)}
        check(scale.dtype in ok.get(out_dtype, ()), f"pertoken: output {out_dtype} with scale {scale.dtype}")
    acc = (x1.to(torch.float64) @ x2.to(torch.float64)).to(torch.float32)  # exact int32 sums
    out = acc * scale.to(torch.float32)
    if pertoken_scale is not None:
        out = out * pertoken_scale.unsqueeze(-1)
    return out.to(out_dtype or torch.int8)
