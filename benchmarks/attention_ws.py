"""The warp-specialized attention kernel (``tiles.attention.ws``) against the plain kernel, and its
tiles, in one run, at the released shapes (64 heads x 512, an fp8 ring of 128, 512 fp4_b16 picks).

    python benchmarks/attention_ws.py --out F [--context 131072] [--batches 1 8 64] [--prefill 2048]
        [--variants SUBSTRING ...]

Decode at each batch (S = 1) and a prefill of ``--prefill`` queries (B = 1), the inputs of
``flashrt bench kernels`` (``flashrt.bench.attention``). Each variant's output is checked against
the plain kernel's first (relative difference at most 1e-2; a variant that differs or fails is
recorded and not timed), then timed by CUDA-graph replay behind an L2 flush
(``flashrt.timing.bench_ms``). The floor is ``max(FLOPs / bf16 GEMM rate, bytes / copy rate)``
with both ceilings measured in the same run (``flashrt.bench.common``); each row gives its fraction.
Variants: the plain kernel and each of VARIANTS / PACKED, all over the active profile's tiles (the
plain kernel keeps the profile's fp4_b16 decode).
"""
from __future__ import annotations

import argparse

import torch

import flashrt
from flashrt.bench import attention as bench_attention, common
from decode_kernel_variants import with_tiles
from results_io import write_json

VARIANTS = {  # tiles.attention.ws over the active profile's (min_queries 1: every launch takes it), fp4_b16
    # rows decoded code by code; the tiles that lost (decode 64 / 256 / 512 columns a step, K blocks of 16,
    # 152 producer registers, copies 3 blocks ahead, the decode in the consumers, each consumer warpgroup's
    # own scores, the rescale past a margin, 8 producer warps with other tiles: docs/performance.md) are
    # left out
    "ws, copies 1 block ahead": {"RAW_STAGES": 2, "q_in_consumers": False},
}
EIGHT = {"producer_warps": 8, "maxnreg": 128, "producer_regs": 80, "pv_parts": 2}
PACKED = {  # the same with the packed fp4_b16 decode (tiles.attention.dequant)
    "ws, packed": {"RAW_STAGES": 3, "q_in_consumers": False},
    "ws, packed, copies 1 block ahead": {"RAW_STAGES": 2, "q_in_consumers": False},
    # q loaded by the consumers after the partitions start (the h200 profile)
    "ws, packed, copies 1 block ahead, q in consumers": {"RAW_STAGES": 2, "q_in_consumers": True},
    "ws, packed, copies 1 block ahead, q in consumers, 3 slots": {"RAW_STAGES": 2, "q_in_consumers": True,
                                                                  "STAGES": 3},
    "ws, packed, copies 1 block ahead, value MMA in halves": {"RAW_STAGES": 2, "q_in_consumers": True,
                                                              "pv_parts": 2},
    # two producer warps a scheduler: 16 warps, 128 registers a thread at launch; the consumers get
    # 256 - producer_regs
    "ws, packed, copies 1 block ahead, 8 producer warps": {"RAW_STAGES": 2, "q_in_consumers": True, **EIGHT},
    # each consumer warpgroup a partition, the scores over half of D each, the halves added; each loads
    # the half of q it reads, or q is loaded before the partitions start
    "ws, packed, copies 1 block ahead, split scores": {"RAW_STAGES": 2, "split_scores": True,
                                                       "q_in_consumers": True},
    "ws, packed, copies 1 block ahead, split scores, q before": {"RAW_STAGES": 2, "split_scores": True,
                                                                 "q_in_consumers": False},
    # the producer's warps splitting a block's rows when copying (a thread locates one row of 32, not four)
    "ws, packed, copies 1 block ahead, q in consumers, rows by warp": {"RAW_STAGES": 2, "q_in_consumers": True,
                                                                       "rows_by_warp": True},
    "ws, packed, copies 1 block ahead, split scores, rows by warp": {"RAW_STAGES": 2, "split_scores": True,
                                                                     "q_in_consumers": True, "rows_by_warp": True},
    # the output leaving through q's shared memory in 16-byte vectors a thread
    "ws, packed, copies 1 block ahead, q in consumers, staged stores": {"RAW_STAGES": 2, "q_in_consumers": True,
                                                                        "staged_stores": True},
    # each chunk's raw bytes loaded before the chunk ahead of it is stored; with the two above
    "ws, packed, copies 1 block ahead, q in consumers, decode ahead": {"RAW_STAGES": 2, "q_in_consumers": True,
                                                                       "decode_ahead": True},
    "ws, packed, copies 1 block ahead, q in consumers, rows by warp, staged stores, decode ahead": {
        "RAW_STAGES": 2, "q_in_consumers": True, "rows_by_warp": True, "staged_stores": True, "decode_ahead": True},
    "ws, packed, copies 1 block ahead, split scores, rows by warp, staged stores, decode ahead": {
        "RAW_STAGES": 2, "split_scores": True, "q_in_consumers": True, "rows_by_warp": True, "staged_stores": True,
        "decode_ahead": True},
    "ws, packed, copies 1 block ahead, split scores, rows by warp, staged stores": {
        "RAW_STAGES": 2, "split_scores": True, "q_in_consumers": True, "rows_by_warp": True, "staged_stores": True},
    "ws, packed, copies 1 block ahead, split scores, producer 72": {"RAW_STAGES": 2, "split_scores": True,
                                                                    "q_in_consumers": True, "producer_regs": 72},
}


