"""DSpark speculative decoding costs: verify step of k tokens against a plain decode step, the draft's
own time, the expected speed-up at given acceptance rates, and measured tokens/s at full acceptance.

With random weights the draft's acceptance is ~0, so the figures that decide the speed-up are the
costs: per batch size, the median time of a plain decode step, of a verify step with ``k = 1 ..
block_size`` drafts (``k + 1`` tokens per row, one chunk, then the per-row commit) and of one
draft call, all CUDA-graph replays on a GPU (engine/spec_costs.py: StepCapture, VerifyCapture,
DraftCapture; the same static-buffer steps eagerly elsewhere), plus the eager plain step. From
those, at an acceptance rate ``a`` per drafted position (independent positions), a round gains
``(1 - a^(k+1)) / (1 - a)`` tokens per row in ``draft + verify(k)`` time, against one token per
plain step. The forced mode (``Decoder(force_accept=True)``, a benchmark-only switch that accepts
every draft) runs captured rounds of ``k = block_size`` and reports the tokens/s measured.
``costs`` is the table the adaptive choice reads (``speculative_costs`` of a device profile;
``flashrt tune --speculative MODEL`` writes it into a profile directly).

    python benchmarks/speculative.py --model small --batches 1 8 64 --out benchmarks/results/h200-speculative.json
    python benchmarks/speculative.py --model tiny --batches 1 2 --prompt 16 --steps 2 --device cpu --out /tmp/s.json
"""
from __future__ import annotations

import argparse
import time

import torch

import flashrt
from decode_timing import median_step_ms, stepper
from flashrt.engine import spec_costs
from flashrt.engine import speculative as spec
from flashrt.engine.draft_capture import DraftCapture
from flashrt.engine.verify_capture import VerifyCapture
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from results_io import write_json

ACCEPTANCE = (0.5, 0.7, 0.9)


def expected_speedup(decode_ms: float, draft_ms: float, verify_ms: float, k: int, a: float) -> float:
    tokens = (1 - a ** (k + 1)) / (1 - a)
    return tokens * decode_ms / (draft_ms + verify_ms)


def measure(model, batch: int, prompt: int, steps: int, graph: bool) -> dict:
    """Captured (on CUDA) plain, draft and verify steps (spec_costs.measure), the eager plain step,
    the expected speed-ups and the forced-acceptance rate."""
    row = spec_costs.measure(model, batch, prompt, steps)
    state, tok = spec_costs.prefilled(model, batch, prompt, steps + 4)
    row["decode_ms_eager"] = median_step_ms(stepper(model, state, False), tok, steps)
    row["decode_ms_graph"] = row["decode_ms"] if graph else None
    decode_ms = row["decode_ms"]
    row["verify_over_decode"] = {k: v / decode_ms for k, v in row["verify_ms"].items()}
    row["draft_over_decode"] = row["draft_ms"] / decode_ms
    row["expected_speedup"] = {
        str(a): {k: expected_speedup(decode_ms, row["draft_ms"], v, k, a) for k, v in row["verify_ms"].items()}
        for a in ACCEPTANCE}
    row["forced"] = forced(model, batch, prompt, steps, decode_ms)
    return row


def forced(model, batch: int, prompt: int, rounds: int, decode_ms: float) -> dict:
    """Rounds of ``k = block_size`` with every draft accepted (captured draft and verify steps on
    CUDA): measured tokens/s."""
    K = model.cfg.dspark_block_size
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    state, tok = spec_costs.prefilled(model, batch, prompt, (rounds + 3) * (K + 2))
    dec = spec.Decoder(model, state, draft_tokens=K, force_accept=True, verifier=VerifyCapture(model, state),
                       drafter=DraftCapture(model, state))
    for _ in range(2):  # warm-up: records the graphs
        _, tok = dec.step(tok, K + 1)
    sync()
    t0 = time.perf_counter()
    for _ in range(rounds):
        _, tok = dec.step(tok, K + 1)
    sync()
    seconds = time.perf_counter() - t0
    tokens = rounds * (K + 1) * batch
    return {"rounds": rounds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "plain_tokens_per_s": batch / (decode_ms / 1e3), "speedup": tokens / seconds / (batch / (decode_ms / 1e3))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)  # small CPU shapes: thread fan-out costs more than it gains
    cfg = shipped_config(args.model)
    if not cfg.dspark_block_size:
        raise SystemExit(f"--model: {args.model} has no DSpark draft layers")
    model = Model(cfg, init_weights(cfg, seed=0, device=args.device))
    graph = model.device.type == "cuda"
    rows = []
    with flashrt.value_checks(False):
        for batch in args.batches:
            row = measure(model, batch, args.prompt, args.steps, graph)
            rows.append(row)
            v = ", ".join(f"k={k} {r:.2f}x" for k, r in row["verify_over_decode"].items())
            print(f"batch {batch:3d}: decode {row['decode_ms']:.2f} ms, draft "
                  f"{row['draft_over_decode']:.2f}x, verify {v}, forced {row['forced']['tokens_per_s']:.1f} tok/s "
                  f"({row['forced']['speedup']:.2f}x)", flush=True)
    costs = {r["batch"]: spec_costs.cost_entry(r) for r in rows}
    device = torch.cuda.get_device_name() if graph else "cpu"
    write_json(args.out, {"model": args.model, "device": device, "torch": torch.__version__,
                          "verify_cuda_graph": graph, "draft_cuda_graph": graph, "decode_cuda_graph": graph, "rows": rows, "costs": costs})


if __name__ == "__main__":
    main()
