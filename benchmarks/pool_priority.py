"""The compile pool's workers below the parent's priority: how fast the run's own work goes while
every CPU is busy with the pool.

    python benchmarks/pool_priority.py [--model small] [--repeats 3] [--out F]

The run's own work is loading the built-in model on the CPU (``flashrt.load``: reading, the
finite check, the expert stacks, the tokenizer). It is timed alone, then beside a compile pool
(``flashrt.jit_parallel.Precompile``, as many workers as CPUs) whose workers all spin on CPU work
(the stand-in for compiles), once with the workers at the parent's priority
(``WORKER_NICENESS`` 0) and once at the shipped ``WORKER_NICENESS``; medians of the repeats, after
one untimed load (page cache, imports).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch

import flashrt
from flashrt import jit_parallel
from flashrt.engine.run import BUILTIN, builtin_checkpoint
from results_io import write_json

_STOP = multiprocessing.get_context("fork").Event()  # inherited by the forked workers


def _spin() -> int:
    """CPU work until the parent sets ``_STOP``; the loop count."""
    n = 0
    while not _STOP.is_set():
        for _ in range(20000):
            n += 1
    return n


def timed_load(path) -> float:
    t0 = time.perf_counter()
    model = flashrt.load(path, device=torch.device("cpu"))
    seconds = time.perf_counter() - t0
    del model
    return seconds


def beside_pool(path, niceness: int, workers: int) -> tuple[float, int]:
    """One load while ``workers`` pool workers at ``niceness`` below this process spin; (seconds,
    the workers' niceness as they saw it)."""
    jit_parallel.WORKER_NICENESS = niceness  # read by each worker as it is forked
    _STOP.clear()
    pool = jit_parallel.Precompile(workers)
    try:
        seen = pool._pool.submit(jit_parallel._niceness).result(60)
        spins = [pool._pool.submit(_spin) for _ in range(workers)]
        time.sleep(0.5)  # every worker spinning
        seconds = timed_load(path)
    finally:
        _STOP.set()
        for f in spins:
            f.result(60)
        pool.close()
    return seconds, seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=sorted(BUILTIN))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats: expected at least 1, got {args.repeats}")
    shipped = jit_parallel.WORKER_NICENESS
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    path = builtin_checkpoint(args.model, 0, True)
    timed_load(path)  # page cache, imports
    runs = {"alone": [], "pool_same_priority": [], "pool_below": []}
    seen = {}
    for _ in range(args.repeats):
        runs["alone"].append(timed_load(path))
        for key, niceness in (("pool_same_priority", 0), ("pool_below", shipped)):
            seconds, seen[key] = beside_pool(path, niceness, workers)
            runs[key].append(seconds)
    jit_parallel.WORKER_NICENESS = shipped
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {"model": args.model, "cpus": workers, "torch_threads": torch.get_num_threads(),
              "worker_niceness_seen": seen, "parent_niceness": os.nice(0),
              "command": f"python benchmarks/pool_priority.py --model {args.model} --repeats {args.repeats}",
              "median_s": med, "slowdown": {k: med[k] / med["alone"] for k in med}, "runs": runs}
    print(f"{args.model} load on the CPU, {workers} CPUs: alone {med['alone']:.2f} s; beside {workers} busy "
          f"workers at the same priority {med['pool_same_priority']:.2f} s, {shipped} nice levels below "
          f"{med['pool_below']:.2f} s")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
