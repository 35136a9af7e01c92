"""How an engine's decode steps ran: replayed from CUDA graphs, captured, eager (and why), or as a
plain forward, with the engine's time split, for ``--requests`` prompts of ``--input-len`` tokens
generating ``--output-len`` each at ``--max-running`` in flight (offline ``Engine.generate``, no
server).

    python tools/engine_step_stats.py --model small --requests 128 --max-running 64 --out /tmp/steps.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from flashrt.engine import Engine, SamplingParams
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device=args.device))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (args.requests, args.input_len), generator=gen).tolist()
    engine = Engine(model, max_running=args.max_running, max_model_len=args.input_len + args.output_len + 8)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    stats = {k: v for k, v in engine.stats().items() if isinstance(v, (int, float))}
    slots = engine.step_loop.slots
    runners = {rows: dict(cap.stats) for rows, (_, cap) in slots.cache.items() if cap is not None}
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    res = {"model": args.model, "device": str(model.device), "requests": args.requests,
           "max_running": args.max_running, "seconds": seconds, "output_tokens": tokens,
           "output_tokens_per_s": tokens / seconds, "stats": stats, "runners": runners,
           "uncapturable": slots.uncapturable}
    print(json.dumps(res, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    engine.shutdown()


if __name__ == "__main__":
    main()
