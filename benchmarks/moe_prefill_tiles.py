"""The routed fp4 experts of a prefill chunk (``moe_experts`` at the released dimensions, 384 experts,
top-6, about 64 rows an expert at 4,096 tokens) under tiles for the experts' MMA rule past 16 rows,
against the active profile's, in one run.

    python benchmarks/moe_prefill_tiles.py --out F [--tokens 4096] [--model v4.1-flash|small] [--variants LABEL ...]

Each variant puts one rule serving every row count in front of ``tiles.moe.experts`` (the launches
of a chunk this size all take it). The experts' weights are random fp4 bytes laid out as the
profile's load lays them out (``expert_scales``, ``expert_fp4``). Per variant: microseconds a call
(``flashrt.timing.bench_ms``: CUDA-graph replays behind an L2 flush), the floor
``max(weight bytes / copy rate, FLOPs / bf16 GEMM rate)`` with both rates measured in the same run
(the weights of the experts the routing touched; ``flashrt.bench.common.Ceilings``), and the largest
difference of the output from the profile's (and its norm relative to the profile output's). A variant
that fails to compile or launch is recorded, not fatal. The registers and shared memory of each (two
programs an SM where they fit) come from ``tools/sm90_compile.py moe --B 4096 --moe-dims released --tiles
...`` (docs/performance.md).
"""
from __future__ import annotations

import argparse

import torch

import flashrt
from flashrt import ops, profiles
from flashrt.bench.common import Ceilings, nbytes
from flashrt.graphs.config import shipped_config
from flashrt.timing import bench_ms
from gemv_tiles import random_experts, with_rule
from results_io import write_json


def tile(block_n: int, block_k: int, warps: int, stages: int, block_m: int = 64, swap: bool | None = None) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
                min_block_n=32, split_min_blocks=2, swap_operands=swap)


VARIANTS = {  # label -> the rule's tile (the h200 profile's past 16 rows: M64 N128 K64, 4 warps, 4 stages, swapped)
    "M64 N64 K128, 4 warps, 3 stages": tile(64, 128, 4, 3),
    "M64 N64 K128, 4 warps, 4 stages": tile(64, 128, 4, 4),
    "M64 N128 K64, 4 warps, 4 stages": tile(128, 64, 4, 4),
    "M64 N128 K64, 8 warps, 4 stages": tile(128, 64, 8, 4),
    "M64 N256 K64, 8 warps, 3 stages": tile(256, 64, 8, 3),
    # 128-row tiles: an expert's rows (about 64 at 4,096 tokens) in one row tile, its weights decoded once
    # where 64-row tiles decode them again for every expert past 64 rows
    "M128 N64 K64, 8 warps, 3 stages": tile(64, 64, 8, 3, 128),
    "M128 N64 K128, 8 warps, 3 stages": tile(64, 128, 8, 3, 128),
    "M128 N128 K64, 8 warps, 2 stages": tile(128, 64, 8, 2, 128),
    # the rule's own swap_operands knob: the decoded weights the warpgroup MMA's register operand
    "M64 N128 K64, 4 warps, 4 stages, swapped": tile(128, 64, 4, 4, swap=True),
    "M64 N64 K128, 4 warps, 3 stages, swapped": tile(64, 128, 4, 3, swap=True),
    "M128 N64 K64, 8 warps, 3 stages, swapped": tile(64, 64, 8, 3, 128, swap=True),
}
# the fp8 warpgroup MMA with the weights its register operand, the activations streamed (the rule's qgmma
# knob with row tiles of 32 or more: kernels_cuda/moe_qgmma_stream.py): rows a tile, warps, ring trips
for _rows, _warps, _stages in ((64, 8, 3), (64, 8, 4), (32, 8, 3), (64, 4, 3), (32, 4, 4)):
    VARIANTS[f"qgmma streamed, {_rows}-row tiles, {_warps} warps, {_stages} stages"] = dict(
        tile(128, 64, 4, 4, swap=True), qgmma=True, qgmma_tokens=_rows, qgmma_warps=_warps, qgmma_stages=_stages)
# one MMA in flight at a time and 128 registers a thread: two programs of 8 warps an SM
VARIANTS["qgmma streamed, 64-row tiles, 8 warps, 3 stages, one in flight, 128 registers"] = dict(
    VARIANTS["qgmma streamed, 64-row tiles, 8 warps, 3 stages"], qgmma_inflight=1, qgmma_maxnreg=128)
# the same launches on the bf16 warpgroup MMA (the rule's qgmma_bf16: kernels_cuda/experts_bf16_stream.py)
for _rows, _warps, _stages, _cap in ((64, 8, 3, 128), (64, 8, 4, 128), (32, 8, 3, 128), (64, 8, 3, None),
                                     (64, 4, 4, None)):
    VARIANTS[f"bf16 streamed, {_rows}-row tiles, {_warps} warps, {_stages} stages"
             + (f", {_cap} registers" if _cap else "")] = dict(
        tile(128, 64, 4, 4, swap=True), qgmma=True, qgmma_tokens=_rows, qgmma_warps=_warps, qgmma_stages=_stages,
        qgmma_maxnreg=_cap, qgmma_bf16=True)
