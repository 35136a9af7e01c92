"""Emulated npu_moe_gating_top_k and npu_grouped_matmul (documented forms)."""
from __future__ import annotations

import torch

from . import _check, _record


def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                         norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """(yOut, expertIdxOut int32, normOut fp32): norm (0 softmax, 1 sigmoid), top-k of norm + bias,
    y = picked norm / (sum + eps) * routed_scaling_factor. Ties go to the higher index (see module)."""
    _record("npu_moe_gating_top_k", x=x, k=k, bias=bias, k_group=k_group, group_count=group_count,
            group_select_mode=group_select_mode, renorm=renorm, norm_type=norm_type, out_flag=out_flag,
            routed_scaling_factor=routed_scaling_factor, eps=eps)
    _check(x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32), "x must be 2-D float")
    E = x.shape[-1]
    _check(E <= 2048 and E % group_count == 0 and E // group_count > 2, "expert count constraints")
    _check(1 <= k <= E // group_count * k_group and renorm == 0, "k / renorm constraints")
    _check(bias is None or (bias.shape == (E,) and bias.dtype == x.dtype), "bias must be [E] in x.dtype")
    _check(group_count == 1, "grouped selection not emulated")
    xf = x.to(torch.float32)
    norm = torch.sigmoid(xf) if norm_type == 1 else torch.softmax(xf, -1)
    key = norm if bias is None else norm + bias.to(torch.float32)
    flipped = key.flip(-1)  # a stable descending sort of the flipped row: ties to the higher index
    idx = E - 1 - torch.sort(flipped, dim=-1, descending=True, stable=True).indices[..., :k]
    picked = norm.gather(-1, idx)
    y = picked / (picked.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), norm if out_flag else norm.new_empty(0)


def _groups(group_list, group_list_type, m):
    sizes = group_list.tolist()
    if group_list_type == 0:
        sizes = [b - a for a, b in zip([0] + sizes[:-1], sizes)]
    _check(group_list_type in (0, 1) and all(s >= 0 for s in sizes) and sum(sizes) == m, "group_list must cover M")
    return sizes


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    """Single x [M, K], single weight [E, K, N], groups along M (group_type 0), one output [M, N].

    Non-quantized: y_i = x_i @ w_i. Per-token quantized (int8): y_i = (x_i @ w_i) * scale_i * pertoken_i."""
    _record("npu_grouped_matmul", x=x, weight=weight, bias=bias, scale=scale, offset=offset,
            antiquant_scale=antiquant_scale, per_token_scale=per_token_scale, group_list=group_list,
            split_item=split_item, group_type=group_type, group_list_type=group_list_type, act_type=act_type,
            output_dtype=output_dtype)
    _check(isinstance(x, list) and isinstance(weight, list) and len(x) == 1 and len(weight) == 1, "single-single here")
    x0, w0 = x[0], weight[0]
    _check(x0.dim() == 2 and w0.dim() == 3 and x0.shape[1] == w0.shape[1], "x [M, K], weight [E, K, N]")
    _check(group_type == 0 and split_item in (2, 3) and isinstance(group_list, torch.Tensor), "single-single-single mode")
    _check(group_list.dtype == torch.int64 and group_list.shape == (w0.shape[0],), "group_list int64 [E]")
    _check(bias is None and offset is None and antiquant_scale is None and act_type == 0, "not emulated")
    _check(x0.is_contiguous(), "x does not support transposition")
    sizes = _groups(group_list, group_list_type, x0.shape[0])
    quant = x0.dtype == torch.int8
    if quant:
        _check(w0.dtype == torch.int8 and scale is not None and per_token_scale is not None, "pertoken quant inputs")
        s0, t0 = scale[0], per_token_scale[0]
        _check(s0.shape == (w0.shape[0], w0.shape[2]), "scale [E, N]")
        _check(t0.dtype == torch.float32 and t0.shape == (x0.shape[0],), "per_token_scale fp32 [M]")
        want = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}
        _check(want.get(s0.dtype) == output_dtype, f"pertoken: scale {s0.dtype} with output {output_dtype}")
    else:
        _check(x0.dtype == w0.dtype and x0.dtype in (torch.float16, torch.bfloat16, torch.float32), "dtypes")
        _check(output_dtype in (None, x0.dtype), "output dtype of x")
    out = torch.empty(x0.shape[0], w0.shape[2], dtype=output_dtype or x0.dtype)
    start = 0
    for e, n in enumerate(sizes):
        xe = x0[start:start + n]
        if quant:
            acc = (xe.to(torch.float64) @ w0[e].to(torch.float64)).to(torch.float32)
            ye = acc * s0[e].to(torch.float32) * t0[start:start + n].unsqueeze(-1)
        else:
            ye = xe.to(torch.float32) @ w0[e].to(torch.float32)
        out[start:start + n] = ye.to(out.dtype)
        start += n
    return [out]
