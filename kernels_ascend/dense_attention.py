"""dense_attention on torch_npu.npu_fusion_attention (FlashAttention on the AI cores).

With no mask, no positional bias, ``keep_prob = 1`` and ``BSND`` layout the operator computes
``softmax(scale * q k^T) v`` per head with fp32 softmax statistics: the op's math. It takes bf16 /
fp16 and head dims that are multiples of 16 up to 512; other calls (fp32, other head dims) run
the reference math in plain torch on the device (counted as fallbacks).
"""
from __future__ import annotations

import torch

from flashrt import refmath as ref

from .npu_runtime import fallback, npu_family, operator

FA_DTYPES = (torch.bfloat16, torch.float16)
FA_MAX_D = 512


def dense_attention_plan(q, k, v, scale) -> str | None:
    D = q.shape[-1]
    if q.dtype not in FA_DTYPES:
        return f"npu_fusion_attention takes bf16 / fp16, got {q.dtype}"
    if D % 16 or D > FA_MAX_D:
        return f"npu_fusion_attention needs a head dim that is a multiple of 16 up to {FA_MAX_D}, got {D}"
    if q.shape[1] == 0:
        return "no query (S == 0)"
    return None


def dense_attention(q, k, v, scale):
    """``dense_attention``: one npu_fusion_attention call in BSND layout (module doc)."""
    reason = dense_attention_plan(q, k, v, scale)
    if reason is not None:
        fallback("dense_attention", reason)
        return ref.dense_attention(q, k, v, scale)
    fusion_attention = operator("dense_attention", "npu_fusion_attention")
    out = fusion_attention(q.contiguous(), k.contiguous(), v.contiguous(), q.shape[2], "BSND",
                           scale=float(scale), keep_prob=1.0)[0]
    return out.to(q.dtype)


PLANS = {"dense_attention": dense_attention_plan}


FAMILY = npu_family("dense_attention", {"dense_attention": dense_attention},
                    "bidirectional attention (npu_fusion_attention)")