# row tiles of 64 + 16 or 64 + 32 rows: the second part on its own narrower MMA over the same decoded weights,
# run only where the tile holds rows past 64 (an expert of about 64 rows in one tile, one pass over its weights);
# 32 + 16 and 32 + 32 for chunks of about 32 rows an expert (2,048 tokens)
for _first, _second, _stages in ((64, 16, 4), (64, 32, 3), (64, 32, 4), (64, 16, 3), (32, 16, 3), (32, 32, 3)):
    VARIANTS[f"bf16 streamed, {_first}+{_second}-row tiles, 8 warps, {_stages} stages, 128 registers"] = dict(
        VARIANTS["bf16 streamed, 64-row tiles, 8 warps, 4 stages, 128 registers"], qgmma_tokens=_first,
        qgmma_stages=_stages, qgmma_tokens2=_second)
# the same with 4 warps (64 weight rows a program): what `flashrt tune` picked on its own experts case
for _first, _second, _stages in ((64, 16, 2), (64, 16, 3), (32, 16, 3)):
    VARIANTS[f"bf16 streamed, {_first}+{_second}-row tiles, 4 warps, {_stages} stages, 128 registers"] = dict(
        VARIANTS[f"bf16 streamed, {_first}+16-row tiles, 8 warps, 3 stages, 128 registers"], qgmma_warps=4,
        qgmma_stages=_stages)


def experts(cfg, tokens: int, dev, g):
    """(call, weight bytes the routing touches, FLOPs) of the routed experts at ``tokens`` tokens."""
    E, k, D, I = cfg.n_routed_experts, cfg.n_activated_experts, cfg.dim, cfg.moe_inter_dim
    prof = profiles.active_profile()
    w1, w3, w2 = random_experts(cfg, dev, prof.expert_scales == "k_major", prof.expert_fp4 == "words")
    x = torch.randn(tokens, D, generator=g).to(dev, torch.bfloat16)
    idx = torch.rand(tokens, E, generator=g).topk(k).indices.to(dev, torch.int32)
    rw = torch.rand(tokens, k, generator=g).to(dev)
    touched = torch.unique(idx).numel()
    call = lambda: ops.moe_experts(x, rw, idx, w1, w3, w2, 10.0, None, torch.bfloat16)
    return call, touched * nbytes(w1, w3, w2) / E, 6.0 * tokens * k * D * I


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--model", default="v4.1-flash", choices=["v4.1-flash", "small"],
                    help="the shipped config whose routed experts are timed")
    ap.add_argument("--variants", nargs="+", default=None, metavar="LABEL", choices=sorted(VARIANTS),
                    help="only these variants (and the profile's tiles); default: all")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tokens < 1:
        ap.error(f"--tokens: expected a positive count, got {args.tokens}")
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    ceil, dev = Ceilings.measure(), torch.device("cuda")
    call, weight_bytes, flops = experts(shipped_config(args.model), args.tokens, dev, torch.Generator().manual_seed(0))
    floor_us = 1e6 * max(weight_bytes / ceil.copy_bytes_per_s, flops / ceil.bf16_flops)
    rows, first = [], None
    chosen = {k: v for k, v in VARIANTS.items() if not args.variants or k in args.variants}
    with flashrt.use_backend("cuda"), flashrt.value_checks(False):
        for label, rule in {"profile": None, **chosen}.items():
            with with_rule("moe", "experts", None, rule):
                profiles._TILES_CACHE.clear()
                try:
                    out = call()
                    t = bench_ms(call)
                except Exception as e:  # a tile that does not compile or fit: recorded, not fatal
                    rows.append({"variant": label, "tile": rule, "error": f"{type(e).__name__}: {e}"[:300]})
                    print(f"{label:36s} failed: {rows[-1]['error'][:100]}", flush=True)
                    continue
            first = out.float() if first is None else first
            us = 1e3 * t.ms
            diff = out.float() - first
            rows.append({"variant": label, "tile": rule, "us_per_call": us, "floor_us": floor_us,
                         "of_floor": floor_us / us, "timing": "graph" if t.graph is not None else "plain",
                         "max_abs_diff_from_profile": float(diff.abs().max()),
                         "rel_diff_from_profile": float(diff.norm() / first.norm().clamp_min(1e-30))})
            print(f"{label:36s} {us:9.1f} us  floor {floor_us:8.1f} us ({100 * floor_us / us:5.1f}%)  "
                  f"diff {rows[-1]['max_abs_diff_from_profile']:.3g} ({rows[-1]['rel_diff_from_profile']:.2g} "
                  "relative)", flush=True)
    profiles._TILES_CACHE.clear()
    write_json(args.out, {"device": torch.cuda.get_device_name(), "model": args.model, "tokens": args.tokens,
                          "copy_bytes_per_s": ceil.copy_bytes_per_s, "bf16_flops": ceil.bf16_flops,
                          "weight_bytes": weight_bytes, "flops": flops, "rows": rows})


if __name__ == "__main__":
    main()
