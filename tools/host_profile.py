"""Where the host's time goes in a warm run: ``cProfile`` of the calling thread over one measured
pass, after an identical warm-up pass (kernel compiles, graph captures) in the same process.

    python tools/host_profile.py generate --model small --batch 64 --out /tmp/prof
    python tools/host_profile.py engine --model small --requests 128 --max-running 64 --out /tmp/prof
    python tools/host_profile.py prefix-hit --model small --tokens 32768 --out /tmp/prof

``generate``: ``flashrt.generate`` at ``--batch`` rows. ``engine``: offline ``Engine.generate`` of
``--requests`` prompts at ``--max-running`` in flight (the serving engine without a server), with
device timing of its phases. ``prefix-hit``: a ``--tokens`` prompt loaded from the prefix cache
(stored by the warm-up). Writes ``<scenario>.txt`` (the functions with the most own time and the
most cumulative time) and ``<scenario>.json`` (wall time and the scenario's own counters) to
``--out``; a function's time includes waits for the device where the host synchronizes in it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from flashrt.engine import Engine, SamplingParams, generate
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.kv.prefix_cache import PrefixCache


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def _prompts(cfg, n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (n, length), generator=gen).tolist()


def scenario(args, model):
    """``(warm-up, measured, counters)``: two calls doing the same work, and what to report after."""
    cfg = model.cfg
    if args.scenario == "generate":
        prompts = _prompts(cfg, args.batch, args.input_len)
        run = lambda: generate(model, prompts, args.output_len)  # noqa: E731
        return run, run, lambda out: {"decode_seconds": out.decode_seconds, "prefill_seconds": out.prefill_seconds,
                                      "decode_step_ms": 1e3 * out.decode_seconds / max(args.output_len - 1, 1)}
    if args.scenario == "engine":
        prompts = _prompts(cfg, args.requests, args.input_len)
        engine = Engine(model, max_running=args.max_running, device_timing=True,
                        max_model_len=args.input_len + args.output_len + 8)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        before = {}

        def measured():
            before.update(engine.stats())
            return engine.generate(prompts, params)

        def counters(_):
            after = engine.stats()
            return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}
        return (lambda: engine.generate(prompts, params)), measured, counters
    cache = PrefixCache(tempfile.mkdtemp())
    first, ids = _prompts(cfg, 2, args.tokens)
    hit = lambda p: generate(model, [p], 1, prefill_chunk=8192, prefix_cache=cache)  # noqa: E731

    def warmup():  # a miss and a hit of another prompt of the same length (the hit's kernels compile),
        for p in (first, first, ids):  # then the miss that stores the measured prompt
            hit(p)
    return warmup, lambda: hit(ids), lambda _: {"prefix_hits": cache.hits}


def table(prof: cProfile.Profile, key: str, n: int) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=("generate", "engine", "prefix-hit"))
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32768, help="prompt length of prefix-hit")
    ap.add_argument("--top", type=int, default=45, help="rows of each table")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True, help="folder for <scenario>.txt and <scenario>.json")
    args = ap.parse_args()
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device=args.device))
    warm, measured, counters = scenario(args, model)
    t0 = time.perf_counter()
    warm()
    _sync(model)
    warm_s = time.perf_counter() - t0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    out = measured()
    _sync(model)
    prof.disable()
    seconds = time.perf_counter() - t0
    res = {"scenario": args.scenario, "model": args.model, "device": str(model.device), "args": vars(args),
           "warmup_seconds": warm_s, "seconds": seconds, **counters(out)}
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{args.scenario}.json").write_text(json.dumps(res, indent=1, default=str))
    (folder / f"{args.scenario}.txt").write_text(table(prof, "tottime", args.top) + table(prof, "cumulative", args.top))
    print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
