"""Host work of a serving step, on CPU, with the model's layers replaced by a no-op.

    python benchmarks/serve_host_overhead.py [--model tiny] [--levels 1 16 64] [--rounds 3] \
        [--out benchmarks/results/cpu-serve-host-after.json]

``flashrt.engine.Engine`` serves ``--rounds`` x N requests at N concurrent (closed loop: a new
request arrives whenever one finishes), ``--input-len`` random prompt ids and ``--output-len``
greedy tokens each (``ignore_eos``), decode steps through the captured-step path
(``cuda_graphs=True``: on CPU the same static-buffer step runs eagerly). ``Model.run`` (the layers,
embedding and head: the device work) is replaced by a function returning fixed logits of the
right shape, so what a step costs is host work only: scheduling, KV page bookkeeping
(``KVState.begin_step`` / ``advance``), block tables, Engram hashing, joins, sampling, finish
checks, incremental text and the outputs handed to the requests' sinks (streaming).

Per level: host ms per step (CPU time of the stepping thread, steadier than wall time on a shared
machine; all steps, and decode-only steps: the steady state of N rows), host us per generated
token, wall ms per step, the step loop's own wall-time split (``engine_{decode,prefill,sample}_seconds``
over the steps; ``outside_phases``: scheduling and handing the outputs to the sinks) and the top
functions of a cProfile run of the same level (own time per step).
Tensor ops count as host time here: on CPU they run in the calling thread, on a GPU each is a
kernel launch (a few microseconds of host time).
"""
from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import statistics
import time

import torch

from flashrt.engine import Engine, SamplingParams
from flashrt.engine.run import load_model
from results_io import write_json


def no_op_layers(model, token: int = 7) -> None:
    """``model.run`` returns logits whose argmax is ``token`` without running any layer."""
    cache: dict = {}

    def run(ids, ctx, all_positions=False, spans=None):
        shape = (*ids.shape, model.cfg.vocab_size) if all_positions else (ids.shape[0], model.cfg.vocab_size)
        if shape not in cache:
            cache[shape] = torch.zeros(shape)
            cache[shape][..., token] = 1.0
        return cache[shape]

    model.run = run


class Level:
    """A closed loop of ``concurrency`` requests over one engine, stepped in this thread."""

    def __init__(self, engine: Engine, concurrency: int, total: int, input_len: int, output_len: int, seed: int,
                 per_step: int | None = None):
        """``per_step``: at most this many new requests arrive before a step (None: every free slot
        fills at once), so prompts reach the engine spread out, as over a network."""
        self.engine, self.concurrency, self.total, self.per_step = engine, concurrency, total, per_step
        self.params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        gen = torch.Generator().manual_seed(seed)
        self.prompts = torch.randint(0, engine.model.cfg.vocab_size, (total, input_len), generator=gen).tolist()
        self.added = self.finished = self.tokens = 0
        self.steps: list[tuple[float, float, bool]] = []  # (CPU seconds, wall seconds, decode-only)

    def _sink(self, out) -> None:
        if out.finished:
            self.finished += 1
            self.tokens += len(out.outputs[0].token_ids)

    def _top_up(self) -> None:
        loop, arrived = self.engine.step_loop, 0
        while self.added < self.total and self.added - self.finished < self.concurrency and (
                self.per_step is None or arrived < self.per_step):
            arrived += 1
            req = loop.add(f"r{self.added}", self.prompts[self.added], self.params)
            req.sink = self._sink
            self.added += 1

    def run(self) -> None:
        loop, engine = self.engine.step_loop, self.engine
        while self.finished < self.total:
            self._top_up()
            prefill_before = loop.counters["prefill_forwards"]
            c0, t0 = time.thread_time(), time.perf_counter()
            engine._deliver(loop.step())
            c1, t1 = time.thread_time(), time.perf_counter()
            self.steps.append((c1 - c0, t1 - t0, loop.counters["prefill_forwards"] == prefill_before))


