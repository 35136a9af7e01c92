"""Emulated npu_moe_init_routing_v2 and npu_moe_finalize_routing: the MoE dispatch and combine
(torch_npu 2.14.0 schemas; math from the documented equivalent computation, dropless mode)."""
from __future__ import annotations

import torch

from ._emulated import check, operator

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INT32_MAX = 2**31 - 1


def _expert_range(active_expert_range, expert_num):
    if not active_expert_range:
        return 0, expert_num
    check(len(active_expert_range) == 2, "active_expert_range must be int[2]")
    start, end = active_expert_range
    check(0 <= start < end <= expert_num, "active_expert_range must be increasing within [0, expert_num]")
    return start, end


@operator
def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=[], row_idx_type=0, x_dtype=None):  # noqa: B006 (schema default)
    """(expanded_x, expanded_row_idx, expert_token_count, expanded_scale), dropless, no quantization.

    The flat ``expert_idx [N, K]`` (row-major: source row ``n * K + k``) is sorted by expert,
    stably; ``expanded_x[i] = x[sorted[i] // K]``; ``expanded_row_idx[sorted[i]] = i`` (gather
    type, -1 for experts outside the active range) or ``= sorted`` (scatter type); the count per
    active expert. Rows past the valid ones and ``expanded_scale`` without a ``scale``: NaN."""
    check(x.dim() == 2 and x.dtype in FLOATS + (torch.int8,), "x must be 2-D float16/bfloat16/float32/int8")
    check(expert_idx.dim() == 2 and expert_idx.dtype == torch.int32, "expert_idx must be 2-D int32")
    check(x.shape[0] == expert_idx.shape[0], "x and expert_idx must have the same rows")
    check(drop_pad_mode == 0, "only the dropless mode (drop_pad_mode 0) is supported")
    check(expert_tokens_num_flag and expert_tokens_num_type == 1, "count output (type 1, flag True) is what is emulated")
    check(0 < expert_num <= 10240, "expert_num must be in (0, 10240]")
    check(quant_mode == -1 and scale is None and offset is None and x_dtype is None, "only the non-quantized mode is emulated")
    check(row_idx_type in (0, 1) and active_num >= -1, "row_idx_type in {0, 1}, active_num >= -1")
    N, K = expert_idx.shape
    check(bool(((expert_idx >= 0) & (expert_idx < expert_num)).all()), "expert ids must be in [0, expert_num)")
    start, end = _expert_range(active_expert_range, expert_num)
    flat = expert_idx.reshape(-1).long()
    key = torch.where(flat < start, INT32_MAX, flat)
    order = torch.argsort(key, stable=True)
    available = int(((flat >= start) & (flat < end)).sum())
    rows = N * K if active_num <= 0 else min(active_num, N * K)
    valid = min(rows, available)
    if row_idx_type == 0:
        row_idx = torch.full((N * K,), -1, dtype=torch.int32)
        row_idx[order[:available]] = torch.arange(available, dtype=torch.int32)
    else:
        row_idx = torch.cat((order[:available], torch.full((N * K - available,), -1))).to(torch.int32)
    fill = float("nan") if x.dtype in FLOATS else 0
    expanded = torch.full((rows, x.shape[1]), fill, dtype=x.dtype)
    expanded[:valid] = x[order[:valid] // K]
    counts = torch.bincount(flat[(flat >= start) & (flat < end)] - start, minlength=end - start)
    return expanded, row_idx, counts.to(torch.int64), torch.full((rows,), float("nan"))


def _check_finalize(rows, skip1, skip2, bias, scales, src, experts, drop_pad_mode, k):
    check(rows.dim() == 2 and rows.dtype in FLOATS, "expanded_permuted_rows must be 2-D float16/bfloat16/float32")
    check(drop_pad_mode in (0, 2), "only the dropless modes (0: column-major, 2: row-major) are emulated")
    check(src.dim() == 1 and src.dtype == torch.int32 and src.shape[0] == rows.shape[0],
          "expanded_src_to_dst_row must be int32 [NUM_ROWS * K]")
    K = scales.shape[1] if scales is not None else k
    check(K >= 1 and src.shape[0] % K == 0, "k must divide the expanded rows")
    N = src.shape[0] // K
    check(bool(((src >= 0) & (src < rows.shape[0])).all()), "expanded_src_to_dst_row values in [0, NUM_ROWS * K - 1]")
    check((skip1 is None) == (skip2 is None), "skip1 and skip2 are given together or both None")
    for name, t in (("skip1", skip1), ("skip2", skip2)):
        check(t is None or (t.shape == (N, rows.shape[1]) and t.dtype == rows.dtype), f"{name} must be [NUM_ROWS, H]")
    check(scales is None or (scales.dim() == 2 and scales.shape[0] == N and scales.dtype == rows.dtype),
          "scales must be [NUM_ROWS, K] in the dtype of expanded_permuted_rows")
    if bias is not None:
        check(bias.dim() == 2 and bias.shape[1] == rows.shape[1] and bias.dtype == rows.dtype, "bias must be [E, H]")
        check(experts is not None and experts.shape == (N, K) and experts.dtype == torch.int32,
              "a bias needs export_for_source_row int32 [NUM_ROWS, K]")
    return N, K


@operator
def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    """out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[src_to_dst[j]] + bias[expert[i, k]]),
    j = k * NUM_ROWS + i (drop_pad_mode 0) or i * K + k (2); scales 1 when None. fp32, cast to the
    dtype of ``expanded_permuted_rows``."""
    rows = expanded_permuted_rows
    N, K = _check_finalize(rows, skip1, skip2, bias, scales, expanded_src_to_dst_row, export_for_source_row,
                           drop_pad_mode, k)
    src = expanded_src_to_dst_row.long()
    src = src.view(K, N).t() if drop_pad_mode == 0 else src.view(N, K)  # [N, K]
    picked = rows.to(torch.float32)[src]  # [N, K, H]
    if bias is not None:
        picked = picked + bias.to(torch.float32)[export_for_source_row.long()]
    if scales is not None:
        picked = picked * scales.to(torch.float32).unsqueeze(-1)
    out = torch.zeros(N, rows.shape[1])
    for j in range(K):
        out += picked[:, j]
    if skip1 is not None:
        out = skip1.to(torch.float32) + skip2.to(torch.float32) + out
    return out.to(rows.dtype)
