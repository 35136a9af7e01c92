"""Every torch_npu operator path of the Ascend backend, run once on fresh random inputs.

:func:`exercise_backend` runs each op through ``use_backend("ascend")`` with inputs that reach each
operator call the adapters make (and each dtype / format variant of it), under the emulated
torch_npu (fixture ``npu_emulation``), and returns the recorded operator calls.
"""
from __future__ import annotations

import sys

import torch

import flashrt
from flashrt import formats


def _attention(ops, g):
    B, S, H, T, K = 2, 3, 4, 24, 8
    q = torch.randn(B, S, H, 512, generator=g).bfloat16()
    kv = torch.randn(B, T, 512, generator=g)
    idx = torch.randint(0, T, (B, S, K), generator=g, dtype=torch.int32)
    idx[torch.rand(B, S, K, generator=g) < 0.3] = -1
    sink = torch.randn(H, generator=g)
    ops.sparse_attention(q, kv.bfloat16(), idx, None, 0.05)
    ops.sparse_attention(q, kv.bfloat16(), idx, sink, 0.05)
    ops.sparse_attention(q.half(), kv.half(), idx, sink, 0.05)
    window, main = formats.quantize(kv[:, :8], "int8"), formats.quantize(kv[:1, 8:], "fp4_b16")
    ops.sparse_attention(q, (window, main), idx, sink, 0.05)  # quantized segments, one shared (batch 1)


def _moe(ops, g):
    N, D, I, E, k = 9, 64, 32, 6, 2
    x = torch.randn(N, D, generator=g).bfloat16()
    w = torch.randn(E, D, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    ops.moe_route(x, w, bias, k, "sigmoid", True, 2.5)
    ops.moe_route(x, w, None, k, "softmax", False, 1.0)
    weights = torch.rand(N, k, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(torch.int32)
    ws = [torch.randn(E, I, D, generator=g) * 0.2, torch.randn(E, I, D, generator=g) * 0.2,
          torch.randn(E, D, I, generator=g) * 0.2]
    for dtype in (torch.bfloat16, torch.float16):
        ops.moe_experts(x.to(dtype), weights, idx, *[t.to(dtype) for t in ws], 0.8)
    q8 = [formats.quantize(t, "int8_w") for t in ws]
    ops.moe_experts(x, weights, idx, *q8, 0.8)
    ops.moe_experts(x.half(), weights, idx, *q8, 0.0)  # no clamp: the activation in plain torch


def exercise_backend(g: torch.Generator) -> list:
    """Run the ascend backend's operator paths; the emulation's recorded calls, oldest first."""
    emulated = sys.modules["torch_npu"]
    emulated.CALLS.clear()
    ops = flashrt.ops
    with flashrt.use_backend("ascend"):
        for shape in ((3, 64), (64,), (2, 5, 96)):
            x = torch.randn(shape, generator=g).bfloat16()
            ops.rms_norm(x, torch.randn(shape[-1], generator=g).bfloat16(), 1e-5)
        ang = torch.rand(5, 8, generator=g) * 6
        ops.rope(torch.randn(2, 5, 3, 16, generator=g).bfloat16(), torch.polar(torch.ones_like(ang), ang), False)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(2, 5, 96, generator=g).to(dtype)
            ops.quantize(x, "int8_t")
            ops.linear(x, formats.quantize(torch.randn(40, 96, generator=g), "int8_w"))
        _attention(ops, g)
        _moe(ops, g)
        for dtype in (torch.bfloat16, torch.float16):  # dense_attention: npu_fusion_attention
            q, k, v = (torch.randn(2, s, 3, 32, generator=g).to(dtype) for s in (5, 7, 7))
            ops.dense_attention(q, k, v, 32**-0.5)
        table = formats.quantize(torch.randn(40, 64, generator=g) * 3, "fp8")
        ops.engram_lookup(table, torch.randint(0, 40, (2, 3, 4), generator=g))
    return list(emulated.CALLS)
