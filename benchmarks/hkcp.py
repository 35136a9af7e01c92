"""HKCP on one device, one run: capacity under a 24 GB budget, decode step time 4K -> 1M with the
cold tier on, cold-fetch bandwidth vs pinned host-to-device copy, and time to first token of a
prompt on a prefix-cache hit vs a full prefill.

    python benchmarks/hkcp.py --out benchmarks/results/h200-hkcp.json

Long contexts are synthesised: the caches of a sequence at position N are filled with random
quantized bytes (decode time does not depend on the values), then real decode steps are timed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.kvcache import KVState, entry_bytes, fixed_bytes_for
from flashrt.prefix_cache import PrefixCache


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def fill_state(model, state: KVState, n: int, row: int = 0) -> None:
    """Make ``row`` of ``state`` look like a sequence of ``n`` tokens (random cache bytes)."""
    cfg = model.cfg
    state.ensure_capacity(n + 64)
    for l, c in state.compressed.items():
        entries = n // cfg.ratio(l)
        for upto in range(0, entries + 4096, 4096):  # a step's worth at a time: older pages may spill
            c.main.reserve(row, min(upto, entries))
            state.pool.unlock()
        c.index_k.reserve(row, entries)
    index = state.index_pool.dev
    index.data.view(torch.uint8).random_(0, 256)
    index.scale.view(torch.uint8).fill_(120)
    pool = state.pool
    pool.dev.data.view(torch.uint8).random_(0, 256)
    pool.dev.scale.view(torch.uint8).fill_(40)
    if pool.host.shape[0]:
        pool.host.data.view(torch.uint8).random_(0, 256)
        pool.host.scale.view(torch.uint8).fill_(40)
    for ring in state.rings.values():
        ring.data.view(torch.uint8).random_(0, 120)
        ring.scale.view(torch.uint8).fill_(120)
    state.positions.fill_(n)
    state.host_positions = [n] * state.batch


def decode_ms(model, state, steps: int = 5) -> float:
    tok = torch.randint(0, model.cfg.vocab_size, (state.batch, 1), device=DEV)
    model.forward(tok, state=state)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        model.forward(tok, state=state)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def longest_context(cfg, budget: int, cold: bool) -> int:
    """Largest N whose KV state fits ``budget`` (cold tier: only index K + rings + a page floor)."""
    per_main = sum(entry_bytes(cfg.head_dim, "fp4_b16") / cfg.ratio(l) for l in cfg.kv_source_layers)
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


def cold_fetch(model, n: int, budget: int) -> dict:
    state = model.new_state(1, n + 64, kv_budget=budget)
    fill_state(model, state, n)
    main = state.compressed[max(model.cfg.kv_source_layers)].main
    topk = torch.randint(0, n // 2, (1, 1, 512), device=DEV, dtype=torch.int32)
    main.resolve(topk)
    sync()
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        segs, _ = main.resolve(topk)
    sync()
    dt = (time.perf_counter() - t0) / reps
    staged = segs[-1].nbytes if len(segs) > 1 else 0
    return {"entries": 512, "staged_bytes": staged, "ms": dt * 1e3, "gb_per_s": staged / dt / 1e9}


def ttft(model, n: int) -> dict:
    ids = torch.randint(0, model.cfg.vocab_size, (1, n)).tolist()
    cache = PrefixCache(tempfile.mkdtemp())
    sync()
    t0 = time.perf_counter()
    model.generate(ids, 1, prefill_chunk=8192, prefix_cache=cache)
    sync()
    miss = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, 1, prefill_chunk=8192, prefix_cache=cache)
    sync()
    hit = time.perf_counter() - t0
    return {"prompt_tokens": n, "full_prefill_s": miss, "prefix_hit_s": hit, "speedup": miss / hit}


def _save(path, res) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536, 262144, 1048576])
    ap.add_argument("--ttft-tokens", type=int, default=32768)
    ap.add_argument("--decode-budget", type=int, default=512 << 20, help="device KV bytes in the decode sweep")
    ap.add_argument("--fetch-budget", type=int, default=512 << 20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device=DEV))
    budget = 24 << 30
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    res = {"model": args.model, "device": name, "budget_bytes": budget,
           "longest_context": {"without_cold_tier": longest_context(cfg, budget, False),
                               "with_cold_tier": longest_context(cfg, budget, True)}}
    print("longest context in 24 GB:", res["longest_context"], flush=True)
    res["decode"] = []
    for n in args.contexts:
        state = model.new_state(1, n + 64, kv_budget=args.decode_budget)  # long contexts go cold
        fill_state(model, state, n)
        ms = decode_ms(model, state)
        res["decode"].append({"context": n, "step_ms": ms, "tiers": state.tier_stats()})
        print(f"decode at {n}: {ms:.2f} ms/step {state.tier_stats()}", flush=True)
        del state
        torch.cuda.empty_cache() if DEV == "cuda" else None
        _save(args.out, res)
    base = res["decode"][0]["step_ms"]
    for row in res["decode"]:
        row["ratio_to_first"] = row["step_ms"] / base
    res["h2d_pinned_bytes_per_s"] = h2d_bandwidth()
    res["cold_fetch"] = cold_fetch(model, max(args.contexts), args.fetch_budget)
    print("h2d", res["h2d_pinned_bytes_per_s"] / 1e9, "GB/s; cold fetch", res["cold_fetch"], flush=True)
    _save(args.out, res)
    res["ttft"] = ttft(model, args.ttft_tokens)
    print("ttft", res["ttft"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
