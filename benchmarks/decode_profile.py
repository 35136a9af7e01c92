"""Where a CUDA-graph decode step's GPU time goes: the kernels of a few replays, by name.

    python benchmarks/decode_profile.py --model small --batch 8 --out /tmp/decode-profile.json

Prefills a random prompt, captures the decode step (engine/step_capture.py), then records
``--steps`` replays with the torch profiler (CUPTI sees the kernels inside a graph) and prints the
kernels sorted by their total GPU time per step, with their share of the step.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

import flashrt
from flashrt.graphs.config import shipped_config
from flashrt.engine.step_capture import StepCapture
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from decode_timing import greedy_pick


def gpu_events(prof) -> list:
    """The profiler's events that ran on the GPU (kernels and copies)."""
    return [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]


def kernel_times(prof, steps: int) -> list[dict]:
    """(name, us per step, launches per step) of every GPU kernel the profiler saw."""
    total, count = defaultdict(float), defaultdict(int)
    for e in gpu_events(prof):
        total[e.name] += e.time_range.elapsed_us()
        count[e.name] += 1
    rows = [{"kernel": k, "us_per_step": v / steps, "launches_per_step": count[k] / steps} for k, v in total.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device="cuda"))
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device="cuda")
    with flashrt.value_checks(False):
        state = model.new_state(args.batch, args.prompt + args.steps + 8)
        tok = greedy_pick(model.forward(ids, state=state))
        graphs = StepCapture(model, state)
        for _ in range(2):  # capture
            tok = greedy_pick(graphs.step(tok))
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                tok = greedy_pick(graphs.step(tok))
            torch.cuda.synchronize()
    rows = kernel_times(prof, args.steps)
    step_us = sum(r["us_per_step"] for r in rows)
    for r in rows:
        r["share"] = r["us_per_step"] / step_us
    print(f"GPU time per decode step: {step_us / 1e3:.2f} ms over {sum(r['launches_per_step'] for r in rows):.0f} "
          f"kernels ({graphs.stats})")
    for r in rows[:25]:
        print(f"{r['us_per_step']:9.1f} us {100 * r['share']:5.1f}%  x{r['launches_per_step']:5.1f}  {r['kernel'][:90]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "batch": args.batch, "step_us": step_us, "kernels": rows}, f, indent=1)


if __name__ == "__main__":
    main()
