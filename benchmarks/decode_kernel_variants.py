"""Decode-shaped launches of the mHC coefficients, the sparse attention and the MoE gate under tile
variants, side by side in one process: which finish, combine and select paths are fastest at batch
1 / 8 / 64.

    python benchmarks/decode_kernel_variants.py --model small --out F

Per op, batch and variant: microseconds per call (``flashrt.timing.bench_ms``, the kernel suite's
timing: calls replayed from a CUDA graph, each behind an L2 flush), the launches a call makes, and
the largest difference of the outputs from the first variant's (the variants compute the same
values; a finish that sums in another order may differ in the last bits). Variants are profile tiles merged over the active
profile's (``flashrt.profiles.using``):

* ``hc_coefficients`` (``x [B, 1, hc, dim]`` bf16): the shipped tiles (the finish loading one split
  at a time); the finish loading four splits at a time (``SPLIT_CHUNK`` 4); token tiles of up to 64 at
  every batch (``SMALL_T`` 0: no 16-token tiles for small batches); the finish as a launch of its
  own (``in_kernel`` off); fewer K splits (``PROGRAMS`` 4 / 8 / 16 / 64: each program reads more of
  ``fn``, the last one sums fewer partials); K blocks of 256 or 64; the GEMV as fp32 multiply-adds
  up to 8 tokens (``FMA_T``, also with K blocks of 256 / 512); the dot path with a one-stage
  pipeline (``num_stages`` 1); K blocks of 512; the finish loading every split at once
  (``SPLIT_CHUNK`` 32); the partials value major, summed along the splits in one load
  (``value_major``). ``--hc-iters`` times them with another Sinkhorn iteration count (a probe of the
  iterations' share of a launch; the model's count by default), ``--hc-variants`` a subset.
* ``sparse_attention`` (``q [B, 1, heads, head_dim]`` bf16 over an fp8 window ring and an
  fp4_b16 main cache, ``window + index_topk`` indices in two parts, a sink): the combine launch
  over 64-column tiles (shipped), over whole rows (``BLOCK_D`` = head_dim, as before), and merged
  in the attention launch (``in_kernel``); K split for 2 / 4 / 8 waves of programs
  (``split.programs``); at most 8 or 4 splits; 4 warps; 3 pipeline stages; K blocks of 16. The
  same op over a prefill chunk (``--prefill-rows`` rows of ``--prefill-len`` queries, no split)
  under warp, stage and K block variants.
* ``moe_route`` (``x [B, dim]`` bf16, the model's gate, bias, score function and top-k): the gate's
  GEMM and the select launch, the select on 4 warps (shipped), 1, 2 and 8 warps, and programs of
  at most 1 / 4 tokens.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from flashrt import formats, profiles
from flashrt.graphs.config import shipped_config
from flashrt.kernels_cuda import attention, mhc, moe_route
from flashrt.timing import bench_ms
from decode_profile import gpu_events
from results_io import write_json

HC_VARIANTS = {
    "shipped": {},
    "finish four splits a load": {"hc_finish": {"SPLIT_CHUNK": 4}},
    "token tiles of 64 (no small-batch rule)": {"hc_coefficients": {"SMALL_T": 0}},
    "finish launch": {"hc_finish": {"in_kernel": False}},
    # fewer K splits (PROGRAMS / token tiles of them, at most K / BLOCK_K): a shorter finish, more K a program
    "programs 4": {"hc_coefficients": {"PROGRAMS": 4}},
    "programs 8": {"hc_coefficients": {"PROGRAMS": 8}},
    "programs 16": {"hc_coefficients": {"PROGRAMS": 16}},
    "programs 64": {"hc_coefficients": {"PROGRAMS": 64}},
    "K blocks of 256": {"hc_coefficients": {"BLOCK_K": 256}},
    "K blocks of 256, programs 8": {"hc_coefficients": {"BLOCK_K": 256, "PROGRAMS": 8}},
    "K blocks of 64, programs 16": {"hc_coefficients": {"BLOCK_K": 64, "PROGRAMS": 16}},
    "K blocks of 64 (64 splits)": {"hc_coefficients": {"BLOCK_K": 64}},
    # up to FMA_T tokens: fp32 multiply-adds over K in 1-8-token tiles, no 16-row tl.dot
    "multiply-add GEMV up to 8 tokens": {"hc_coefficients": {"FMA_T": 8}},
    "multiply-add GEMV, K blocks of 256": {"hc_coefficients": {"FMA_T": 8, "BLOCK_K": 256}},
    "dot path, one pipeline stage": {"hc_coefficients": {"num_stages": 1}},
    # the released dimensions (K = 4 x 5,120: 160 blocks of 128, one split each at one token)
    "K blocks of 512 (40 splits at K 20,480)": {"hc_coefficients": {"BLOCK_K": 512}},
    "multiply-add GEMV, K blocks of 512": {"hc_coefficients": {"FMA_T": 8, "BLOCK_K": 512}},
    # wider K blocks for the multiply-add GEMV alone (the dot path at 8-64 tokens keeps BLOCK_K)
    "multiply-add K blocks of 256": {"hc_coefficients": {"FMA_BLOCK_K": 256}},
    "multiply-add K blocks of 512": {"hc_coefficients": {"FMA_BLOCK_K": 512}},
    "multiply-add K blocks of 1024": {"hc_coefficients": {"FMA_BLOCK_K": 1024}},
    # the finish loading every split's partials at once (up to 32 splits x 16 values a token)
    "finish: all splits in one load": {"hc_finish": {"SPLIT_CHUNK": 32, "SPLIT_ELEMS": 16384}},
    # the partials stored value major and summed along the splits in one load (_hc_coefficients_vm_kernel)
    "finish: value-major partials": {"hc_finish": {"value_major": True}},
}
ATTENTION_VARIANTS = {
    "combine, 64 columns": {},
    "combine, whole rows": {"combine": {"BLOCK_D": 512}},
    "combine in the launch": {"combine": {"in_kernel": True}},
    # more K splits than one program per SM (split.programs: the programs the split aims at; only
    # batches whose queries alone fill part of a wave split at all): several programs an SM in flight
    "splits for 2 waves": {"split": {"programs": 264}},
    "splits for 4 waves": {"split": {"programs": 528}},
    "splits for 8 waves": {"split": {"programs": 1056}},
    # a 16-head block (small's heads) on fewer warps, or a deeper pipeline
    "4 warps": {"attention": {"num_warps": 4}},
    "4 warps, splits for 4 waves": {"attention": {"num_warps": 4}, "split": {"programs": 528}},
    "3 stages": {"attention": {"num_stages": 3}},
    "K blocks of 16, splits for 4 waves": {"attention": {"K_BLOCK": 16}, "split": {"programs": 528}},
    # fewer, longer splits: fewer partials for the combine to merge at small batches
    "at most 8 splits": {"split": {"max_splits": 8}},
    "at most 4 splits": {"split": {"max_splits": 4}},
}
# the gate's select launch: warps a program, tokens a program (one token always takes a program of its own)
ROUTE_VARIANTS = {
    "shipped": {},
    "1 warp": {"select": {"num_warps": 1}},
    "2 warps": {"select": {"num_warps": 2}},
    "8 warps": {"select": {"num_warps": 8}},
    "1 token a program": {"select": {"BLOCK_T": 1}},
    "4 tokens a program, 2 warps": {"select": {"BLOCK_T": 4, "num_warps": 2}},
}
# a prefill chunk: one query a program, no split; the tiles that shape its launches
PREFILL_VARIANTS = {
    "shipped": {},
    "4 warps": {"attention": {"num_warps": 4}},
    "3 stages": {"attention": {"num_stages": 3}},
    "4 warps, 3 stages": {"attention": {"num_warps": 4, "num_stages": 3}},
    "K blocks of 64, 4 warps": {"attention": {"K_BLOCK": 64, "num_warps": 4}},
    # less shared memory a program (one stage, or 16-row K blocks): more programs resident an SM
    "4 warps, 1 stage": {"attention": {"num_warps": 4, "num_stages": 1}},
    "4 warps, K blocks of 16": {"attention": {"num_warps": 4, "K_BLOCK": 16}},
    "2 warps": {"attention": {"num_warps": 2}},
}


def with_tiles(family: str, tiles: dict):
    base = profiles.active_profile()
    merged = {k: dict(v) for k, v in base.tiles.items()}
    for key, value in tiles.items():  # a section merges into the profile's, a scalar replaces it
        section = merged.setdefault(family, {})
        section[key] = {**section.get(key, {}), **value} if isinstance(value, dict) else value
    return profiles.using(dataclasses.replace(base, tiles=merged))


def kernels_per_call(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return len(gpu_events(prof))


def measure(name: str, family: str, variants: dict, make_call, batches) -> list[dict]:
    rows = []
    for B in batches:
        call, first = make_call(B), None
        for label, tiles in variants.items():
            with with_tiles(family, tiles):
                profiles._TILES_CACHE.clear()
                try:
                    out = call()
                except Exception as e:  # a tile past the device's shared memory: recorded, the others still run
                    rows.append({"op": name, "batch": B, "variant": label, "error": f"{type(e).__name__}: {e}"[:300]})
                    print(f"{name:24s} B={B:3d} {label:26s} failed: {rows[-1]['error'][:100]}", flush=True)
                    continue
                got = out if isinstance(out, tuple) else (out,)
                first = first or [t.clone() for t in got]
                diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, first))
                t = bench_ms(call)
                us = 1e3 * t.ms
                rows.append({"op": name, "batch": B, "variant": label, "us_per_call": us,
                             "timing": "graph" if t.graph is not None else "plain", "timing_note": t.note,
                             "kernels_per_call": kernels_per_call(call), "max_abs_diff_from_first": diff})
                print(f"{name:24s} B={B:3d} {label:26s} {us:8.2f} us  {rows[-1]['kernels_per_call']} kernels  "
                      f"diff {diff:.3g}", flush=True)
    profiles._TILES_CACHE.clear()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--entries", type=int, default=1024, help="main-KV entries the indices point into")
    ap.add_argument("--prefill-rows", type=int, default=4, help="rows of the prefill attention case")
    ap.add_argument("--prefill-len", type=int, default=512, help="queries per row of the prefill attention case")
    ap.add_argument("--ops", nargs="+", choices=["hc_coefficients", "sparse_attention", "prefill", "moe_route"],
                    default=["hc_coefficients", "sparse_attention", "prefill"], help="the cases to time")
    ap.add_argument("--hc-iters", type=int, default=None,
                    help="Sinkhorn iterations of the hc_coefficients cases (default: the model's)")
    ap.add_argument("--hc-variants", nargs="+", default=None, metavar="LABEL", choices=sorted(HC_VARIANTS),
                    help="only these hc_coefficients variants (and the shipped tiles); default: all")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.hc_iters is not None and args.hc_iters < 1:
        ap.error(f"--hc-iters: expected a positive count, got {args.hc_iters}")
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    cfg, dev, g = shipped_config(args.model), torch.device("cuda"), torch.Generator().manual_seed(0)
    hc, dim = cfg.hc_mult, cfg.dim
    iters = args.hc_iters or cfg.hc_sinkhorn_iters
    hc_variants = {k: v for k, v in HC_VARIANTS.items() if k == "shipped" or not args.hc_variants
                   or k in args.hc_variants}
    H, D, W, K = cfg.n_heads, cfg.head_dim, cfg.window_size, cfg.index_topk

    def hc_call(B):
        x = torch.randn(B, 1, hc, dim, generator=g).to(torch.bfloat16).to(dev)
        fn = (torch.randn((2 + hc) * hc, hc * dim, generator=g) / (hc * dim) ** 0.5).to(dev)
        scale, base = (torch.rand(3, generator=g) + 0.1).to(dev), torch.randn((2 + hc) * hc, generator=g).to(dev)
        return lambda: mhc.hc_coefficients(x, fn, scale, base, iters, cfg.hc_eps, cfg.norm_eps)

    def attention_call(B, S=1):
        ring = formats.quantize(torch.randn(B, W, D, generator=g), "fp8").to(dev)
        main_kv = formats.quantize(torch.randn(B, args.entries, D, generator=g), "fp4_b16").to(dev)
        q = torch.randn(B, S, H, D, generator=g).to(torch.bfloat16).to(dev)
        idx = (torch.randint(0, W, (B, S, W), generator=g).to(torch.int32).to(dev),
               torch.randint(W, W + args.entries, (B, S, K), generator=g).to(torch.int32).to(dev))
        sink = torch.randn(H, generator=g).to(dev)
        return lambda: attention.sparse_attention(q, (ring, main_kv), idx, sink, D ** -0.5)

    def route_call(B):
        x = torch.randn(B, dim, generator=g).to(torch.bfloat16).to(dev)
        gate = (torch.randn(cfg.n_routed_experts, dim, generator=g) * dim ** -0.5).to(torch.bfloat16).to(dev)
        bias = (torch.randn(cfg.n_routed_experts, generator=g) * 0.1).to(dev)
        return lambda: moe_route.moe_route(x, gate, bias, cfg.n_activated_experts, cfg.score_func,
                                           cfg.norm_topk_prob, cfg.route_scale)

    rows = []
    if "moe_route" in args.ops:
        rows += measure("moe_route", "moe_route", ROUTE_VARIANTS, route_call, args.batches)
    if "hc_coefficients" in args.ops:
        rows += measure("hc_coefficients", "mhc", hc_variants, hc_call, args.batches)
    if "sparse_attention" in args.ops:
        rows += measure("sparse_attention", "attention", ATTENTION_VARIANTS, attention_call, args.batches)
    if "prefill" in args.ops:
        rows += measure("sparse_attention prefill", "attention", PREFILL_VARIANTS,
                        lambda B: attention_call(B, args.prefill_len), [args.prefill_rows])
    write_json(args.out, {"model": args.model, "device": torch.cuda.get_device_name(), "entries": args.entries,
                          "hc_iters": iters, "rows": rows})


if __name__ == "__main__":
    main()
