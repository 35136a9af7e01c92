"""``flashrt jit warmup | compile | ls | clear``: ahead-of-time compilation and the compile cache on disk.

Warmup runs the warm-up hooks the backends declare (:mod:`flashrt.jit_warmup`); the report lists
what was compiled, skipped (with why) and failed. Compile cross-compiles every kernel variant for
the named architectures without a GPU (:mod:`flashrt.jit_compile`).
"""
from __future__ import annotations

import json
import os
import sys
import time

from flashrt.jit_warmup import warmup
from flashrt.out_files import OutFile, json_report


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f} {unit}"
    return f"{seconds:.0f} s"


def warm_model(model: str, report: dict) -> None:
    """Compile every kernel variant ``flashrt run --model MODEL`` uses by default (by running it:
    its variants go into the model's plan too, :mod:`flashrt.jit_plans`), then those a batch of two
    prompts uses in both prefill schedules and decode, by running them once on the device."""
    from flashrt.engine import generate
    from flashrt.engine.run import run_with_model

    t0 = time.perf_counter()
    try:
        ran, m = run_with_model(model, quiet=True)  # the batch below reuses the model the run loaded
        jit = ran["jit"]
        report["notes"][f"model:{model}"] = (f"flashrt run: {len(jit['compiled_in_process'])} variants compiled "
                                             f"in the run, {jit['plan_added']} new in its plan")
        prompt = list(range(3, 3 + 2 * m.cfg.window_size + 5))
        for prefill in ("exact", "ced"):
            generate(m, [prompt, prompt[:7]], 3, prefill=prefill)
        report["warmed"].append(f"model:{model}")
    except Exception as exc:
        report["failed"][f"model:{model}"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] += time.perf_counter() - t0


def cmd_warmup(args) -> int:
    if args.shapes:
        from flashrt.kernels_cuda.warmup import MODELS

        unknown = sorted(set(args.shapes) - set(MODELS))
        if unknown:
            raise ValueError(f"--shapes: expected names from {sorted(MODELS)}, got {unknown}")
        os.environ["FLASHRT_WARMUP_MODELS"] = ",".join(args.shapes)
    from flashrt.kernels_cuda.warmup import selected_models

    report = warmup(getattr(args, "profile", None), models=selected_models())
    if args.model:
        warm_model(args.model, report)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        no_hook = [n for n in report["skipped"] if n not in report["notes"]]
        print(f"jit warmup {report['profile']}: {len(report['warmed'])} compiled, {len(report['skipped'])} skipped, "
              f"{len(report['failed'])} failed ({report['seconds']:.1f} s)")
        pre = report.get("precompile")
        if pre:
            print(f"  compiled in parallel: {pre['compiled']}/{pre['variants']} variants for {pre['arch']} on "
                  f"{pre['workers']} processes ({pre['seconds']:.1f} s), {pre['launchers']} launchers built")
        if no_hook:
            print(f"  without a warmup hook: {', '.join(no_hook)}")
        for name, note in report["notes"].items():
            what = "compiled" if name in report["warmed"] else "note" if name == "plan" else "skipped"
            print(f"  {name:12} {what}: {note}")
        for name, err in report["failed"].items():
            print(f"  {name:12} failed: {err}")
    return 1 if report["failed"] else 0


def cmd_compile(args) -> int:
    from flashrt.jit_targets import parse_arch
    from flashrt.jit_triton import INTERPRET_ENV, interpreted

    archs = list(dict.fromkeys(parse_arch(a) for a in args.arch))
    out = (OutFile(args.out, "flashrt jit compile", json_report("archs", "models", "rows", "failed"))
           if args.out else None)
    if out:
        out.check()  # before the compiles: a path it may not write fails now
    if interpreted():
        raise ValueError(f"{INTERPRET_ENV}=1 is set: the kernels plan for Triton's interpreter; unset it to compile")
    from flashrt.jit_compile import cross_compile, launch_sources
    from flashrt.kernels_cuda.warmup import MODELS

    models = args.models or sorted(MODELS)
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise ValueError(f"--models: expected names from {sorted(MODELS)}, got {unknown}")
    sources = launch_sources()
    if args.families:
        unknown = sorted(set(args.families) - {name for name, _ in sources})
        if unknown:
            raise ValueError(f"--families: expected names from {sorted(n for n, _ in sources)}, got {unknown}")
        sources = [s for s in sources if s[0] in args.families]
    report = cross_compile(archs, {m: MODELS[m] for m in models}, sources, _compile_progress)
    text = json.dumps(report, indent=1)
    if out:
        out.write(text + "\n")
    if args.json:
        print(text)
    else:
        _print_compile(report)
    return 1 if report["failed"] else 0


