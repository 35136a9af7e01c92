"""Decode time per layer at the real V4.1-Flash dimensions, next to its memory floor.

    python benchmarks/real_slice.py --batches 1 8 64 256 --out benchmarks/results/h200-real-slice.json

One device does what one rank of a multi-device run does: the real ``dim``, heads, experts and
inter sizes (``--model v4.1-flash``), with ``--layers`` backbone layers (default 8, one of each
role: window, window + Engram, full ratio 2, reuse ratio 2, full ratio 1 + candidate source,
reuse, reindex over the candidates, reuse), random weights made on the device
(:mod:`flashrt.graphs.device_weights`), a smaller Engram table (the lookups per token are the
real ones; only the row count shrinks). Each batch prefills ``--prompt`` random tokens, then
times ``--steps`` decode steps replayed from CUDA graphs (median).

The floor of a step is the bytes it must read divided by the device-to-device copy bandwidth
measured in the same run: every non-expert weight of every layer, the routed experts a batch
touches (expected distinct experts of top-k picks drawn uniformly: ``E * (1 - (1 - k/E)**B)``),
the head, the batch's embedding rows, and the KV a step reads (window rings, the top-k main-KV
entries, every index-K entry of the indexer layers). ``per_layer_ms`` is the step time over the
layer count (the head's read is amortized into it); ``floor_ratio`` = step time / floor.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashrt
from flashrt.formats import QTensor
from flashrt.graphs.config import shipped_config
from flashrt.graphs.device_weights import device_weights
from flashrt.graphs.engram_hash import bucket_primes
from flashrt.graphs.model import Model
from decode_profile import kernel_times
from decode_timing import greedy_pick, median_step_ms, stepper
from results_io import write_json

ROLES = (0, 0, 2, 2, 1, 1, 1, 1)  # compress ratios of the 8-layer slice


def slice_config(base: str, layers: int, engram_vocab: int):
    """``base`` with ``layers`` backbone layers covering every role, no draft layers, one Engram layer."""
    cfg = shipped_config(base)
    if layers < len(ROLES):
        raise ValueError(f"--layers: expected >= {len(ROLES)} (one layer of each role), got {layers}")
    ratios = ROLES + (1,) * (layers - len(ROLES))
    heads, n = cfg.engram_n_heads, cfg.engram_max_ngram_size
    rows = sum(bucket_primes(1, n, heads, engram_vocab)[0])
    return cfg.replace(n_layers=layers, compress_ratios=ratios, kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
                       candidate_source_layer=4, engram_layer_ids=(1,), engram_vocab_size=engram_vocab,
                       engram_num_embeddings=(rows,), n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=())


def nbytes(t) -> int:
    return t.data.nbytes + t.scale.nbytes if isinstance(t, QTensor) else t.nbytes


def copy_bandwidth(device, size: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bytes/s (read + write) of ``size``-byte buffers, median of ``reps``."""
    src, dst = torch.empty(size, dtype=torch.uint8, device=device), torch.empty(size, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * size / statistics.median(times[2:])


def floor_bytes(cfg, weights: dict, batch: int, context: int) -> dict:
    """Bytes one decode step of ``batch`` sequences at ``context`` tokens must read, by part."""
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    distinct = E * (1 - (1 - k / E) ** batch)
    dense = expert = 0
    for name, t in weights.items():
        if not name.startswith("layers.") or ".engram.embed." in name:
            continue
        if ".ffn.experts." in name:
            expert += nbytes(t)
        else:
            dense += nbytes(t)
    row = cfg.dim * weights["embed.weight"].element_size()
    kv = 0
    for layer in range(cfg.n_layers):
        kv += cfg.window_size * (cfg.head_dim + cfg.head_dim // 32)  # fp8 ring + scales
        ratio = cfg.ratio(layer)
        if ratio:
            entries = context // ratio
            kv += min(cfg.index_topk, entries) * (cfg.head_dim // 2 + cfg.head_dim // 16)  # fp4_b16 picks
            if layer in cfg.index_source_layers:
                kv += entries * (cfg.index_head_dim // 2 + cfg.index_head_dim // 32)  # fp4_b32 index K
    parts = {"dense_weights": dense, "routed_experts": expert * distinct / E,
             "head": nbytes(weights["head.weight"]), "embedding_rows": batch * row, "kv": batch * kv}
    return {**parts, "total": sum(parts.values()), "distinct_experts_per_layer": distinct}


def measure(model, batch: int, prompt: int, steps: int, chunk: int, profile: int = 0) -> tuple[float, list]:
    """Median ms of a decode step replayed from CUDA graphs after a ``prompt``-token prefill, and
    with ``profile`` > 0 the GPU kernels of that many more replays (decode_profile.kernel_times)."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prompt), generator=gen).to(model.device)
    state = model.new_state(batch, prompt + steps + profile + 8)
    with flashrt.value_checks(False):
        for c0 in range(0, prompt, chunk):
            logits = model.forward(ids[:, c0:c0 + chunk], state=state)
        step = stepper(model, state, graph=True)
        tok = greedy_pick(logits)
        ms = median_step_ms(step, tok, steps, greedy=True)
        if not profile:
            return ms, []
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(profile):
                step(tok)
            torch.cuda.synchronize()
        return ms, kernel_times(prof, profile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="v4.1-flash")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--engram-vocab", type=int, default=200_000)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64, help="prefill tokens per forward call and sequence")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also record the GPU kernels of STEPS more replays per batch (their time per step, by name)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    cfg = slice_config(args.model, args.layers, args.engram_vocab)
    bw = copy_bandwidth(device)
    t0 = time.perf_counter()
    weights = device_weights(cfg, device)
    model = Model(cfg, weights)
    build_s = time.perf_counter() - t0
    print(f"{cfg.n_layers} layers built on the device in {build_s:.1f} s; "
          f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB; copy {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for batch in args.batches:
        step_ms, kernels = measure(model, batch, args.prompt, args.steps, args.chunk, args.profile)
        floor = floor_bytes(cfg, weights, batch, args.prompt + args.steps)
        floor_ms = floor["total"] / bw * 1e3
        row = {"batch": batch, "step_ms": step_ms, "per_layer_ms": step_ms / cfg.n_layers, "floor_ms": floor_ms,
               "per_layer_floor_ms": floor_ms / cfg.n_layers, "floor_ratio": step_ms / floor_ms, "floor_bytes": floor,
               "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}
        if kernels:
            row["kernels"] = kernels
        rows.append(row)
        print(f"batch {batch:4d}: step {step_ms:7.2f} ms ({row['per_layer_ms']:.3f} ms/layer), floor {floor_ms:6.3f} ms "
              f"-> {row['floor_ratio']:.1f}x floor", flush=True)
        for k in kernels[:12]:
            print(f"    {k['us_per_step']:9.1f} us  x{k['launches_per_step']:5.1f}  {k['kernel'][:80]}", flush=True)
    write_json(args.out, {"model": args.model, "config": cfg.to_dict(), "device": torch.cuda.get_device_name(),
                          "copy_bytes_per_s": bw, "build_s": build_s, "prompt": args.prompt, "rows": rows})


if __name__ == "__main__":
    main()
