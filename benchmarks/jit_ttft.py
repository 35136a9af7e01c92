"""Time to first token of ``flashrt run --model small`` in a cold process vs a warm one vs after
``flashrt jit warmup``, each a fresh subprocess, same run.

    python benchmarks/jit_ttft.py --out benchmarks/results/h200-jit-ttft.json

Phases (each ``flashrt run --model small --json``, its own process):

- ``first_run``: nothing cached at all: the run creates the built-in checkpoint (weights and
  tokenizer) and compiles every kernel (the README's first command on a fresh machine);
- ``cold``: fresh ``FLASHRT_CACHE_DIR`` and ``TRITON_CACHE_DIR`` (the checkpoint linked in): every
  kernel compiles: on the pool what the warm-up cases and a shipped plan (``core/jit_plans``, for
  this device, profile and Triton version) list, in the run the rest;
- ``warm``: the same directories again: every kernel comes from the cache;
- ``cold_with_plan``: a fresh compile cache holding only the plan ``cold`` recorded
  (``jit/plans``: the variants the run loaded), as a shipped plan would: the pool compiles all of
  them while the model loads;
- ``after_warmup``: fresh directories, then ``flashrt jit warmup --shapes small`` (the kernel
  modules' hooks), then the run: what the hooks leave to compile shows as the gap to ``warm``;
- ``after_model_warmup``: fresh directories, ``flashrt jit warmup --model small`` (runs the model
  once), then the run.

Except in ``first_run`` (whose checkpoint the later phases then reuse), the ``small`` checkpoint is
created once before any timing (``flashrt run`` would create it under ``FLASHRT_CACHE_DIR/models``)
and linked into each fresh directory, so no other phase pays for it.
Each row keeps the run's ``jit`` report: the variants the run compiled itself, what the pool did
and what the preload loaded (``FLASHRT_JIT_PRELOAD=1``, passed through to the runs; None without).
Runs take ``FLASHRT_JIT_WORKERS`` as it is set here (unset: a run's pool has as many workers as the
CPUs it may use; ``FLASHRT_JIT_WORKERS=0`` measures without the pool).
TTFT is what ``flashrt run --json`` reports: from the start of loading the weights to the first
token's logits, and from the process start; the parent's wall time of each process is kept too.
Phases that would not fit the time budget (``--budget``) are recorded as skipped.
``--keep-plans DIR`` copies the plans the ``cold`` run recorded (``jit/plans``: what a run of the
model launched on this device) to ``DIR``, which must not exist yet; ``tools/ship_plan.py`` merges
them into the shipped plan.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_io import write_json

PHASES = ("first_run", "cold", "warm", "cold_with_plan", "after_warmup", "after_model_warmup")


def flashrt(args: list[str], dirs: Path, timeout: float) -> tuple[dict, float]:
    """Run ``flashrt *args --json`` with the cache dirs under ``dirs``; (its JSON, wall seconds)."""
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(dirs / "flashrt"), "TRITON_CACHE_DIR": str(dirs / "triton")}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "flashrt.cli", *args, "--json"], capture_output=True, text=True,
                       env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    if r.returncode not in (0, 1):  # jit warmup exits 1 when a module failed: its report says which
        raise RuntimeError(f"flashrt {' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}")
    return json.loads(r.stdout), wall


def fresh_dirs(root: Path, name: str, checkpoint: Path | None) -> Path:
    """Empty cache directories holding only a link to the prepared checkpoint (when given)."""
    dirs = root / name
    models = dirs / "flashrt" / "models"
    models.mkdir(parents=True)
    if checkpoint is not None:
        (models / checkpoint.name).symlink_to(checkpoint)
    (dirs / "triton").mkdir()
    return dirs


def prepare_checkpoint(root: Path, model: str) -> Path:
    """Create the built-in checkpoint once (untimed), in its own cache directory."""
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(root / "setup")}
    code = f"from flashrt.engine.run import builtin_checkpoint; print(builtin_checkpoint({model!r}, quiet=True))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def row(phase: str, report: dict, wall: float, warmup: dict | None = None) -> dict:
    keys = ("ttft_from_load_s", "ttft_from_process_start_s", "load_seconds", "prefill_seconds",
            "decode_tokens_per_s", "new_token_ids")
    out = {"phase": phase, "device": report["device"], **{k: report[k] for k in keys}, "process_wall_s": wall,
           "startup_seconds": report.get("startup_seconds")}
    jit = report.get("jit") or {}
    pre = jit.get("precompile") or {}
    here = jit.get("compiled_in_process", [])
    out["jit"] = {"compiled_in_process": len(here), "compiled_in_process_kernels": here,
                  "plan_added": jit.get("plan_added"), "preload": jit.get("preload"),
                  "precompile": {k: pre.get(k) for k in ("workers", "variants", "compiled", "launchers", "seconds",
                                                         "done", "compile_seconds", "slowest")}
                  | {"failed": len(pre.get("failed", []))}}
    if warmup is not None:
        out["warmup"] = warmup
    print(f"{phase:20} TTFT {report['ttft_from_load_s']:8.2f} s from load, "
          f"{report['ttft_from_process_start_s'] or float('nan'):8.2f} s from process start; "
          f"prefill {report['prefill_seconds']:7.2f} s; decode {report['decode_tokens_per_s']:8.1f} tok/s; "
          f"{out['jit']['compiled_in_process']} compiled in the run, {pre.get('compiled')}/{pre.get('variants')} "
          f"on the pool", flush=True)
    return out


PARTS = ("triton", "src", "backend", "options", "env")


def _parts_check(line: dict, pool) -> dict:
    """For a variant the run compiled that no worker had: whether the key's pieces the log computed
    make the run's key (``parts_make_key``), whether a plan's round trip keeps them
    (``plan_keeps_key``), and the pieces a worker's variant of the same kernel and source differs in
    (``differs_from_pool``: None when no worker compiled that source)."""
    parts, planned = line.get("parts") or {}, line.get("plan_parts") or {}
    same_src = [p["parts"] for p in pool if p.get("name") == line["name"] and (p.get("parts") or {}).get("src")
                and p["parts"]["src"] == parts.get("src")]
    return {"parts_make_key": parts.get("cache_key") == line.get("cache_key") if parts else None,
            "plan_keeps_key": planned.get("cache_key") == parts.get("cache_key") if parts else None,
            "differs_from_pool": [k for k in PARTS if same_src[0].get(k) != parts.get(k)] if same_src else None,
            "pool_parts": {k: sorted({(p.get("parts") or {}).get(k) for p in pool if p.get("name") == line["name"]}
                                     - {None})[:3] for k in ("backend", "options", "env", "triton")},
            "parts": {k: parts.get(k) for k in PARTS} if parts else line.get("parts_error")}


def log_summary(rows: list[dict]) -> dict:
    """What a run's ``FLASHRT_JIT_LOG`` lines (``rows``: the run's and its pool's) say about each
    variant the run compiled itself: ``not_on_pool`` (no worker had its cache key: the pool's plan
    missed it), ``pool_later`` (a worker began it after the run had: the pool's queue was behind the
    run) or ``raced`` (a worker had begun it first: the run should have waited on the key's lock);
    ``waited``: variants the run found compiled after a wait of over 0.1 s (a worker's compile it
    waited on); the first pool submission and start and the run's first lookup, in seconds after the
    first of the three."""
    pool = {r["cache_key"]: r for r in rows if r.get("pool") and r.get("cache_key")}
    run = [r for r in rows if not r.get("pool")]
    out = {"not_on_pool": [], "pool_later": [], "raced": [], "waited": []}
    for r in run:
        begun = r["t"] - (r["s"] or 0.0)
        if r.get("compiled"):
            worker = pool.get(r.get("cache_key"))
            kind = "not_on_pool" if worker is None else "raced" if worker["start"] < begun else "pool_later"
            lag = None if worker is None else round(worker["start"] - begun, 2)
            out[kind].append({"name": r["name"], "seconds": r["s"], "pool_start_after_run_s": lag}
                             | (_parts_check(r, pool.values()) if kind == "not_on_pool" else {}))
        elif (r["s"] or 0.0) > 0.1:
            out["waited"].append({"name": r["name"], "seconds": r["s"]})
    marks = {"pool_first_submitted": min((r["submitted"] for r in pool.values()), default=None),
             "pool_first_start": min((r["start"] for r in pool.values()), default=None),
             "run_first_lookup": min((r["t"] - (r["s"] or 0.0) for r in run), default=None)}
    origin = min((v for v in marks.values() if v is not None), default=0.0)
    out |= {k: None if v is None else round(v - origin, 2) for k, v in marks.items()}
    out["counts"] = {k: len(out[k]) for k in ("not_on_pool", "pool_later", "raced", "waited")}
    return out


def run_phase(phase: str, root: Path, checkpoint: Path, run_args: list[str], model: str, deadline: float) -> dict:
    left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
    dirs = root / "cold" if phase == "warm" else fresh_dirs(root, phase, None if phase == "first_run" else checkpoint)
    plans = root / "cold" / "flashrt" / "jit" / "plans"
    if phase == "cold_with_plan" and plans.is_dir():  # (none where the cold run loaded no Triton kernel)
        shutil.copytree(plans, dirs / "flashrt" / "jit" / "plans")
    warm = None
    if phase in ("after_warmup", "after_model_warmup"):
        extra = ["--shapes", model] if phase == "after_warmup" else ["--model", model]
        report, wall = flashrt(["jit", "warmup", *extra], dirs, left())
        warm = {"command": f"flashrt jit warmup {' '.join(extra)}", "wall_s": wall, "seconds": report["seconds"],
                "warmed": report["warmed"], "skipped": report["skipped"], "failed": report["failed"]}
    started = time.time()
    report, wall = flashrt(run_args, dirs, left())
    out = row(phase, report, wall, warm)
    log_path = os.environ.get("FLASHRT_JIT_LOG", "").strip()
    if log_path and os.path.exists(log_path):  # the run's lines and its pool's (core/jit_log.py)
        from flashrt.jit_log import between, read

        out["jit_log"] = log_summary(between(read(log_path), started, time.time()))
        print(f"{'':20} the run's own compiles: {out['jit_log']['counts']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=("tiny", "small"))
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--budget", type=float, default=510.0, help="seconds for all phases (default 8.5 min)")
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    ap.add_argument("--keep-plans", default=None, metavar="DIR",
                    help="copy the plans the cold run recorded here (a directory that does not exist yet)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.keep_plans is not None and os.path.exists(args.keep_plans):
        ap.error(f"--keep-plans: expected a path that does not exist yet, got {args.keep_plans!r}")
    if args.keep_plans is not None and "cold" not in args.phases:
        ap.error("--keep-plans: keeps what 'cold' records; list 'cold' in --phases")
    for needs_cold in ("warm", "cold_with_plan"):
        if needs_cold in args.phases and "cold" not in args.phases:
            ap.error(f"--phases: '{needs_cold}' reuses what 'cold' leaves; list 'cold' too")
    deadline = time.monotonic() + args.budget
    run_args = ["run", "--model", args.model, "--max-new-tokens", str(args.max_new_tokens)]
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory(prefix="flashrt-ttft-") as tmp:
        root = Path(tmp)
        checkpoint = None
        for phase in args.phases:
            if time.monotonic() > deadline - 20:
                skipped[phase] = "time budget spent"
                continue
            if checkpoint is None and phase != "first_run":
                made = sorted((root / "first_run" / "flashrt" / "models").glob(f"{args.model}-seed0*"))
                checkpoint = made[0] if made else prepare_checkpoint(root, args.model)
            try:
                rows.append(run_phase(phase, root, checkpoint, run_args, args.model, deadline))
            except (subprocess.TimeoutExpired, RuntimeError) as exc:
                skipped[phase] = f"{type(exc).__name__}: {str(exc)[-500:]}"
                print(f"{phase:20} skipped: {skipped[phase]}", flush=True)
            plans = root / "cold" / "flashrt" / "jit" / "plans"
            if phase == "cold" and args.keep_plans is not None and plans.is_dir():
                shutil.copytree(plans, args.keep_plans)
    warm = next((r for r in rows if r["phase"] == "warm"), None)
    for r in rows:
        r["ttft_ratio_to_warm"] = r["ttft_from_load_s"] / warm["ttft_from_load_s"] if warm else None
        r["same_tokens_as_cold"] = r["new_token_ids"] == rows[0]["new_token_ids"]
    write_json(args.out, {"model": args.model, "device": rows[0].get("device") if rows else None,
                          "command": "flashrt " + " ".join(run_args), "rows": rows, "skipped": skipped,
                          "note": "ttft_from_load_s: from the start of loading to the first token's logits "
                                  "(flashrt run --json)"})


if __name__ == "__main__":
    main()
