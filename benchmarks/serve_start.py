"""Time from ``flashrt serve --model small`` to a healthy server (model loaded, warm-up run), cold and warm.

    python benchmarks/serve_start.py --out benchmarks/results/h200-serve-start.json

Phases, each a fresh server process stopped with SIGTERM once ``/health`` answers:

- ``cold``: empty ``FLASHRT_CACHE_DIR`` and ``TRITON_CACHE_DIR`` (the built-in checkpoint, made
  once beforehand, linked in): every kernel variant the load and the warm-up launch compiles, on
  the compile pool where the plan (``core/jit_plans``) lists it, else in the engine's process;
- ``warm``: the same directories again: every variant comes from the cache.

``--workers N`` sets ``FLASHRT_JIT_WORKERS`` for the servers (0: no pool, every variant compiled at
its first launch); ``--serve-arg`` passes more arguments to ``flashrt serve``. Each row keeps the
seconds to healthy and, from the servers' ``FLASHRT_JIT_LOG`` lines (its own file here), the
variants the server's processes compiled themselves classed as ``benchmarks/jit_ttft.py`` classes a
run's (no worker had the key, a worker began it later, a worker began it first), the variants
they waited on and how many the pool finished (compiled, or found cached); and the server's last log lines.
``--keep-plans DIR`` keeps the plans the servers recorded (the variants serving launched).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashrt.jit_log import between, read
from jit_ttft import fresh_dirs, log_summary, prepare_checkpoint
from results_io import write_json
from serve_vs_generate import stop_server, wait_healthy

PHASES = ("cold", "warm")


def start_server(model: str, port: int, dirs: Path, jit_log: Path, serve_args: list[str], workers: str | None,
                 timeout: float) -> tuple[float, str]:
    """Launch the server on the cache dirs under ``dirs``; (seconds until healthy, its log's tail)."""
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(dirs / "flashrt"), "TRITON_CACHE_DIR": str(dirs / "triton"),
           "FLASHRT_JIT_LOG": str(jit_log)}
    if workers is not None:
        env["FLASHRT_JIT_WORKERS"] = workers
    log_path = dirs / f"serve-{time.time():.0f}.log"
    cmd = [sys.executable, "-m", "flashrt.cli", "serve", "--model", model, "--port", str(port),
           "--log-level", "info", *serve_args]
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout)
            seconds = time.perf_counter() - t0
        finally:
            stop_server(proc)
    lines = log_path.read_text(errors="replace").splitlines()
    return seconds, "\n".join(line for line in lines if "flashrt" in line)[-3000:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", choices=("tiny", "small"))
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds a server may take to be healthy")
    ap.add_argument("--workers", default=None, help="FLASHRT_JIT_WORKERS for the servers (default: as set here)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for flashrt serve (repeatable), e.g. --serve-arg=--no-engine-process")
    ap.add_argument("--keep-plans", default=None, metavar="DIR",
                    help="copy the plans the servers recorded (jit/plans: what serving launched on this device) "
                         "to DIR, which must not exist yet; tools/ship_plan.py --after adds them to the shipped plan")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.keep_plans and os.path.exists(args.keep_plans):
        ap.error(f"--keep-plans: expected a path that does not exist yet, got {args.keep_plans}")
    root = Path(tempfile.mkdtemp(prefix="flashrt-serve-start-"))
    try:
        rows = phases(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the checkpoint and caches made here
    write_json(args.out, {"model": args.model, "serve_args": args.serve_arg, "workers": args.workers,
                          "rows": rows})


def phases(args, root: Path) -> list[dict]:
    checkpoint = prepare_checkpoint(root, args.model)
    dirs = fresh_dirs(root, "cache", checkpoint)
    jit_log = root / "jit.jsonl"
    rows = []
    for phase in args.phases:
        started = time.time()
        seconds, tail = start_server(args.model, args.port, dirs, jit_log, args.serve_arg, args.workers, args.timeout)
        lines = between(read(jit_log), started, time.time()) if jit_log.exists() else []
        summary = log_summary(lines)
        compiled = [r for r in lines if not r.get("pool") and r.get("compiled")]
        pool = [r for r in lines if r.get("pool")]
        rows.append({"phase": phase, "healthy_s": seconds, "compiled_by_server": len(compiled),
                     "compiled_by_server_s": sum(r["s"] or 0.0 for r in compiled), "finished_on_pool": len(pool),
                     "jit_log": summary, "server_log": tail})
        print(f"{phase:6} healthy {seconds:6.1f} s after launch; compiled by the server {len(compiled)} "
              f"({rows[-1]['compiled_by_server_s']:.1f} s), finished on the pool {len(pool)}; {summary['counts']}", flush=True)
    plans = dirs / "flashrt" / "jit" / "plans"
    if args.keep_plans and plans.is_dir():
        shutil.copytree(plans, args.keep_plans)
    return rows


if __name__ == "__main__":
    main()
