"""The routed experts' error against the reference over many random inputs, with the activations
quantized in the kernels (fp8 weights take the fp8 MMA) and handed over dequantized
(``tiles.moe.act_dequantized``: the bf16 MMA on decoded weights).

    python tools/moe_error.py [--fmt fp8_w] [--tokens 37] [--seeds 300] [--json OUT]

Each seed draws x, the routing (a token's slots may repeat an expert) and the weights; the
CUDA launchers run them on the direct, combine-in-kernel path (the tiles pinned, whatever the
device's profile sets) and the result's relative error ``||got - want|| / ||want||`` against the
reference backend is collected. Prints and writes the maximum, the 99th percentile, the median
and how many seeds pass 2e-3 for each setting: what a kernel test's tolerance must cover.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import flashrt
from flashrt import formats, ops, profiles

PINNED = dict(direct=True, combine=dict(in_kernel=True), pair_tiles=0)


def draw(seed: int, fmt: str, n: int, D: int, I: int, E: int, k: int, device: str):
    """One case's inputs: x [n, D] bf16, routing weights and indices [n, k], w1 / w3 / w2."""
    rng = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, D, generator=rng) * 3.0).to(device, torch.bfloat16)
    idx = torch.randint(0, E, (n, k), generator=rng, dtype=torch.int32).to(device)
    rw = torch.rand(n, k, generator=rng).to(device)
    w = [formats.quantize(torch.randn(*s, generator=rng) * 0.25, fmt).to(device)
         for s in ((E, I, D), (E, I, D), (E, D, I))]
    return x, rw, idx, *w, 10.0


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def errors(args, act_dequantized: bool) -> list[float]:
    out = []
    tiles = dict(moe=dict(PINNED, act_dequantized=act_dequantized))
    for seed in range(1, args.seeds + 1):
        case = draw(seed, args.fmt, args.tokens, args.D, args.I, args.experts, args.topk, args.device)
        with profiles.using(dataclasses.replace(profiles.active_profile(), tiles=tiles)):
            with flashrt.use_backend("cuda"):
                got = ops.moe_experts(*case)
        with flashrt.use_backend("reference"):
            want = ops.moe_experts(*case)
        out.append(rel_err(got, want))
    return out


def summary(errs: list[float]) -> dict:
    t = torch.tensor(errs, dtype=torch.float64)
    return dict(max=t.max().item(), p99=t.quantile(0.99).item(), median=t.median().item(),
                over_2e3=int((t >= 2e-3).sum()), seeds=len(errs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmt", default="fp8_w", choices=("fp8_w", "fp4_w"))
    ap.add_argument("--tokens", type=int, default=37)
    ap.add_argument("--D", type=int, default=96)
    ap.add_argument("--I", type=int, default=64)
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the summaries here")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds: expected at least 1, got {args.seeds}")
    result = dict(case=dict(fmt=args.fmt, tokens=args.tokens, D=args.D, I=args.I, experts=args.experts,
                            topk=args.topk, device=args.device))
    for adq in (False, True):
        result[f"act_dequantized={adq}"] = summary(errors(args, adq))
        print(f"act_dequantized={adq}: {result[f'act_dequantized={adq}']}", flush=True)
    if args.json:
        with open(args.json, "x") as f:  # never over an existing file
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
