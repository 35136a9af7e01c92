"""CED vs exact prefill: logit deviation and time ratio, plus decode tokens/s, in one run.

    python benchmarks/prefill_schedules.py --model small --lengths 1024 4096 --out results.json

Builds the model from deterministic weights (seed 0) on the device, prefills random prompts with
both schedules (median of ``--repeats`` timed runs after a warm-up) and compares the last-position
logits: relative L2 deviation, top-1 agreement, and KL(exact || ced).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from flashrt.graphs.config import shipped_config
from flashrt.graphs.prefill import prefill_prompt
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from results_io import write_json


def timed_prefill(model, ids, schedule, repeats, sync):
    times, logits = [], None
    for i in range(repeats + 1):
        state = model.new_state(ids.shape[0], ids.shape[1] + 8)
        sync()
        t0 = time.perf_counter()
        logits = prefill_prompt(model, ids, state, schedule)
        sync()
        if i:  # the first run is the warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times), logits, state


def compare(exact: torch.Tensor, ced: torch.Tensor) -> dict:
    rel = float((ced - exact).norm() / exact.norm())
    pe, pc = torch.log_softmax(exact, -1), torch.log_softmax(ced, -1)
    kl = float((pe.exp() * (pe - pc)).sum(-1).mean())
    top1 = float((exact.argmax(-1) == ced.argmax(-1)).float().mean())
    return {"rel_l2": rel, "kl_exact_ced": kl, "top1_agreement": top1}


def decode_rate(model, state, steps, sync) -> float:
    tok = torch.randint(0, model.cfg.vocab_size, (state.batch, 1), device=model.device)
    model.forward(tok, state=state)  # warm-up
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        model.forward(tok, state=state)
    sync()
    return steps * state.batch / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    cfg = shipped_config(args.model)
    t0 = time.perf_counter()
    model = Model(cfg, init_weights(cfg, seed=0, device=dev))
    build_s = time.perf_counter() - t0
    rows = []
    gen = torch.Generator().manual_seed(1234)
    for n in args.lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(dev)
        t_exact, l_exact, state = timed_prefill(model, ids, "exact", args.repeats, sync)
        t_ced, l_ced, _ = timed_prefill(model, ids, "ced", args.repeats, sync)
        row = {"prompt_tokens": n, "exact_s": t_exact, "ced_s": t_ced, "time_ratio_ced_over_exact": t_ced / t_exact,
               **compare(l_exact.float(), l_ced.float()),
               "decode_tokens_per_s": decode_rate(model, state, args.decode_steps, sync)}
        rows.append(row)
        print(f"N={n:6d} exact {t_exact:8.3f}s ced {t_ced:8.3f}s ratio {row['time_ratio_ced_over_exact']:.3f} "
              f"rel_l2 {row['rel_l2']:.4f} kl {row['kl_exact_ced']:.5f} top1 {row['top1_agreement']:.2f} "
              f"decode {row['decode_tokens_per_s']:.2f} tok/s", flush=True)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    result = {"model": args.model, "device": device_name, "torch": torch.__version__, "backend": "reference",
              "build_seconds": build_s, "rows": rows}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
