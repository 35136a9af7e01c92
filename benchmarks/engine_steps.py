"""Where a serving engine's time goes on the device: its steps in process, against ``generate()``.

    python benchmarks/engine_steps.py --model small --concurrency 64 --out F [--no-overlap] [--no-prefill-graphs]

No HTTP, no engine process: an :class:`~flashrt.engine.Engine` over ``--model`` (random weights,
CUDA graphs, the serving defaults) is stepped in this thread by a closed loop of ``--concurrency``
requests (a new one arrives whenever one finishes, or with ``--arrivals-per-step N`` at most N
before each step, spread out as over a network; ``--requests`` in all, ``--input-len`` random
prompt ids and ``--output-len`` greedy tokens each), as ``benchmarks/serve_host_overhead.py`` does
on CPU. One untimed level first (compiles, captures), then:

* a timed level: output tokens/s, and per step its wall time and the stepping thread's CPU time
  (medians over decode-only steps: the steady state), against ``generate()`` at a batch of
  ``--concurrency`` in the same process (its second call timed);
* the same level under the torch profiler (CUDA activity): the share of the level's span the GPU
  ran kernels (``gpu_busy``), the idle time between kernels, and kernel time per decode step by
  kernel against ``generate()``'s decode steps profiled the same way (``extra_kernels``: what the
  engine's steps run beyond the fixed batch's).

A decode step's wall time well above its kernel time with ``gpu_busy`` low is host work the
overlap does not hide; kernel time above ``generate()``'s is extra device work.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import flashrt
from flashrt.engine import Engine, EngineConfig
from flashrt.engine.run import load_model
from decode_profile import gpu_events
from results_io import write_json
from serve_host_overhead import Level


def kernel_spans(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel or copy the profiler saw."""
    return [(e.name, e.time_range.start, e.time_range.end) for e in gpu_events(prof)]


def busy(spans) -> dict:
    """The union of the spans against their extent: busy share and idle time (ms) in gaps."""
    if not spans:
        return {"span_ms": 0.0, "busy_ms": 0.0, "gpu_busy": 0.0, "gaps_over_20us_ms": 0.0}
    spans = sorted(spans, key=lambda s: s[1])
    covered, gaps, end = 0.0, 0.0, spans[0][1]
    for _, a, b in spans:
        if a > end:
            gaps += (a - end) if a - end > 20 else 0.0
            covered += b - a
        elif b > end:
            covered += b - end
        end = max(end, b)
    extent = end - spans[0][1]
    return {"span_ms": extent / 1e3, "busy_ms": covered / 1e3, "gpu_busy": covered / extent if extent else 0.0,
            "gaps_over_20us_ms": gaps / 1e3}


def per_step(spans, steps: int) -> dict[str, float]:
    total = defaultdict(float)
    for name, a, b in spans:
        total[name] += (b - a) / steps
    return total


def generate_level(model, batch: int, input_len: int, output_len: int) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, input_len), generator=gen).tolist()
    flashrt.generate(model, prompts, output_len)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = flashrt.generate(model, prompts, output_len)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        flashrt.generate(model, prompts, output_len)
        torch.cuda.synchronize()
    spans = kernel_spans(prof)
    row = {"batch": batch, "output_throughput": out.new_tokens / seconds, "seconds": seconds,
           "decode_step_ms": 1e3 * out.decode_seconds / max(output_len - 1, 1),
           "prefill_seconds": out.prefill_seconds, **busy(spans)}
    return row, per_step(spans, output_len)