def _variants(packed: bool, only: list | None = None):
    """(label, tiles) of the plain kernel and of each variant (``only``: those whose label holds one of
    these strings)."""
    yield "plain", {"ws": {"enabled": False}}
    chosen = lambda label: not only or any(o in label for o in only)  # noqa: E731
    for group, rows_packed in ((VARIANTS, False), *(((PACKED, True),) if packed else ())):
        for label, tiles in group.items():
            if chosen(label):
                yield label, {"ws": {"enabled": True, "min_queries": 1, **tiles},
                              "dequant": {"packed_fp4_b16": rows_packed}}


def _case(ceil, B: int, S: int, context: int, g, packed: bool, only: list | None = None) -> list[dict]:
    from flashrt.kernels_cuda import attention

    q, kv, idx, sink = bench_attention._inputs(B, S, context, g)
    scale = bench_attention.D ** -0.5
    flops = 4.0 * B * S * bench_attention.H * idx.shape[-1] * bench_attention.D
    nbytes = bench_attention._bytes(q, kv, idx)
    codes = tuple(attention.FMT_CODES[t.fmt] for t in kv)
    rows, first = [], None
    for label, tiles in _variants(packed, only):
        with with_tiles("attention", tiles), flashrt.use_backend("cuda"), flashrt.value_checks(False):
            call = lambda: attention.sparse_attention(q, kv, idx, sink, scale)
            kernel, splits = attention.planned_splits(q, idx.shape[-1], codes)
            base = {"variant": label, "tiles": tiles, "B": B, "S": S, "context": context, "kernel": kernel,
                    "splits": splits}
            try:
                out = call().float()
                torch.cuda.synchronize()
            except Exception as e:  # a tile set past the device's limits: recorded, the others still run
                rows.append(base | {"error": f"{type(e).__name__}: {e}"[:300]})
                print(f"B={B:3d} S={S:5d} {label:34s} failed: {rows[-1]['error'][:100]}", flush=True)
                continue
            first = out if first is None else first
            diff = float((out - first).norm() / first.norm())
            if not torch.isfinite(out).all() or diff > 1e-2:
                rows.append(base | {"error": f"differs from the plain kernel: relative difference {diff:.3g}"})
                print(f"B={B:3d} S={S:5d} {label:34s} {rows[-1]['error']}", flush=True)
                continue
            t = common.bench_ms(call)
        r = common.row("sparse_attention", f"B={B} S={S} ctx={context}", t, flops, nbytes, ceil)
        rows.append(base | {"us": r["ms"] * 1e3, "floor_us": r["floor_ms"] * 1e3, "of_roofline": r["roofline_fraction"],
                            "bound": r["bound"], "timing": r["timing"], "rel_diff_from_plain": diff})
        print(f"B={B:3d} S={S:5d} {label:34s} {rows[-1]['us']:9.1f} us  {100 * r['roofline_fraction']:5.1f}% of "
              f"{r['floor_ms'] * 1e3:.1f} us ({kernel}, {splits} splits)", flush=True)
    del q, kv, idx
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prefill", type=int, default=2048, help="queries of the prefill case (0: none)")
    ap.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True,
                    help="also the ws kernel's variants with the packed fp4_b16 decode")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="time only the variants whose label holds one of these strings (and the plain kernel)")
    ap.add_argument("--out", default=None, help="the rows, written again after each case (a run cut short keeps "
                                                "the cases it finished)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    if min(args.batches + [args.context]) < 1 or args.prefill < 0:
        ap.error(f"--batches / --context: expected positive counts, --prefill >= 0; got {args.batches}, "
                 f"{args.context}, {args.prefill}")
    ceil = common.Ceilings.measure()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    cases = [(B, 1) for B in args.batches] + ([(1, args.prefill)] if args.prefill else [])
    for B, S in cases:
        rows += _case(ceil, B, S, args.context, g, args.packed, args.variants)
        write_json(args.out, {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": ceil.copy_bytes_per_s,
                              "bf16_flops": ceil.bf16_flops, "context": args.context, "rows": rows})


if __name__ == "__main__":
    main()
