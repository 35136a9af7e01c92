"""Emulated npu_moe_gating_top_k and npu_grouped_matmul (torch_npu 2.14.0 schemas, documented forms).
The MoE dispatch / combine pair (npu_moe_init_routing_v2, npu_moe_finalize_routing) is in
``_ops_routing``."""
from __future__ import annotations

import torch

from ._emulated import check, operator, scalar_type


@operator
def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """(yOut, expertIdxOut int32, normOut fp32): norm (0 softmax, 1 sigmoid), top-k of norm + bias,
    y = picked norm / (sum + eps) * routed_scaling_factor. Ties go to the higher index (see the
    package docstring)."""
    check(x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32), "x must be 2-D float")
    check(input_ids is None and tid2eid is None, "hash routing (input_ids / tid2eid) is not emulated")
    E = x.shape[-1]
    check(E <= 2048 and E % group_count == 0 and E // group_count > 2, "expert count constraints")
    check(1 <= k <= E // group_count * k_group and renorm == 0, "k / renorm constraints")
    check(bias is None or (bias.shape == (E,) and bias.dtype == x.dtype), "bias must be [E] in x.dtype")
    check(group_count == 1, "grouped selection not emulated")
    xf = x.to(torch.float32)
    norm = torch.sigmoid(xf) if norm_type == 1 else torch.softmax(xf, -1)
    key = norm if bias is None else norm + bias.to(torch.float32)
    flipped = key.flip(-1)  # a stable descending sort of the flipped row: ties to the higher index
    idx = E - 1 - torch.sort(flipped, dim=-1, descending=True, stable=True).indices[..., :k]
    picked = norm.gather(-1, idx)
    y = picked / (picked.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    # normOut keeps its documented [N, E] shape when out_flag is False (values unspecified: NaN)
    return y.to(x.dtype), idx.to(torch.int32), norm if out_flag else torch.full_like(norm, float("nan"))


def _groups(group_list, group_list_type, m):
    sizes = group_list.tolist()
    if group_list_type == 0:
        sizes = [b - a for a, b in zip([0] + sizes[:-1], sizes)]
    check(group_list_type in (0, 1) and all(s >= 0 for s in sizes) and sum(sizes) == m, "group_list must cover M")
    return sizes


def _check_quant(x0, w0, scale, per_token_scale, output_dtype):
    check(w0.dtype == torch.int8 and scale is not None and per_token_scale is not None, "pertoken quant inputs")
    s0, t0 = scale[0], per_token_scale[0]
    check(s0.shape == (w0.shape[0], w0.shape[2]), "scale [E, N]")
    check(t0.dtype == torch.float32 and t0.shape == (x0.shape[0],), "per_token_scale fp32 [M]")
    want = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}
    check(want.get(s0.dtype) == output_dtype, f"pertoken: scale {s0.dtype} with output {output_dtype}")
    return s0, t0


@operator
def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None):
    """Single x [M, K], single weight [E, K, N], groups along M (group_type 0), one output [M, N].

    Non-quantized: y_i = x_i @ w_i. Per-token quantized (int8): y_i = (x_i @ w_i) * scale_i * pertoken_i."""
    out_dtype = scalar_type(output_dtype)
    check(isinstance(x, list) and isinstance(weight, list) and len(x) == 1 and len(weight) == 1, "single-single here")
    x0, w0 = x[0], weight[0]
    check(x0.dim() == 2 and w0.dim() == 3 and x0.shape[1] == w0.shape[1], "x [M, K], weight [E, K, N]")
    check(group_type == 0 and split_item in (2, 3) and isinstance(group_list, torch.Tensor), "single-single-single mode")
    check(group_list.dtype == torch.int64 and group_list.shape == (w0.shape[0],), "group_list int64 [E]")
    check(bias is None and offset is None and antiquant_scale is None and act_type == 0, "not emulated")
    check(x_dtype is None and weight_dtype is None and scale_dtype is None and per_token_scale_dtype is None,
          "the *_dtype overrides (hifloat8 / mxfp4 inputs) are not emulated")
    check(x0.is_contiguous(), "x does not support transposition")
    sizes = _groups(group_list, group_list_type, x0.shape[0])
    quant = x0.dtype == torch.int8
    if quant:
        s0, t0 = _check_quant(x0, w0, scale, per_token_scale, out_dtype)
    else:
        check(x0.dtype == w0.dtype and x0.dtype in (torch.float16, torch.bfloat16, torch.float32), "dtypes")
        check(out_dtype in (None, x0.dtype), "output dtype of x")
    out = torch.empty(x0.shape[0], w0.shape[2], dtype=out_dtype or x0.dtype)
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
