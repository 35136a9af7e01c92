"""Benchmarks of the attention family: ``sparse_attention`` on the released shapes.

64 heads x 512 (one latent is K and V, MQA), K = 128 window slots + 512 top-k slots; kv is the
model's tuple (fp8 window ring [B, 128, D], fp8 chunk [B, S, D], fp4_b16 compressed main KV
[B, context / 2, D]) read as stored. Decode: S = 1, B in {1, 8, 64}, contexts 4K / 64K / 128K / 1M;
prefill: B = 1, S = 4096 (context 128K).

- FLOPs ``4 B S H K D`` (QK^T and PV); bytes: q + out + indices + the gathered KV rows at their
  stored size (528 B per fp8 row, 288 B per fp4_b16 row). ~240 FLOP per byte: the bf16 ridge.
- Baseline: PyTorch SDPA on the equivalent dense attention, i.e. each query's K rows
  already gathered into a dense bf16 tensor (gather not timed), heads as the query rows of one
  KV head (MQA without expanding K/V), no sink. The torch reference op on the same GPU is in
  ``reference_ms`` / ``speedup_vs_reference``.

    python -m flashrt.bench.attention     # prints the rows as JSON (needs a CUDA device)
"""
from __future__ import annotations

import json

import torch

from . import common

DEVICE = "cuda"
H, D, WINDOW, TOPK = 64, 512, 128, 512
CONTEXTS = (4096, 65536, 131072, 1 << 20)


def _main_cache(B: int, T: int, g):
    """A random fp4_b16 cache built as stored bytes (no fp32 [B, T, D] intermediate at 1M)."""
    from flashrt.formats import QTensor

    data = torch.randint(0, 256, (B, T, D // 2), dtype=torch.uint8, device=DEVICE, generator=g)
    # E4M3 bytes 32..63: exponent 4..7, positive, values in [1/16, 1.875]
    scale = torch.randint(32, 64, (B, T, D // 16), dtype=torch.uint8, device=DEVICE, generator=g)
    return QTensor(data, scale.view(torch.float8_e4m3fn), "fp4_b16", (B, T, D))


def _inputs(B: int, S: int, context: int, g):
    from flashrt import formats

    Tc = context // 2
    q = (torch.randn(B, S, H, D, device=DEVICE, generator=g) * 0.5).to(torch.bfloat16)
    ring = formats.quantize(torch.randn(B, WINDOW, D, device=DEVICE, generator=g), "fp8")
    chunk = formats.quantize(torch.randn(B, S, D, device=DEVICE, generator=g), "fp8")
    window = torch.randint(0, WINDOW + S, (B, S, WINDOW), device=DEVICE, generator=g)
    topk = torch.randint(0, Tc, (B, S, TOPK), device=DEVICE, generator=g).sort(-1).values + WINDOW + S
    idx = torch.cat([window, topk], -1).to(torch.int32)
    sink = torch.randn(H, device=DEVICE, generator=g)
    return q, (ring, chunk, _main_cache(B, Tc, g)), idx, sink


def _bytes(q, kv, idx) -> int:
    """q + out + indices + each valid slot's row at its stored size."""
    total, start = 2 * q.numel() * q.element_size() + idx.numel() * idx.element_size(), 0
    for seg in kv:
        n = seg.shape[1]
        row = (seg.data[0, 0].numel() * seg.data.element_size() + seg.scale[0, 0].numel())
        total += int(((idx >= start) & (idx < start + n)).sum()) * row
        start += n
    return total


def _sdpa_inputs(q, kv, idx):
    """Dense equivalent: per query, its K rows gathered as bf16 [B*S, 1, K, D]; heads as rows."""
    from flashrt.refmath_attention import gather_rows

    B, S, _, _ = q.shape
    rows = gather_rows(kv, idx.clamp_min(0).long()).to(torch.bfloat16)  # [B, S, K, D]
    return q.reshape(B * S, 1, H, D), rows.reshape(B * S, 1, -1, D)


def _case(rows, ceil, B, S, context, g, scale):
    from flashrt.backends import reference as ref
    from flashrt.kernels_cuda import attention

    q, kv, idx, sink = _inputs(B, S, context, g)
    ms = common.bench_ms(lambda: attention.sparse_attention(q, kv, idx, sink, scale))
    ref_ms = common.bench_ms(lambda: ref.sparse_attention(q, kv, idx, sink, scale))
    qd, kd = _sdpa_inputs(q, kv, idx)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = common.bench_ms(lambda: sdpa(qd, kd, kd, scale=scale))
    kernel, splits = attention.planned_splits(q, idx.shape[-1], tuple(attention.FMT_CODES[t.fmt] for t in kv))
    kind = "decode" if S == 1 else "prefill"
    rows.append(common.row(
        f"sparse_attention {kind}", f"B={B} S={S} ctx={context} H={H} D={D} K={idx.shape[-1]} fp8+fp4_b16",
        ms, 4.0 * B * S * H * idx.shape[-1] * D, _bytes(q, kv, idx), ceil,
        baseline="SDPA dense bf16 (pre-gathered)", baseline_ms=sdpa_ms,
        reference_ms=ref_ms, speedup_vs_reference=ref_ms / ms, splits=splits, attention_kernel=kernel,
        target_roofline_fraction=0.6))
    del q, kv, idx, qd, kd
    torch.cuda.empty_cache()


def run(ceil) -> list[dict]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    rows: list[dict] = []
    scale = D ** -0.5
    for context in CONTEXTS:
        for B in (1, 8, 64):
            _case(rows, ceil, B, 1, context, g, scale)
    _case(rows, ceil, 1, 4096, 131072, g, scale)
    return rows


if __name__ == "__main__":
    print(json.dumps(run(common.Ceilings.measure()), indent=2))
