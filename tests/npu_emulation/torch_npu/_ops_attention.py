"""Emulated npu_sparse_flash_attention (torch_npu 2.14.0 schema; documented form: MLA-absorb, BSND,
D 512 + rope 64)."""
from __future__ import annotations

import torch

from ._emulated import check as _check, operator

HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def _check_indices(idx, s2):
    _check(idx.dtype == torch.int32 and idx.is_contiguous(), "sparse_indices must be contiguous int32")
    valid = idx >= 0
    # valid values first, invalid (-1) after: once a row is invalid it stays invalid
    _check(bool((valid[..., 1:] <= valid[..., :-1]).all()), "sparse_indices: valid entries must come first")
    _check(bool((idx[valid] < s2).all()) and bool((idx[~valid] == -1).all()), "sparse_indices out of range")


@operator
def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                               key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                               sparse_mode=3, pre_tokens=9223372036854775807, next_tokens=9223372036854775807,
                               attention_mode=0, return_softmax_lse=False, sinks=None):
    """softmax(scale * [q, q_rope] . [k, k_rope]^T over the indexed entries) @ v -> [B, S1, N1, 512].

    Rows with no valid index: NaN (see module). sparse_mode 3 masks entries past S2 - S1 + s."""
    _check(value is not None and sinks is None, "value=None (CANN >= 9.2) and sinks are not emulated")
    _check(actual_seq_lengths_query is None and actual_seq_lengths_kv is None, "actual lengths are not emulated")
    _check(pre_tokens == next_tokens == 2**63 - 1, "pre_tokens / next_tokens take only their defaults")
    _check(layout_query == "BSND" and layout_kv == "BSND" and block_table is None, "BSND without paging here")
    _check(attention_mode == 2 and query_rope is not None and key_rope is not None, "attention_mode 2 needs ropes")
    _check(query.dtype in (torch.bfloat16, torch.float16), "bf16 / fp16 only")
    _check(key.dtype == query.dtype == value.dtype == query_rope.dtype == key_rope.dtype, "one dtype")
    B, S1, N1, D = query.shape
    _check(D == 512 and N1 in HEADS and query.is_contiguous(), "query [B, S1, N1, 512], N1 a power of 2 <= 128")
    _check(key.dim() == 4 and key.shape[0] == B and key.shape[2:] == (1, 512), "key [B, S2, 1, 512]")
    _check(value.shape == key.shape and key.is_contiguous() and value.is_contiguous(), "value like key")
    S2 = key.shape[1]
    _check(query_rope.shape == (B, S1, N1, 64) and key_rope.shape == (B, S2, 1, 64), "rope parts of 64")
    _check(query_rope.is_contiguous() and key_rope.is_contiguous(), "rope parts must be contiguous")
    _check(sparse_indices.shape[:3] == (B, S1, 1) and sparse_indices.shape[3] > 0, "sparse_indices [B, S1, 1, K]")
    _check(sparse_block_size == 1 and sparse_mode in (0, 3) and not return_softmax_lse, "token-wise, inference")
    _check_indices(sparse_indices, S2)
    idx = sparse_indices[:, :, 0]  # [B, S1, K]
    valid = idx >= 0
    if sparse_mode == 3:  # rightDownCausal
        limit = S2 - S1 + torch.arange(S1).view(1, S1, 1)
        valid = valid & (idx <= limit)
    g = idx.clamp_min(0).long()
    batch = torch.arange(B).view(B, 1, 1)
    k_full = torch.cat((key[:, :, 0], key_rope[:, :, 0]), -1).to(torch.float32)[batch, g]  # [B, S1, K, 576]
    q_full = torch.cat((query, query_rope), -1).to(torch.float32)  # [B, S1, N1, 576]
    logits = torch.einsum("bshd,bskd->bshk", q_full, k_full) * scale_value
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    p = torch.softmax(logits, -1)  # all -inf: NaN
    out = torch.einsum("bshk,bskd->bshd", p, value[:, :, 0].to(torch.float32)[batch, g])
    return out.to(query.dtype), torch.empty(0), torch.empty(0)


@operator
def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647,
                         inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None,
                         seed=0, offset=0):
    """softmax(scale * q k^T) v per head (no mask, BSND here) -> (attention_out, softmax_max,
    softmax_sum [B, N, S, 8] fp32, softmax_out (empty), seed, offset, numels)."""
    _check(input_layout == "BSND" and pse is None and atten_mask is None and padding_mask is None
           and sink is None and dropout_mask is None, "BSND without mask, pse, sink or dropout here")
    _check(query.dtype in (torch.bfloat16, torch.float16), "bf16 / fp16 only")
    _check(key.dtype == query.dtype == value.dtype, "one dtype")
    _check(keep_prob == 1.0 and sparse_mode == 0, "inference: keep_prob 1, sparse_mode 0")
    B, S, N, D = query.shape
    _check(N == head_num and D % 16 == 0 and D <= 512, "query [B, S, head_num, D], D % 16 == 0, D <= 512")
    _check(key.dim() == 4 and key.shape[0] == B and key.shape[2:] == (N, D) and value.shape == key.shape,
           "key / value [B, T, head_num, D]")
    _check(query.is_contiguous() and key.is_contiguous() and value.is_contiguous(), "contiguous inputs")
    logits = torch.einsum("bshd,bthd->bhst", query.float(), key.float()) * scale
    out = torch.einsum("bhst,bthd->bshd", torch.softmax(logits, -1), value.float())
    row_max = logits.amax(-1, keepdim=True)  # softmax statistics [B, N, S, 8] (the value repeated 8 times)
    row_sum = torch.exp(logits - row_max).sum(-1, keepdim=True)
    return (out.to(query.dtype), row_max.expand(-1, -1, -1, 8).contiguous(), row_sum.expand(-1, -1, -1, 8).contiguous(),
            torch.empty(0, dtype=query.dtype), 0, 0, 0)