def make_engine(model, concurrency: int, args) -> Engine:
    """As ``flashrt serve`` runs on a GPU: pools of a device budget reserved at start (page limits,
    spill locks and page accounting on), a step budget of 16 prompts, the prefix cache on."""
    return Engine(model, max_running=concurrency, prefill_chunk=args.input_len, max_step_tokens=16 * args.input_len,
                  cuda_graphs=True, kv_budget=args.kv_budget, prefix_cache_bytes=1 << 30)


def measure(model, concurrency: int, args) -> dict:
    total = args.rounds * concurrency
    engine = make_engine(model, concurrency, args)
    Level(engine, concurrency, concurrency, args.input_len, args.output_len, seed=1).run()  # warm-up
    before = dict(engine.step_loop.counters)
    level = Level(engine, concurrency, total, args.input_len, args.output_len, seed=2)
    level.run()
    counters = {k: v - before[k] for k, v in engine.step_loop.counters.items()}
    all_ms = [1e3 * c for c, _, _ in level.steps]
    decode_ms = [1e3 * c for c, _, d in level.steps if d]
    n = len(level.steps)
    out = {
        "concurrency": concurrency, "requests": total, "steps": n, "decode_only_steps": len(decode_ms),
        "output_tokens": level.tokens,
        "host_ms_per_step": sum(all_ms) / n,
        "host_ms_per_decode_step_median": statistics.median(decode_ms) if decode_ms else None,
        "host_ms_per_decode_step_mean": statistics.mean(decode_ms) if decode_ms else None,
        "host_us_per_token": 1e6 * sum(c for c, _, _ in level.steps) / max(level.tokens, 1),
        "wall_ms_per_step": 1e3 * sum(w for _, w, _ in level.steps) / n,
        "phase_wall_ms_per_step": {p: 1e3 * counters[f"{p}_seconds"] / n for p in ("decode", "prefill", "sample")},
        "mean_decode_rows": counters["decode_rows"] / max(counters["decode_steps"], 1),
    }
    phases = out["phase_wall_ms_per_step"]
    phases["outside_phases"] = out["wall_ms_per_step"] - sum(phases.values())
    out["profile_top"] = profile(model, concurrency, args)
    return out


def profile(model, concurrency: int, args, top: int = 25) -> list[dict]:
    """The functions with the most own time (ms per step) in a profiled run of the level."""
    engine = make_engine(model, concurrency, args)
    Level(engine, concurrency, concurrency, args.input_len, args.output_len, seed=1).run()
    level = Level(engine, concurrency, concurrency, args.input_len, args.output_len, seed=3)
    prof = cProfile.Profile()
    prof.runcall(level.run)
    stats = pstats.Stats(prof).stats
    n = len(level.steps)
    rows = []
    for (file, line, name), (_, calls, tottime, cumtime, _) in stats.items():
        where = f"{file.rsplit('/', 2)[-2]}/{file.rsplit('/', 1)[-1]}:{line}" if "/" in file else file
        rows.append({"function": f"{where}({name})", "calls_per_step": calls / n,
                     "own_ms_per_step": 1e3 * tottime / n, "cum_ms_per_step": 1e3 * cumtime / n})
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows[:top]]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="requests per level = rounds x concurrency")
    ap.add_argument("--kv-budget", type=int, default=256 << 20, help="device KV bytes (as on a GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("input_len", "output_len", "rounds", "kv_budget"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if any(c < 1 for c in args.levels):
        ap.error(f"--levels: expected ints >= 1, got {args.levels}")
    torch.set_num_threads(1)
    model = load_model(args.model, torch.device("cpu"), quiet=True)
    no_op_layers(model)
    result = {"model": args.model, "device": "cpu (layers replaced by a no-op)", "host": platform.processor() or platform.machine(),
              "torch": torch.__version__, "input_len": args.input_len, "output_len": args.output_len,
              "kv_budget": args.kv_budget,
              "levels": []}
    for c in args.levels:
        row = measure(model, c, args)
        result["levels"].append(row)
        print(f"{c:>3} concurrent: {row['host_ms_per_step']:.2f} ms/step, decode-only step "
              f"{row['host_ms_per_decode_step_median']:.2f} ms (median), {row['host_us_per_token']:.0f} us/token")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
