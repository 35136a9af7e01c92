"""End-to-end decode tokens/s of a model with the cuda backend vs the reference backend, same run.

    python benchmarks/e2e_decode.py --model small --batches 1 8 --out benchmarks/results/h200-e2e.json

Each configuration prefills a random prompt, then times ``--steps`` decode steps (median per-step
time; tokens/s = batch / step time). Both backends run the same weights and the same tokens.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import flashrt
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from results_io import add_ratio, write_json


def decode(model, batch: int, prompt: int, steps: int, backend: str) -> dict:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prompt), generator=gen).cuda()
    # "cuda": automatic choice (kernels first, the reference for calls they decline); "reference": forced
    chosen = flashrt.use_backend("reference") if backend == "reference" else contextlib.nullcontext()
    with chosen, flashrt.value_checks(False):
        state = model.new_state(batch, prompt + steps + 4)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model.forward(ids, state=state)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        tok = logits.argmax(-1, keepdim=True)
        model.forward(tok, state=state)  # warm-up step
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = model.forward(tok, state=state)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            tok = logits.argmax(-1, keepdim=True)
    step = statistics.median(times)
    return {"backend": backend, "batch": batch, "prompt": prompt, "prefill_s": prefill_s,
            "prefill_tokens_per_s": batch * prompt / prefill_s, "step_ms": step * 1e3,
            "decode_tokens_per_s": batch / step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device="cuda"))
    rows = []
    for batch in args.batches:
        for backend in ("cuda", "reference"):
            row = decode(model, batch, args.prompt, args.steps, backend)
            rows.append(row)
            print(f"{backend:9} batch {batch:3d}: prefill {row['prefill_tokens_per_s']:10.1f} tok/s, "
                  f"decode {row['step_ms']:8.2f} ms/step = {row['decode_tokens_per_s']:8.2f} tok/s", flush=True)
    add_ratio(rows, "backend", "decode_tokens_per_s", "decode_speedup_vs_reference", "batch", "reference")
    write_json(args.out, {"model": args.model, "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
