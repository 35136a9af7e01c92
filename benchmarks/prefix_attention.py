"""A prompt chunk's attention two ways in one run: ``ops.prefix_attention`` (each KV row gathered once
for a block of queries) against ``ops.sparse_attention`` on the indices it implies (one query a
program, its rows gathered per query), at ``small``'s shapes by default.

    python benchmarks/prefix_attention.py --out F

Rows of ``--len`` queries after ``--start`` earlier tokens, an fp8 window ring and chunk, the main KV
in its format with ``--entries`` entries each query sees a causal prefix of (ratio 1: ``start + s +
1``), a sink. Microseconds a call by ``flashrt.timing.bench_ms`` (graph replays behind an L2 flush);
both outputs checked against each other first. The floor is the FLOPs of the (query, head, entry)
pairs each query attends to (4 x D a pair) at the bf16 GEMM rate measured in the same run. Then, at
``--variant-rows`` rows, the prefix kernel under tile variants, each set over the active profile's
``tiles.prefix_attention.prefix`` ("shipped": the profile's tiles as they are): 4 warps, the output
columns split over two programs (alone, with 128 score rows a program, with K blocks of 16: the
sm_90 compiles that spill least), 128 score rows a program, K blocks of 16 / 64, one pipeline
stage. ``--profile-out F.yaml`` writes the active profile with the fastest variant's tiles set over
``tiles.prefix_attention.prefix`` where it is at least 3% faster than the shipped tiles.
"""
from __future__ import annotations

import argparse

import torch

import flashrt
from flashrt import formats, ops, profiles, refmath
from flashrt.dtypes import MAIN_KV_FORMAT
from flashrt.graphs.config import shipped_config
from flashrt.timing import bench_ms
from decode_kernel_variants import with_tiles
from results_io import profile_copy, write_json

VARIANTS = {
    "shipped": {},
    "4 warps": {"num_warps": 4},
    "columns split over two programs": {"D_SPLIT": 2},
    "columns split, 4 warps": {"D_SPLIT": 2, "num_warps": 4},
    "columns split, 128 score rows": {"D_SPLIT": 2, "M_BLOCK": 128},
    "columns split, K blocks of 16": {"D_SPLIT": 2, "K_BLOCK": 16},
    "columns split, 128 score rows, K blocks of 16": {"D_SPLIT": 2, "M_BLOCK": 128, "K_BLOCK": 16},
    "128 score rows a program": {"M_BLOCK": 128},
    "K blocks of 16": {"K_BLOCK": 16},
    "K blocks of 64": {"K_BLOCK": 64},
    "one stage": {"num_stages": 1},
}


def case(cfg, B, S, start, T, dev, g):
    H, D, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    q = torch.randn(B, S, H, D, device=dev, generator=g).to(torch.bfloat16)
    ring = formats.quantize(torch.randn(B, W, D, device=dev, generator=g), "fp8")
    chunk = formats.quantize(torch.randn(B, S, D, device=dev, generator=g), "fp8")
    main = formats.quantize(torch.randn(B, T, D, device=dev, generator=g), MAIN_KV_FORMAT)
    positions = (start + torch.arange(S, device=dev)).expand(B, S).contiguous()
    ring_start = torch.zeros(B, dtype=torch.long, device=dev)
    entries = (W + S + torch.arange(T, device=dev, dtype=torch.int32)).expand(B, T).contiguous()
    visible = (positions + 1).clamp_max(T).to(torch.int32)
    sink = torch.randn(H, device=dev, generator=g)
    return q, (ring, chunk, main), positions, ring_start, W, entries, visible, sink, D ** -0.5


def fastest_tiles(variants: list[dict], margin: float = 0.97) -> dict | None:
    """The tiles of the fastest timed variant where it takes under ``margin`` times the shipped
    tiles' time, else None."""
    timed = [v for v in variants if "us" in v]
    shipped = next((v["us"] for v in timed if v["variant"] == "shipped"), None)
    best = min(timed, key=lambda v: v["us"], default=None)
    if shipped is None or best is None or best["us"] >= margin * shipped:
        return None
    print(f"prefix tiles: {best['variant']} {best['us']:.1f} us against the shipped tiles' {shipped:.1f} us")
    return best["tiles"]