def engine_level(engine: Engine, args, seed: int, profile: bool) -> tuple[dict, dict, list]:
    loop = engine.step_loop
    before = dict(loop.counters)
    level = Level(engine, args.concurrency, args.requests, args.input_len, args.output_len, seed,
                  args.arrivals_per_step or None)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            level.run()
            torch.cuda.synchronize()
        spans = kernel_spans(prof)
    else:
        level.run()
        torch.cuda.synchronize()
        spans = []
    seconds = time.perf_counter() - t0
    d = {k: v - before[k] for k, v in loop.counters.items()}
    decode = [(c, w) for c, w, only in level.steps if only]
    row = {"output_throughput": level.tokens / seconds, "seconds": seconds, "steps": len(level.steps),
           "decode_only_steps": len(decode), "mean_decode_batch": d["decode_rows"] / max(d["decode_steps"], 1),
           "decode_only_wall_ms_median": 1e3 * statistics.median(w for _, w in decode) if decode else None,
           "decode_only_cpu_ms_median": 1e3 * statistics.median(c for c, _ in decode) if decode else None,
           "phase_ms_per_step": {p: 1e3 * d[f"{p}_seconds"] / max(len(level.steps), 1)
                                 for p in ("decode", "prefill", "sample")},
           "prefill_forwards": d["prefill_forwards"], "prefill_replays": d["prefill_replays"],
           "prefill_captures": d["prefill_captures"], "decode_replays": d["decode_replays"],
           "decode_captures": d["decode_captures"]}
    if profile:
        row.update(busy(spans))
    return row, d, spans


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--arrivals-per-step", type=int, default=0, metavar="N",
                    help="at most N new requests before each step (0: every free slot at once); N >= 1 spreads "
                         "the prompts' arrivals as a server's network does")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.arrivals_per_step < 0:
        ap.error(f"--arrivals-per-step: expected an int >= 0, got {args.arrivals_per_step}")
    for name in ("concurrency", "requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed (this measures the device's share of a serving step)")
    model = load_model(args.model, torch.device("cuda"), quiet=True)
    gen_row, gen_kernels = generate_level(model, args.concurrency, args.input_len, args.output_len)
    engine = Engine(model, config=EngineConfig(max_running=args.concurrency, overlap=args.overlap,
                                               prefill_graphs=args.prefill_graphs))
    engine_level(engine, args, seed=1, profile=False)  # compiles and captures, untimed
    timed, _, _ = engine_level(engine, args, seed=2, profile=False)
    prof_row, counters, spans = engine_level(engine, args, seed=3, profile=True)
    steps = max(counters["decode_steps"], 1)
    eng_kernels = per_step(spans, steps)
    names = set(eng_kernels) | set(gen_kernels)
    extra = sorted(({"kernel": n[:120], "engine_us_per_decode_step": eng_kernels.get(n, 0.0),
                     "generate_us_per_step": gen_kernels.get(n, 0.0)} for n in names),
                   key=lambda r: -(r["engine_us_per_decode_step"] - r["generate_us_per_step"]))
    result = {"model": args.model, "device": torch.cuda.get_device_name(), "concurrency": args.concurrency,
              "requests": args.requests, "input_len": args.input_len, "output_len": args.output_len,
              "overlap": args.overlap, "prefill_graphs": args.prefill_graphs,
              "arrivals_per_step": args.arrivals_per_step,
              "generate": gen_row, "engine": timed, "engine_profiled": prof_row,
              "ratio_to_generate": timed["output_throughput"] / gen_row["output_throughput"],
              "kernel_us_per_decode_step": {"engine": sum(eng_kernels.values()), "generate": sum(gen_kernels.values())},
              "extra_kernels": extra[:25]}
    print(f"engine {timed['output_throughput']:.0f} tok/s vs generate {gen_row['output_throughput']:.0f} "
          f"({result['ratio_to_generate']:.2f}x); decode-only step wall {timed['decode_only_wall_ms_median']:.2f} ms, "
          f"CPU {timed['decode_only_cpu_ms_median']:.2f} ms; generate step {gen_row['decode_step_ms']:.2f} ms; "
          f"GPU busy {prof_row['gpu_busy']:.0%} (generate {gen_row['gpu_busy']:.0%}); kernel us per decode step "
          f"{result['kernel_us_per_decode_step']['engine']:.0f} vs {result['kernel_us_per_decode_step']['generate']:.0f}")
    for r in extra[:10]:
        print(f"  {r['engine_us_per_decode_step']:8.1f} vs {r['generate_us_per_step']:8.1f} us  {r['kernel'][:90]}")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
