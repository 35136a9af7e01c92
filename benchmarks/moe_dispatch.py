"""One expert-parallel MoE layer, gather + reduce-scatter against all-to-all, at decode batch sizes.

    python benchmarks/moe_dispatch.py --world 2 4 --batches 1 8 64 --out benchmarks/results/cpu-gloo-moe-dispatch.json

Each rank is its own process (gloo on CPU here; nccl on GPUs with ``--device cuda``) holding
``n_routed / world`` experts of the real V4.1-Flash layer shape (``dim`` 5120, 384 experts, top-6)
with a small intermediate dim (``--inter``), so the time is the exchange's (routing, collectives,
bookkeeping) more than the experts' math. ``--batches`` are tokens per group (``tp`` 1: every rank
is a group). The median of ``--steps`` timed layer calls per (world, batch, dispatch), with the
bytes each rank sends per call for both dispatches.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashrt.engine.launch import launch
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_param
from flashrt.graphs.moe import MoE
from flashrt.graphs.parallel import Layout, Parallel
from flashrt.graphs.params import param_specs
from flashrt.graphs.shard import local_specs
from results_io import write_json


def layer_config(inter: int):
    """V4.1-Flash with plain bf16 weights and a small expert intermediate dim (layer 0's MoE is used)."""
    return shipped_config("v4.1-flash").replace(moe_inter_dim=inter, expert_dtype=None, dtype="bf16")


def _rank(rank, device, world, batches, steps, inter, report):
    torch.set_num_threads(1)
    cfg = layer_config(inter)
    layout = Layout(1, world, rank)
    names = {s.name for s, _, _ in local_specs(cfg, layout) if s.name.startswith("layers.0.ffn.")}
    w = {s.name: init_param(s, 0, device) for s in param_specs(cfg) if s.name in names}
    rows, sync = [], (torch.cuda.synchronize if device.type == "cuda" else (lambda: None))
    for dispatch in ("gather", "all_to_all"):
        moe = MoE(cfg, 0, dict(w), "layers.0.", Parallel(layout, dispatch))
        for b in batches:
            x = torch.randn(b, 1, cfg.dim, generator=torch.Generator().manual_seed(rank)).to(device, torch.bfloat16)
            times = []
            for i in range(steps + 2):
                sync()
                t0 = time.perf_counter()
                moe.forward(x)
                sync()
                if i >= 2:  # two warm-up calls
                    times.append(time.perf_counter() - t0)
            moe.par.take_load()
            rows.append({"world": world, "batch": b, "dispatch": dispatch, "ms": 1e3 * statistics.median(times)})
    return rows


def sent_bytes(cfg, world: int, batch: int, dispatch: str) -> float:
    """Bytes one rank sends per layer call (the collectives' own algorithms aside): the gather sends
    its tokens (bf16) to every other rank and reduce-scatters fp32 sums; all-to-all sends each
    token once to each other rank holding some of its top-k experts (expected count, experts drawn
    uniformly), 12 bytes per (token, expert) pair, and gets one fp32 sum per row back."""
    d, k = cfg.dim, cfg.n_activated_experts
    if dispatch == "gather":
        return (world - 1) * batch * d * (2 + 4)
    rows = batch * (world - 1) * (1 - (1 - 1 / world) ** k)
    return rows * d * (2 + 4) + batch * k * (world - 1) / world * 12 + world * 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--inter", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg, rows = layer_config(args.inter), []
    for world in args.world:
        got = launch(_rank, world, (world, args.batches, args.steps, args.inter), device=args.device, timeout_s=300)
        for r in got[0]:
            r["ms_max_over_ranks"] = max(g["ms"] for rank in got for g in rank
                                         if (g["batch"], g["dispatch"]) == (r["batch"], r["dispatch"]))
            r["sent_bytes_per_rank"] = sent_bytes(cfg, world, r["batch"], r["dispatch"])
            rows.append(r)
            print(f"world {world} batch {r['batch']:4d} {r['dispatch']:10s} {r['ms_max_over_ranks']:8.2f} ms  "
                  f"{r['sent_bytes_per_rank'] / 1e6:8.3f} MB sent per rank")
    write_json(args.out, {"device": args.device, "inter": args.inter, "rows": rows})


if __name__ == "__main__":
    main()
