"""HKCP on one device, one run (a few minutes on a GPU): capacity under a 24 GB budget,
decode step time 4K -> 1M with the cold tier on and a device budget that holds ~10% of each
context's main KV (most picks are cold), cold-fetch bandwidth of the zero-copy gather kernel vs the
old copy path vs a pinned host-to-device copy, and time to first token of a 32K prompt on a
prefix-cache hit vs a full prefill.

    python benchmarks/hkcp.py --out benchmarks/results/h200-hkcp.json
    python benchmarks/hkcp.py --ttft-only --out benchmarks/results/h200-hkcp-ttft.json

The time-to-first-token comparison warms both paths on another prompt of the same length first
(a miss that stores it, then a hit), so neither timed call compiles a kernel variant; medians of 3.

Long contexts are synthesised: the caches of a sequence at position N are filled with random
quantized bytes (decode time does not depend on the values), then real decode steps are timed.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from flashrt.formats import MAIN_KV_FORMAT
from flashrt.kv import pages as kvpages
from flashrt.graphs.config import shipped_config
from decode_timing import median_step_ms, stepper
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.kv.state import KVState, entry_bytes, fixed_bytes_for
from flashrt.kv.main_kv import PagedMainKV
from flashrt.kv.pages import PagePool
from flashrt.kv.prefix_cache import PrefixCache
from results_io import write_json
from flashrt.engine import generate

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHUNK = 512  # entries reserved per step when filling the cold-fetch layer (8 of its 16 device pages)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def main_kv_bytes(cfg, n: int) -> int:
    return sum(-(-n // cfg.ratio(l)) for l in cfg.kv_source_layers) * entry_bytes(cfg.head_dim, MAIN_KV_FORMAT)


def fill_state(model, state: KVState, n: int) -> None:
    """Make every row of ``state`` look like a sequence of ``n`` tokens (random cache bytes)."""
    cfg = model.cfg
    state.ensure_capacity(n + 64)
    chunk = max(64, n // 32)  # every layer a chunk at a time, as a prefill would; older pages spill
    for upto in range(chunk, n + chunk, chunk):
        for l, c in state.compressed.items():
            for row in range(state.batch):
                c.main.reserve(row, min(upto, n) // cfg.ratio(l))
                c.index_k.reserve(row, min(upto, n) // cfg.ratio(l))
        state.pool.unlock()
    for q in (state.index_pool.dev, state.pool.dev, state.pool.host):
        q.data.view(torch.uint8).random_(0, 256)
        q.scale.view(torch.uint8).fill_(120 if q is state.index_pool.dev else 40)
    for ring in state.rings.values():
        ring.data.view(torch.uint8).random_(0, 120)
        ring.scale.view(torch.uint8).fill_(120)
    state.positions.fill_(n)
    state.host_positions = [n] * state.batch


def decode_ms(model, state, steps: int = 5, graph: bool = False) -> float:
    """Median decode step (eager Model.forward, or replayed from CUDA graphs after 2 capture steps)."""
    tok = torch.randint(0, model.cfg.vocab_size, (state.batch,), device=DEV)
    return median_step_ms(stepper(model, state, graph), tok, steps, warmup=2 if graph else 1)


def decode_row(model, n: int, device_share: float) -> dict:
    """Decode step at context ``n`` with a device budget holding ``device_share`` of the main KV."""
    cfg = model.cfg
    floor = (4 * len(cfg.kv_source_layers) + 4) * 64 * entry_bytes(cfg.head_dim, MAIN_KV_FORMAT)  # a step's pages
    budget = fixed_bytes_for(cfg, 1, n + 64) + max(int(device_share * main_kv_bytes(cfg, n + 64)), floor)
    state = model.new_state(1, n + 64, kv_budget=budget)
    fill_state(model, state, n)
    ms = decode_ms(model, state)
    graph_ms = decode_ms(model, state, graph=DEV == "cuda")
    t = state.tier_stats()
    used = sum(len(tb.pages) for c in state.compressed.values() for tb in c.main.tables)
    row = {"context": n, "step_ms": ms, "graph_step_ms": graph_ms, "kv_budget": budget, "cold_share": t["cold_pages"] / max(used, 1), "tiers": t}
    print(f"decode at {n}: {ms:.2f} ms/step eager, {graph_ms:.2f} from CUDA graphs, cold share {row['cold_share']:.2f} {t}", flush=True)
    return row


def longest_context(cfg, budget: int, cold: bool) -> int:
    """Largest N whose KV state fits ``budget`` (cold tier: only index K + rings + a page floor)."""
    per_main = sum(entry_bytes(cfg.head_dim, MAIN_KV_FORMAT) / cfg.ratio(l) for l in cfg.kv_source_layers)
    lo, hi = 0, 1 << 31
    while lo < hi:
        mid = (lo + hi + 1) // 2
        need = fixed_bytes_for(cfg, 1, mid) + (0 if cold else per_main * mid) + 64 * 8 * 288
        lo, hi = (mid, hi) if need <= budget else (lo, mid - 1)
    return lo


def h2d_bandwidth() -> float:
    src = torch.empty(1 << 28, dtype=torch.uint8)
    src = src.pin_memory() if DEV == "cuda" else src
    dst = torch.empty(1 << 28, dtype=torch.uint8, device=DEV)
    dst.copy_(src, non_blocking=True)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    sync()
    return 5 * src.numel() / (time.perf_counter() - t0)


def _timed(fn, reps: int) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def cold_fetch(cfg, entries: int) -> dict:
    """Resolving top-k picks over a layer whose pages are all but 16 on the host, through the
    zero-copy kernel and through the copy path, for a decode's picks and for a staging-full batch."""
    pool = PagePool(cfg.head_dim, 64, DEV, 16)
    main = PagedMainKV(pool, 1, entries)
    for upto in range(CHUNK, entries + CHUNK, CHUNK):
        main.reserve(0, min(upto, entries))
        pool.unlock()
    pool.host.data.view(torch.uint8).random_(0, 256)
    pool.host.scale.view(torch.uint8).fill_(40)
    row_bytes = entry_bytes(cfg.head_dim, MAIN_KV_FORMAT)
    res = {"entries_in_layer": entries, "cold_pages": main.tables[0].cold, "kernel_used": pool.zero_copy(1)}
    for picks in (512, kvpages.STAGING_MAX_ROWS):
        topk = torch.randint(0, entries, (1, picks // 512, 512), device=DEV, dtype=torch.int32)
        kernel = _timed(lambda: main.resolve(topk), 20)
        old, kvpages.STAGING_MAX_ROWS = kvpages.STAGING_MAX_ROWS, 0
        copy = _timed(lambda: main.resolve(topk), 5)
        kvpages.STAGING_MAX_ROWS = old
        row = {"bytes": picks * row_bytes, "resolve_ms": kernel * 1e3, "copy_path_ms": copy * 1e3,
               "resolve_gb_per_s": picks * row_bytes / kernel / 1e9, "copy_path_gb_per_s": picks * row_bytes / copy / 1e9}
        if res["kernel_used"]:  # the gather op alone (no index math around it)
            from flashrt import ops, value_checks

            flat, ids = topk.reshape(1, -1), main.host_ids_device()
            index = torch.full_like(flat, -1)
            with value_checks(False):
                only = _timed(lambda: ops.gather_cold_rows(pool.host, ids, flat, index, 0), 20)
            row.update(kernel_ms=only * 1e3, kernel_gb_per_s=picks * row_bytes / only / 1e9)
        res[f"picks_{picks}"] = row
    return res


def ttft(model, n: int, reps: int = 3) -> dict:
    """Time to first token of an ``n``-token prompt: full prefill vs a prefix-cache hit, medians of
    ``reps`` each. Both are warm: a prompt of the same length is prefilled, stored and hit first
    (untimed), so the variants either path launches are compiled; the measured prompt is stored
    (untimed) between the full prefills and the hits."""
    other, ids = torch.randint(0, model.cfg.vocab_size, (2, n)).tolist()
    cache = PrefixCache(tempfile.mkdtemp())
    run = lambda p, c=None: generate(model, [p], 1, prefill_chunk=8192, prefix_cache=c)  # noqa: E731
    for _ in range(2):  # warm-up: a miss (stores), then a hit
        run(other, cache)
    sync()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0
    full = sorted(timed(lambda: run(ids)) for _ in range(reps))[reps // 2]
    run(ids, cache)  # stores the measured prompt
    sync()
    hits = cache.hits
    hit = sorted(timed(lambda: run(ids, cache)) for _ in range(reps))[reps // 2]
    assert cache.hits == hits + reps
    return {"prompt_tokens": n, "full_prefill_s": full, "prefix_hit_s": hit, "hit_to_full": hit / full,
            "speedup": full / hit, "reps": reps, "note": "medians; both paths warmed on another prompt first"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536, 262144, 1048576])
    ap.add_argument("--device-share", type=float, default=0.10, help="main KV on the device in the decode sweep")
    ap.add_argument("--ttft-tokens", type=int, default=32768)
    ap.add_argument("--eager-cold", action="store_true",
                    help="run decode steps that read cold pages eagerly (engine/step_capture.CAPTURE_COLD off)")
    ap.add_argument("--ttft-only", action="store_true", help="only the time-to-first-token comparison")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.eager_cold:
        import flashrt.engine.step_capture as step_capture

        step_capture.CAPTURE_COLD = False
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device=DEV))
    budget = 24 << 30
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    if args.ttft_only:
        res = {"model": args.model, "device": name, "ttft": ttft(model, args.ttft_tokens)}
        print("ttft", res["ttft"], flush=True)
        write_json(args.out, res)
        return
    res = {"model": args.model, "device": name, "budget_bytes": budget, "device_share": args.device_share,
           "longest_context": {"without_cold_tier": longest_context(cfg, budget, False),
                               "with_cold_tier": longest_context(cfg, budget, True)}}
    print("longest context in 24 GB:", res["longest_context"], flush=True)
    res["decode"] = []
    for n in args.contexts:
        res["decode"].append(decode_row(model, n, args.device_share))
        torch.cuda.empty_cache() if DEV == "cuda" else None
        write_json(args.out, res)
    for row in res["decode"]:
        row["ratio_to_first"] = row["step_ms"] / res["decode"][0]["step_ms"]
        row["graph_ratio_to_first"] = row["graph_step_ms"] / res["decode"][0]["graph_step_ms"]
    res["h2d_pinned_bytes_per_s"] = h2d_bandwidth()
    res["cold_fetch"] = cold_fetch(cfg, max(args.contexts) // min(cfg.ratio(l) for l in cfg.kv_source_layers))
    print("h2d", res["h2d_pinned_bytes_per_s"] / 1e9, "GB/s; cold fetch", res["cold_fetch"], flush=True)
    write_json(args.out, res)
    res["ttft"] = ttft(model, args.ttft_tokens)
    print("ttft", res["ttft"], flush=True)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