def write_profile(path: str, tiles: dict | None) -> None:
    """A copy of the active profile's file named for ``path`` with ``tiles`` (None: unchanged) merged
    into ``tiles.prefix_attention.prefix``."""
    def edit(data):
        if tiles:
            data.setdefault("tiles", {}).setdefault("prefix_attention", {}).setdefault("prefix", {}).update(tiles)

    profile_copy(path, edit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--entries", type=int, default=512)
    ap.add_argument("--variant-rows", type=int, default=4)
    ap.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the tile variants at --variant-rows rows")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-out", default=None, metavar="FILE.yaml",
                    help="write a copy of the active profile with the fastest variant's tiles (3%% or more "
                         "under the shipped tiles' time)")
    args = ap.parse_args()
    if args.profile_out and not args.profile_out.endswith(".yaml"):
        ap.error(f"--profile-out: expected a FILE.yaml, got {args.profile_out!r}")
    if args.profile_out and not args.variants:
        ap.error("--profile-out: needs the tile variants (drop --no-variants)")
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    cfg, dev, g = shipped_config(args.model), torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    gemm_flops = 2 * 8192 ** 3 / (bench_ms(lambda: a @ a).ms * 1e-3)
    del a
    rows = []
    for B in args.rows:
        c = case(cfg, B, args.len, args.start, args.entries, dev, g)
        q, kv, positions, ring_start, W, entries, visible, sink, scale = c
        indices = refmath.prefix_indices(positions, ring_start, W, entries, visible)
        with flashrt.use_backend("cuda"), flashrt.value_checks(False):
            dense = lambda: ops.prefix_attention(*c)
            sparse = lambda: ops.sparse_attention(q, kv, indices, sink, scale)
            got, want = dense().float(), sparse().float()
            err = float((got - want).norm() / want.norm())
            if err > 2e-2:
                raise SystemExit(f"prefix_attention differs from sparse_attention at B={B}: relative error {err:.3g}")
            t_dense, t_sparse = bench_ms(dense).ms * 1e3, bench_ms(sparse).ms * 1e3
        seen = int((indices[0] >= 0).sum() + (indices[1] >= 0).sum())  # (query, entry) pairs attended
        floor = 4 * seen * cfg.n_heads * cfg.head_dim / gemm_flops * 1e6
        rows.append({"rows": B, "queries": B * args.len, "prefix_us": t_dense, "sparse_us": t_sparse,
                     "speedup": t_sparse / t_dense, "floor_us": floor, "prefix_of_floor": floor / t_dense,
                     "rel_err": err})
        print(f"rows {B:3d} x {args.len}: prefix {t_dense:9.1f} us  sparse {t_sparse:9.1f} us  "
              f"{t_sparse / t_dense:5.2f}x  (floor {floor:.1f} us: {100 * floor / t_dense:.1f}% / "
              f"{100 * floor / t_sparse:.1f}%)", flush=True)
    c = case(cfg, args.variant_rows, args.len, args.start, args.entries, dev, g) if args.variants else None
    variants, first = [], None
    for label, tiles in VARIANTS.items() if args.variants else ():
        with with_tiles("prefix_attention", {"prefix": tiles}), flashrt.use_backend("cuda"), flashrt.value_checks(False):
            profiles._TILES_CACHE.clear()
            try:
                out = ops.prefix_attention(*c).float()
            except Exception as e:  # a tile past the device's shared memory: recorded, the others still run
                variants.append({"variant": label, "tiles": tiles, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"prefix tiles {label:32s} failed: {variants[-1]['error'][:100]}", flush=True)
                continue
            first = out if first is None else first
            t = bench_ms(lambda: ops.prefix_attention(*c)).ms * 1e3
        variants.append({"variant": label, "tiles": tiles, "us": t,
                         "rel_diff_from_first": float((out - first).norm() / first.norm())})
        print(f"prefix tiles {label:32s} {t:9.1f} us  (diff {variants[-1]['rel_diff_from_first']:.2g})", flush=True)
    profiles._TILES_CACHE.clear()
    if args.profile_out:
        write_profile(args.profile_out, fastest_tiles(variants))
    write_json(args.out, {"model": args.model, "device": torch.cuda.get_device_name(), "gemm_flops": gemm_flops,
                          "len": args.len, "start": args.start, "entries": args.entries, "rows": rows,
                          "variant_rows": args.variant_rows, "variants": variants})


if __name__ == "__main__":
    main()
