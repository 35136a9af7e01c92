"""Decode step time with the Engram tables in device memory vs pinned host memory, same model,
same run: eager steps (rows prefetched on a side stream) and CUDA-graph steps (rows staged into
static buffers before each replay, engine/step_capture.py).

    python benchmarks/engram_placement.py --model small --out benchmarks/results/h200-engram-placement.json
"""
from __future__ import annotations

import argparse
import statistics

import torch

from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from decode_timing import median_step_ms, stepper
from flashrt.graphs.model import Model
from results_io import add_ratio, write_json


def step_ms(model, batch: int, context: int, steps: int, graph: bool) -> float:
    ids = torch.randint(0, model.cfg.vocab_size, (batch, context), device="cuda")
    state = model.new_state(batch, context + steps + 4)
    model.forward(ids, state=state)
    return median_step_ms(stepper(model, state, graph), ids[:, -1], steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = shipped_config(args.model)
    rows = []
    models = {p: Model(cfg, init_weights(cfg, seed=0, device="cuda"), engram_placement=p)
              for p in ("device", "host_pinned")}
    for b in args.batches:
        for graph in (False, True):
            for p in models:  # compile every kernel shape first, then alternate the placements
                step_ms(models[p], b, args.context, 1, graph)
            times = {p: [] for p in models}
            for _ in range(3):
                for p, model in models.items():
                    times[p].append(step_ms(model, b, args.context, args.steps, graph))
            for p in models:
                ms = statistics.median(times[p])
                rows.append({"placement": p, "batch": b, "cuda_graph": graph, "context": args.context,
                             "step_ms": ms, "case": f"{b}/{graph}"})
                print(f"{p:12} batch {b:3d} graph {graph!s:5}: {ms:8.2f} ms/step", flush=True)
    add_ratio(rows, "placement", "step_ms", "ratio_to_device", "case", "device")
    write_json(args.out, {"model": args.model, "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
