"""``topk_positions`` (k = 512) under each ``tiles.topk.select.radix_bits`` against ``torch.topk`` +
the sort of its indices, one run.

    python benchmarks/topk_radix.py --out F [--rows 1 8 64] [--lengths 2048 4096 131072 1048576]
        [--radix 1 2 4 8] [--summary N] [--select '{"group": 8192}'] [--chunk-max '{"block": 8192}'] [--kernels]

Rows of at most ``tiles.topk.select.summary`` (or ``registers``, the larger) entries are picked
from their keys in registers after one search; longer rows go through a chunk summary and a candidate
list. The select's two k-th-largest searches decide ``radix_bits`` bits a pass: up to 32 sequential block-wide
reductions at 1 bit (fewer where a pass counts exactly k keys, docs/kernels.md), 16 at 2, 8 at 4
(each pass counts ``2**radix_bits`` thresholds at once), 4 256-bin histograms at 8
(docs/performance.md, "topk_positions"). Each case's picks are checked
equal to the baseline's before and after its timing (the split's ticket counters back at zero after); times are
CUDA-graph replays
(``flashrt.timing.bench_ms``, each behind an L2 flush).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from flashrt import profiles
from flashrt.timing import bench_ms
from moe_kernels import kernel_times
from results_io import write_json

K = 512


def with_select(chunk_max=None, **select):
    """The active profile with ``tiles.topk.select`` updated by ``select`` (and ``tiles.topk.chunk_max`` by
    ``chunk_max``)."""
    p = profiles.active_profile()
    tiles = dict(p.tiles)
    topk = dict(tiles.get("topk") or {})
    topk["select"] = {**(topk.get("select") or {}), **select}
    if chunk_max:
        topk["chunk_max"] = {**(topk.get("chunk_max") or {}), **chunk_max}
    tiles["topk"] = topk
    return dataclasses.replace(p, tiles=tiles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 131072, 1048576])
    ap.add_argument("--summary", type=int, default=None,
                    help="tiles.topk.select.summary for every case (default: the profile's); rows of at "
                         "most this many (or tiles.topk.select.registers) entries are picked from "
                         "registers, one search")
    ap.add_argument("--radix", type=int, nargs="+", default=[1, 2, 4, 8], choices=[1, 2, 4, 8])
    ap.add_argument("--select", default="{}", metavar="JSON",
                    help="more tiles.topk.select entries for every case, e.g. '{\"group\": 8192}' (the "
                         "elements a step of the list's loops)")
    ap.add_argument("--chunk-max", default="{}", metavar="JSON",
                    help="tiles.topk.chunk_max entries for every case, e.g. '{\"block\": 8192, \"num_warps\": 8}' "
                         "(the entries a program of the chunk-max pass reads, its warps)")
    ap.add_argument("--kernels", action="store_true",
                    help="also each kernel's device time a call (graph replays under the profiler): with the launches'"
                         " programmatic dependent launch a kernel's time includes its wait for the one before")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    extra, chunk_max = (_json_object(ap, name, text) for name, text in (("--select", args.select),
                                                                         ("--chunk-max", args.chunk_max)))
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    from flashrt.kernels_cuda import splitk, topk

    g, rows = torch.Generator(device="cuda").manual_seed(0), []
    summary = {**extra, **({} if args.summary is None else {"summary": args.summary})}
    for T in args.lengths:
        for R in args.rows:
            scores = torch.randn(R, 1, T, device="cuda", generator=g)
            want = torch.topk(scores, K).indices.sort(-1).values
            base = bench_ms(lambda: torch.topk(scores, K).indices.sort(-1))
            row = {"rows": R, "T": T, "k": K, "torch_topk_sort_us": 1e3 * base.ms}
            for radix in args.radix:
                with profiles.using(with_select(chunk_max, radix_bits=radix, **summary)):
                    out = topk.topk_positions(scores, K)
                    match = bool(torch.equal(out.long(), want))
                    t = bench_ms(lambda: topk.topk_positions(scores, K))
                    # the timed replays leave the split's ticket counters as they found them: picked again
                    # after them, the same picks (a launch that left a ticket behind would pick early)
                    after = bool(torch.equal(topk.topk_positions(scores, K).long(), want))
                    after &= not bool(splitk.counters(scores.device).any())
                    lists = torch.empty(R, dtype=torch.int32, device="cuda")  # list lengths; -3: a row's list
                    topk.select_rows(scores.view(R, T), None, K, torch.empty(R, K, dtype=torch.int32, device="cuda"),
                                     stats=lists)  # passed the register block (the one-program path took it)
                    if args.kernels:
                        row[f"radix{radix}_kernels_us"] = kernel_times(lambda: topk.topk_positions(scores, K), 20)
                row[f"radix{radix}_us"] = 1e3 * t.ms
                row[f"radix{radix}_speedup"] = base.ms / t.ms
                row[f"radix{radix}_match"] = match and after
                row[f"radix{radix}_match_after_timing"] = after
                row[f"radix{radix}_list_lengths"] = sorted(set(lists.tolist()))[:16]
            rows.append(row)
            print(f"rows {R:3d} T {T:8d}: torch.topk+sort {row['torch_topk_sort_us']:8.1f} us  " + "  ".join(
                f"radix {r}: {row[f'radix{r}_us']:7.1f} us ({row[f'radix{r}_speedup']:5.2f}x"
                f"{'' if row[f'radix{r}_match'] else ', WRONG'})" for r in args.radix), flush=True)
            for r in args.radix if args.kernels else ():
                print("    radix", r, "  ".join(f"{n.strip('_')} {us:.1f} us"
                                             for n, us in row[f"radix{r}_kernels_us"].items()), flush=True)
            del scores, want
    write_json(args.out, {"device": torch.cuda.get_device_name(), "summary": args.summary, "select": extra,
                          "chunk_max": chunk_max, "rows": rows})


def _json_object(ap, name: str, text: str) -> dict:
    """``text`` parsed as a JSON object, or the parser's error naming ``name``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        ap.error(f"{name}: expected a JSON object, got {text!r} ({e})")
    if not isinstance(value, dict):
        ap.error(f"{name}: expected a JSON object, got {text!r}")
    return value


if __name__ == "__main__":
    main()
