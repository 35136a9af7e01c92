"""Benchmarks of the indexer family: ``index_scores``, ``topk_positions``, ``candidate_blocks``.

- ``index_scores``: the released indexer (32 heads x 128, fake-quantized bf16 q, ``fp4_b32`` keys
  read as stored). Bytes: q + weights + visible + k as stored + the fp32 ``[B, S, T]`` output;
  FLOPs ``2 B S Hi Di T``. Baseline: the torch reference (dequantize, einsum) on the same GPU.
  Decode (S = 1) at batch 1 / 8 / 64 and contexts 4K, 64K, 128K, 1M (T = context / 2), and two
  prefill chunks (compute-bound: 8K FLOP per 4-byte score).
- ``topk_positions`` (k = 512): rows B*S in {1, 8, 64, 2048} at T in {4K, 64K, 128K}, and
  {1, 8, 64} rows at 1M. Bytes: the scores read once + the int32 picks. Baseline:
  ``torch.topk(scores, 512)`` followed by the sort of its indices that the contract needs; the
  row also carries ``torch.topk`` alone (``topk_only_ms``, ``speedup_vs_topk_only``) and whether
  the picks equal torch's (``picks_match``: randn scores have no ties).
- ``candidate_blocks`` (2048 blocks of 8, the released pool): rows 1 / 64 at T 64K / 128K. Bytes:
  scores + visible read, the bool mask written. Baseline: the torch reference.

    python -m flashrt.bench.indexer     # prints the rows as JSON (needs a CUDA device)
"""
from __future__ import annotations

import json

import torch

from . import common
from .common import nbytes as _nb

TOPK = 512
DEVICE = "cuda"
CONTEXTS = (4096, 65536, 131072, 1 << 20)


def _index_case(rows, ceil, B, S, T, g):
    from flashrt import ops
    from flashrt.backends import reference as ref
    from flashrt.kernels_cuda import indexer

    q = torch.randn(B, S, 32, 128, device=DEVICE, dtype=torch.bfloat16, generator=g)
    q = ops.dequantize(ops.quantize(q, "fp4_b32"), torch.bfloat16)
    k = ops.quantize(torch.randn(B, T, 128, device=DEVICE, generator=g), "fp4_b32")
    w = torch.randn(B, S, 32, device=DEVICE, generator=g) * (128 * 32) ** -0.5
    vis = torch.full((B, S), T, dtype=torch.int32, device=DEVICE)
    out = indexer.index_scores(q, k, w, vis)
    ms = common.bench_ms(lambda: indexer.index_scores(q, k, w, vis))
    base = common.bench_ms(lambda: ref.index_scores(q, k, w, vis)) if B * S * T <= (1 << 25) else None
    rows.append(common.row("index_scores fp4_b32", f"B={B} S={S} T={T} 32x128", ms, 2.0 * B * S * 32 * 128 * T,
                           _nb(q, w, vis, k, out), ceil, baseline="torch reference" if base else None,
                           baseline_ms=base))


def _topk_case(rows, ceil, R, T, g):
    from flashrt.kernels_cuda import topk

    scores = torch.randn(R, 1, T, device=DEVICE, generator=g)
    out = topk.topk_positions(scores, TOPK)
    want = torch.topk(scores, TOPK).indices.sort(-1).values
    ms = common.bench_ms(lambda: topk.topk_positions(scores, TOPK))
    both = common.bench_ms(lambda: torch.topk(scores, TOPK).indices.sort(-1))
    only = common.bench_ms(lambda: torch.topk(scores, TOPK))
    rows.append(common.row("topk_positions", f"rows={R} T={T} k={TOPK}", ms, 0.0, _nb(scores, out), ceil,
                           baseline="torch.topk + sort", baseline_ms=both, topk_only_ms=only,
                           speedup_vs_topk_only=only / ms, picks_match=bool(torch.equal(out.long(), want))))


def _blocks_case(rows, ceil, R, T, g):
    from flashrt.backends import reference as ref
    from flashrt.kernels_cuda import indexer

    scores = torch.randn(R, 1, T, device=DEVICE, generator=g)
    vis = torch.full((R, 1), T, dtype=torch.int32, device=DEVICE)
    out = indexer.candidate_blocks(scores, vis, 2048, 8)
    match = bool(torch.equal(out, ref.candidate_blocks(scores, vis, 2048, 8)))
    ms = common.bench_ms(lambda: indexer.candidate_blocks(scores, vis, 2048, 8))
    base = common.bench_ms(lambda: ref.candidate_blocks(scores, vis, 2048, 8))
    rows.append(common.row("candidate_blocks", f"rows={R} T={T} 2048x8", ms, 0.0, _nb(scores, vis, out), ceil,
                           baseline="torch reference", baseline_ms=base, picks_match=match))


def run(ceil) -> list[dict]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    rows: list[dict] = []
    for ctx in CONTEXTS:
        for B in (1, 8, 64):
            if not (B == 64 and ctx == CONTEXTS[-1]):  # 64 x 512K fp4 keys: 2.2 GB, skipped
                _index_case(rows, ceil, B, 1, ctx // 2, g)
    for S, T in ((256, 32768), (1024, 65536)):
        _index_case(rows, ceil, 1, S, T, g)
    for T in CONTEXTS:
        for R in ((1, 8, 64) if T == CONTEXTS[-1] else (1, 8, 64, 2048)):
            _topk_case(rows, ceil, R, T, g)
    for T in (65536, 131072):
        for R in (1, 64):
            _blocks_case(rows, ceil, R, T, g)
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    print(json.dumps(run(common.Ceilings.measure()), indent=2))
