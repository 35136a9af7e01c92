"""Where a speculative verify round's time goes: the captured verify forward, the commit of the kept
tokens (``VerifyCapture.keep``) and the GPU kernels of each, next to a plain captured decode step.

    python benchmarks/verify_breakdown.py --model small --batch 1 --k 4 --out /tmp/verify-breakdown.json

Prefills a random prompt, then times (median of ``--steps``, host clock, synchronized) a plain
``StepCapture`` step, and rounds of ``VerifyCapture.verify`` of ``k + 1`` tokens per row followed
by its ``keep`` of one token per row, each phase timed on its own. A torch-profiler pass over the same
rounds sums the GPU kernel time and counts the kernels of each phase: a phase whose wall time is far
above its kernel time is bound by host work (launches, Python), not by the device.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import flashrt
from flashrt.engine import spec_costs
from flashrt.engine.step_capture import StepCapture
from flashrt.engine.verify_capture import VerifyCapture
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model


def phase_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


TOP = 15  # the kernels a phase's report names, by their GPU time


def gpu_us(fn, steps: int) -> tuple[float, float, list]:
    """(GPU kernel us per call, kernels per call, the ``TOP`` kernels by time: [name, us per call,
    launches per call]) of ``fn`` under the torch profiler."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    by_name: dict = {}
    for e in kernels:
        us, count = by_name.get(e.name, (0.0, 0))
        by_name[e.name] = (us + e.time_range.elapsed_us(), count + 1)
    top = sorted(([name[:80], round(us / steps, 2), count / steps] for name, (us, count) in by_name.items()),
                 key=lambda r: -r[1])[:TOP]
    return sum(e.time_range.elapsed_us() for e in kernels) / steps, len(kernels) / steps, top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device="cuda"))
    B, k, n = args.batch, args.k, args.steps
    with flashrt.value_checks(False):
        state, tok = spec_costs.prefilled(model, B, args.prompt, 4 * (n + 4) * (k + 2))
        plain, verifier = StepCapture(model, state), VerifyCapture(model, state)
        ids = tok.unsqueeze(1).expand(B, k + 1).contiguous()
        ones = torch.ones(B, dtype=torch.long)
        step = lambda: plain.step(tok)
        verify = lambda: verifier.verify(ids)
        commit = lambda: verifier.keep(ids, ones)
        for _ in range(3):
            step(), verify(), commit()
        rows = {"decode": [], "verify": [], "keep": []}
        for _ in range(n):
            rows["decode"].append(phase_ms(step))
            rows["verify"].append(phase_ms(verify))
            rows["keep"].append(phase_ms(commit))
        out = {name: {"ms": statistics.median(v)} for name, v in rows.items()}
        for name, fn in (("decode", step), ("verify", lambda: (verify(), commit()))):
            us, launches, top = gpu_us(fn, n)
            out[name].update(gpu_us=us, kernels=launches, top=top)
        us, launches, top = gpu_us(commit, n)
        out["keep"].update(gpu_us=us, kernels=launches, top=top)
    print(f"batch {B}, k {k}: " + "; ".join(f"{name} {v['ms']:.2f} ms wall, {v['gpu_us'] / 1e3:.2f} ms GPU in "
                                             f"{v['kernels']:.0f} kernels" for name, v in out.items()))
    print(f"(verify GPU/kernels include keep's) verifier {verifier.stats}, plain {plain.stats}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "batch": B, "k": k, "prompt": args.prompt, "phases": out}, f, indent=1)


if __name__ == "__main__":
    main()
