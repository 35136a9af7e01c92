"""Which Triton kernel variants a serving workload meets after the engine's warm-up (each one a
compile in the middle of serving).

    python tools/serve_variants.py --model small --max-running 64 --passes 4 [--lengths chunks|any] [--json OUT]

How: an :class:`~flashrt.engine.Engine` over ``--model``'s shipped config (random weights) runs its
warm-up (``engine/warmup.py``), then ``--passes`` random workloads through ``Engine.generate``:
a random number of requests (1 .. 2 x ``--max-running``), prompts of whole prefill chunks
(``--lengths chunks``, as the serving benchmark sends) or of any length up to two chunks
(``any``), random output lengths and draws. Every launch goes through the CUDA backend's launchers
on the CPU and is recorded for ``--arch`` with ``--profile``'s tiles instead of compiled and run,
as ``tools/decode_variants.py`` does (same patches; ``ops.sample`` runs on the reference backend,
since its draws must be real tokens). Printed: the variants the warm-up met, then per pass the new
ones, each with the forward it came from (``[rows, tokens] at position``, or the decode batch) and
the fields where it differs from the closest variant of its kernel met before.
Exit status 0; "new after the warm-up: none" when no pass met one.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

from decode_variants import _positive, closest_diff, cuda_on_cpu, empty_as_zeros, load_target, target_args  # noqa: E402
from jit_coverage import fields  # noqa: E402

import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import ops, profiles  # noqa: E402
from flashrt.jit_compile import kernel_name, recording, variant_key  # noqa: E402
from flashrt.jit_parallel import portable_options  # noqa: E402


class Where:
    """The forward a launch belongs to, kept up to date by wrapping the model's and the decode
    graph runner's entry points."""

    def __init__(self):
        from flashrt.engine import step_capture
        from flashrt.graphs.model import Model

        self.at, self.patched = "?", []
        forward, step = Model.forward, step_capture.StepCapture.step
        where = self

        def _forward(model, ids, *a, **k):
            state = k.get("state")
            start = state.host_positions[0] if state is not None and state.host_positions else 0
            where.at = f"[{ids.shape[0]}, {ids.shape[1]}] at {start}"
            return forward(model, ids, *a, **k)

        def _step(runner, ids):
            where.at = f"decode batch {runner.state.batch}"
            return step(runner, ids)

        self.patched = [(Model, "forward", forward), (step_capture.StepCapture, "step", step)]
        Model.forward, step_capture.StepCapture.step = _forward, _step

    def close(self):
        for owner, name, fn in self.patched:
            setattr(owner, name, fn)


def workload(rng: random.Random, cfg, max_running: int, chunk: int, lengths: str):
    """One pass's prompts and sampling parameters."""
    from flashrt.engine import SamplingParams

    n = rng.randrange(1, 2 * max_running + 1)
    size = (lambda: chunk * rng.randrange(1, 3)) if lengths == "chunks" else (lambda: rng.randrange(1, 2 * chunk + 1))
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(size())] for _ in range(n)]
    params = [SamplingParams(temperature=rng.choice([0, 0.8]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]),
                             max_tokens=rng.randrange(1, 10), ignore_eos=True, seed=rng.randrange(1 << 30))
              for _ in range(n)]
    return prompts, params


def run(cfg, profile, arch, max_running: int, chunk: int, passes: int, lengths: str, seed: int = 0,
        step_tokens: int | None = None) -> dict:
    """``{"warmup": count, "passes": [{"requests", "new": [{"kernel", "at"}]}]}``."""
    from flashrt.engine import Engine
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    seen, phase = {}, {"pass": 0}
    where = Where()

    def record(fn, signature, constexprs, options, attrs):
        name = kernel_name(fn)
        key = variant_key(fn.__module__, name, signature, constexprs, attrs, portable_options(options.__dict__))
        if key not in seen:
            seen[key] = {"pass": phase["pass"], "kernel": name, "at": where.at,
                         "fields": fields(fn, signature, constexprs, attrs, options.__dict__)}

    real_sample = ops.sample

    def sample(*a, **k):  # real tokens: the launchers downstream read them as ids
        with flashrt.use_backend("reference"):
            return real_sample(*a, **k)

    ops.sample = sample
    out = {"passes": []}
    try:
        torch.manual_seed(seed)
        with profiles.using(profile), cuda_on_cpu(), empty_as_zeros():
            model = Model(cfg, init_weights(cfg, seed=seed, device="cpu"))
            engine = Engine(model, max_running=max_running, prefill_chunk=chunk,
                            max_step_tokens=max(chunk, step_tokens or profile.serve_max_step_tokens))
            with flashrt.value_checks(False), recording(arch, record):
                engine.warm_up()
                out["warmup"] = len(seen)
                for p in range(1, passes + 1):
                    phase["pass"] = p
                    prompts, params = workload(random.Random(seed * 1000 + p), cfg, max_running, chunk, lengths)
                    engine.generate(prompts, params)
                    before = [v for v in seen.values() if v["pass"] < p]
                    out["passes"].append({"requests": len(prompts),
                                          "new": [{"kernel": v["kernel"], "at": v["at"], "differs": closest_diff(v, before)}
                                                  for v in seen.values() if v["pass"] == p]})
    finally:
        ops.sample = real_sample
        where.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target_args(ap)
    ap.add_argument("--max-running", type=_positive, default=16)
    ap.add_argument("--chunk", type=_positive, default=512, help="the engine's prefill chunk")
    ap.add_argument("--passes", type=_positive, default=3)
    ap.add_argument("--max-step-tokens", type=_positive, default=None,
                    help="the engine's step budget (default: the profile's serve_max_step_tokens)")
    ap.add_argument("--lengths", choices=("chunks", "any"), default="chunks",
                    help="prompt lengths: whole chunks (as the serving benchmark) or any up to two chunks")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    target = load_target(args, "serve_variants")
    if target is None:
        return 2
    cfg, profile, arch = target
    t0 = time.perf_counter()
    result = run(cfg, profile, arch, args.max_running, args.chunk, args.passes, args.lengths, args.seed,
                 args.max_step_tokens)
    print(f"{args.model} on {arch.name} ({profile.name}), max_running {args.max_running}, chunk {args.chunk}: "
          f"{result['warmup']} variants in the warm-up")
    for i, p in enumerate(result["passes"], 1):
        print(f"pass {i}: {p['requests']} requests, {len(p['new'])} new")
        for v in p["new"]:
            diff = v["differs"]
            print(f"    {v['kernel']} ({v['at']}): " + ("no earlier variant of this kernel" if diff is None else
                                                       "; ".join(f"{f} {a} (was {b})" for f, (a, b) in diff.items())))
    total = sum(len(p["new"]) for p in result["passes"])
    print(f"new after the warm-up: {total or 'none'} ({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "profile": profile.name, "arch": arch.name, "max_running": args.max_running,
                       "chunk": args.chunk, "lengths": args.lengths, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
