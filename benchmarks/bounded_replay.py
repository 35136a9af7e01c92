"""Prefix-cache hit vs full prefill: logit deviation as a function of the tokens replayed.

    python benchmarks/bounded_replay.py --model tiny --out benchmarks/results/cpu-tiny-bounded-replay.json

A prompt's full prefix-cache entry is exported and loaded into a fresh state. A hit (the row with
``replay_tokens`` null) loads the stored window state: no replay, exact. The other rows are the
``generate(..., prefix_replay=N)`` option: only the global KV is loaded and the last ``N`` tokens
are replayed through every layer (replaying ``n_layers * window_size`` tokens covers the window
receptive field and is exact).
"""
from __future__ import annotations

import argparse

import torch

from flashrt.engine import prefix
from flashrt.engine.prefix_entry import FULL, export_row, parse
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from results_io import write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0))
    n, W = args.tokens, cfg.window_size
    replays = [None] + sorted({W, 2 * W, 4 * W, cfg.n_layers * W, n} - {0})
    gen = torch.Generator().manual_seed(0)
    rows = {r: [] for r in replays}
    for _ in range(args.prompts):
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)
        state = model.new_state(1, n + 8)
        full = model.forward(ids, state=state)
        entry = parse(export_row(state, 0, n, full[0]), cfg, model.window_fmt, n, FULL)
        for r in replays:
            hit = prefix.restore(model, model.new_state(1, n + 8), [entry], ids, n, replay=r)
            rows[r].append((float((hit - full).norm() / full.norm()), bool(hit.argmax() == full.argmax()),
                            torch.equal(hit, full)))
    result = {"model": args.model, "prompt_tokens": n, "window_size": W, "n_layers": cfg.n_layers, "rows": [
        {"replay_tokens": r, "rel_l2_median": float(torch.tensor([e for e, _, _ in v]).median()),
         "top1_agreement": sum(t for _, t, _ in v) / len(v), "bit_identical": sum(q for _, _, q in v) / len(v)}
        for r, v in rows.items()]}
    for row in result["rows"]:
        print(row)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
