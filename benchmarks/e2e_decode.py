"""End-to-end decode tokens/s: the cuda backend with and without CUDA-graph capture of the decode
step, and the reference backend, same run.

    python benchmarks/e2e_decode.py --model small --batches 1 8 64 --out benchmarks/results/h200-e2e.json

Each configuration prefills a random prompt (timed; on the kernel backends after one untimed
prefill of the same shape, so no kernel compiles inside it), then times ``--steps`` decode steps
(median per-step time, host clock around a synchronized step; tokens/s = batch / step time;
``pipelined_step_ms``: the mean of the same steps back to back, each fed the previous greedy pick
(``ops.sample`` at temperature 0) on the device, one sync at the end, as a loop that reads its
tokens one step late sees them). All modes run the same
weights and prompt. ``cuda+graph`` replays the step from engine/step_capture.py (the captures happen
in the warm-up steps; a bucket edge inside the timed steps costs one capture, the median ignores it;
the back-to-back mean does not, and ``pipelined_captures`` counts them).
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

import flashrt
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from decode_timing import greedy_pick, median_step_ms, pipelined_step_ms, stepper
from flashrt.engine.step_capture import StepCapture
from flashrt.graphs.model import Model
from results_io import add_ratio, write_json


MODES = ("cuda", "cuda+graph", "reference")


def decode(model, batch: int, prompt: int, steps: int, mode: str) -> dict:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prompt), generator=gen).cuda()
    # "cuda": automatic choice (kernels first, the reference for calls they decline); "reference": forced
    chosen = flashrt.use_backend("reference") if mode == "reference" else contextlib.nullcontext()
    with chosen, flashrt.value_checks(False):
        if mode != "reference":  # kernel compiles outside the timed prefill
            model.forward(ids, state=model.new_state(batch, prompt))
        state = model.new_state(batch, prompt + 2 * steps + 8)  # the synchronized steps, then the pipelined ones
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model.forward(ids, state=state)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        graphs = StepCapture(model, state) if mode == "cuda+graph" else None
        step = graphs.step if graphs else stepper(model, state, graph=False)
        per_step = median_step_ms(step, greedy_pick(logits), steps, greedy=True) / 1e3  # 2 warm-up (capture) steps
        pipelined = recaptured = None
        if mode != "reference":
            pipelined, recaptured = pipelined_step_ms(step, greedy_pick(logits), steps,
                                                      (lambda: graphs.stats["captured"]) if graphs else None)
    return {"mode": mode, "backend": "reference" if mode == "reference" else "cuda", "cuda_graph": graphs is not None,
            "batch": batch, "prompt": prompt, "prefill_s": prefill_s,
            "prefill_tokens_per_s": batch * prompt / prefill_s, "step_ms": per_step * 1e3,
            "decode_tokens_per_s": batch / per_step, "pipelined_step_ms": pipelined,
            "pipelined_captures": recaptured, "graph_stats": graphs.stats if graphs else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device="cuda"))
    for mode in args.modes:  # compile every kernel variant first: prefill figures exclude JIT time
        decode(model, 1, 256, 2, mode)
    rows = []
    for batch in args.batches:
        for mode in args.modes:
            row = decode(model, batch, args.prompt, args.steps, mode)
            rows.append(row)
            print(f"{mode:10} batch {batch:3d}: prefill {row['prefill_tokens_per_s']:10.1f} tok/s, "
                  f"decode {row['step_ms']:8.2f} ms/step = {row['decode_tokens_per_s']:8.2f} tok/s"
                  + (f", back to back {row['pipelined_step_ms']:.2f} ms/step" if row["pipelined_step_ms"] else "")
                  + (f" (WARNING: {row['pipelined_captures']} captures inside the back-to-back steps: fewer"
                     " --steps keep them out)" if row["pipelined_captures"] else ""),
                  flush=True)
    if "reference" in args.modes:
        add_ratio(rows, "mode", "decode_tokens_per_s", "decode_speedup_vs_reference", "batch", "reference")
    if "cuda" in args.modes:
        add_ratio(rows, "mode", "decode_tokens_per_s", "decode_speedup_vs_cuda_eager", "batch", "cuda")
    write_json(args.out, {"model": args.model, "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