def _compile_progress(arch: str, done: int, total: int, row: dict) -> None:
    """One stderr line per compiled variant (its outcome), so a long run shows where it is."""
    what = "ok" if row["status"] == "compiled" else "FAILED"
    print(f"jit compile {arch} [{done}/{total}] {row['kernel']}: {what} ({row.get('seconds', 0):.1f} s)",
          file=sys.stderr, flush=True)


def _print_compile(report: dict) -> None:
    for arch in report["archs"]:
        rows = [r for r in report["rows"] if r["arch"] == arch]
        ok = [r for r in rows if r["status"] == "compiled"]
        print(f"{arch} ({', '.join(report['profiles'][arch])}): {len(ok)}/{len(rows)} variants compiled from "
              f"{report['launches'][arch]} launches")
        if ok:
            top = max(ok, key=lambda r: r["shared_bytes"])
            print(f"  most shared memory: {top['kernel']} {top['shared_bytes']} of {top['smem_limit']} B; most registers: "
                  f"{max(r['registers'] or 0 for r in ok)}; variants spilling: {sum(bool(r['spill_bytes']) for r in ok)}")
        for r in rows:
            if r["status"] != "compiled":
                print(f"  FAILED {r['kernel'] or r['family']} ({', '.join(r.get('launches') or [r.get('model', '')])}):"
                      f" {r['error']}")
    print(f"jit compile: {report['failed']} failed ({report['seconds']:.0f} s)")


def cmd_ls(args) -> int:
    from flashrt.jit import JitCache

    cache = JitCache()
    entries, now = cache.entries(), time.time()
    if args.json:
        json.dump([e.__dict__ for e in entries], sys.stdout, indent=2)
        print()
        return 0
    print(f"{cache.root}: {len(entries)} entries, {_human(sum(e.size for e in entries))}")
    if entries:
        print(f"  {'key':12}  {'kind':7}  {'kernel':32}  {'arch':10}  {'size':>10}  age")
    for e in entries:
        print(f"  {_shown(e.key)[:12]:12}  {e.kind:7}  {_shown(e.kernel)[:32]:32}  {_shown(e.arch):10}  "
              f"{_human(e.size):>10}  {_age(now - e.mtime)}")
    return 0


def _shown(name: str) -> str:
    """``name`` printable on any stdout: a file name's undecodable bytes as ``\\xNN`` escapes."""
    return name.encode("utf-8", "surrogateescape").decode("ascii", "backslashreplace")


def cmd_clear(args) -> int:
    from flashrt.jit import JitCache

    cache = JitCache()
    if not args.yes:
        if not sys.stdin.isatty():
            raise ValueError(f"not clearing {cache.root} without --yes (stdin is not a terminal)")
        if input(f"remove everything under {cache.root}? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    files, size, kept = cache.clear()
    busy = f"; kept {kept} in use by running compiles or loads" if kept else ""
    print(f"removed {files} files ({_human(size)}) under {cache.root}{busy}")
    return 0


def add_jit(sub) -> None:
    from flashrt.argtypes import nonempty

    jit = sub.add_parser("jit", help="compile kernels ahead of time; inspect or empty the compile cache")
    jsub = jit.add_subparsers(dest="jit_command", required=True)
    p = jsub.add_parser("warmup", help="compile every kernel a profile needs (modules with a warmup hook)")
    p.add_argument("--profile", dest="command_profile", default=None, type=nonempty("profile"),
                   help="profile name or YAML path (default: auto); the same as flashrt --profile")
    p.add_argument("--model", default=None, help="also run tiny | small | a checkpoint as `flashrt run` does, then "
                   "a batch in both prefill schedules, compiling every kernel variant they use")
    p.add_argument("--shapes", nargs="+", default=None, metavar="MODEL",
                   help="the shipped models whose dims the kernels are warmed at: tiny, small, v4.1-flash "
                   "(default: small and v4.1-flash)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_warmup)
    p = jsub.add_parser("compile", help="cross-compile every kernel variant for GPU architectures (no GPU needed)")
    p.add_argument("--arch", nargs="+", required=True, type=nonempty("arch"), metavar="ARCH",
                   help="sm_80 (A100), sm_89 (RTX 4090), sm_90 (H100, H200): each with its devices' profiles")
    p.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                   help="the shipped models whose dims the kernels are launched at (default: all)")
    p.add_argument("--families", nargs="+", default=None, metavar="FAMILY", help="only these kernel families")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--out", default=None, metavar="FILE", type=nonempty("file name"), help="write the JSON report here")
    p.set_defaults(func=cmd_compile)
    p = jsub.add_parser("ls", help="cache entries: key, kind, kernel, architecture, size, age")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)
    p = jsub.add_parser("clear", help="remove the compile cache ($FLASHRT_CACHE_DIR/jit) and nothing else")
    p.add_argument("--yes", action="store_true", help="do not ask")
    p.set_defaults(func=cmd_clear)
