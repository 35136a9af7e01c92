"""``flashrt run`` and ``flashrt plan``: argument wiring and report printing."""
from __future__ import annotations

import argparse
import json
import sys


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1024 or prefix == "P":
            return f"{n:,.1f} {prefix}{unit}" if prefix else f"{n:,.0f} {unit}"
        n /= 1024
    return f"{n} {unit}"


def add_run(sub) -> None:
    from .args import device, float_range, nonempty, positive_int, seed

    p = sub.add_parser("run", help="generate with the tiny built-in model (or --model small|PATH) and report")
    p.add_argument("--model", default="tiny", type=nonempty("model"),
                   help="tiny | small | checkpoint directory (default tiny)")
    p.add_argument("--prompt", default=None, type=nonempty("prompt"),
                   help="prompt text (UTF-8 bytes as ids for built-in models)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16)
    p.add_argument("--device", default=None, type=device, help="cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--backend", default=None, help="force a backend (see flashrt doctor)")
    p.add_argument("--prefill", choices=("exact", "ced"), default="exact")
    p.add_argument("--temperature", type=float_range(0.0, low_open=False), default=0.0)
    p.add_argument("--seed", type=seed, default=0, help="sampling seed (default 0)")
    p.add_argument("--weights-seed", type=seed, default=0,
                   help="seed of the built-in models' weights (default 0; each seed is created once and cached)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: 1 for tiny, else torch's)")
    p.add_argument("--kv-budget", type=positive_int, default=None, metavar="BYTES",
                   help="device bytes for the KV state; older main-KV pages spill to host memory")
    p.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="TOKENS",
                   help="prompt tokens per forward call")
    p.add_argument("--prefix-cache", default=None, metavar="DIR", type=nonempty("directory"),
                   help="persistent prefix cache directory (TTL and size cap from the profile)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps from CUDA graphs (default: on CUDA devices)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from flashrt.engine.run import DEFAULT_PROMPT, run

    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    report = run(args.model, prompt, args.max_new_tokens, args.device, args.backend,
                 args.prefill, args.temperature, args.seed, quiet=args.json, threads=args.threads,
                 kv_budget=args.kv_budget, prefill_chunk=args.prefill_chunk, cuda_graph=args.cuda_graph,
                 prefix_cache=args.prefix_cache, weights_seed=args.weights_seed)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    r = report
    print(f"model {r['model']} on {r['device']} ({r['cpu_threads']} CPU threads), prefill {r['prefill']}")
    print("backends: " + ", ".join(f"{k} {v}" for k, v in r["backend_per_op_family"].items()))
    print(f"prompt ({r['prompt_tokens']} tokens): {r['prompt']!r}")
    print(f"new ({r['new_tokens']} tokens): {r['new_text']!r}  ids {r['new_token_ids']}")
    print(f"prefill {r['prefill_tokens_per_s']:,.1f} tok/s   decode {r['decode_tokens_per_s']:,.1f} tok/s   "
          f"(weights loaded in {r['load_seconds']:.2f} s)")
    start = r["ttft_from_process_start_s"]
    print(f"first token {r['ttft_from_load_s']:.2f} s after loading began"
          + (f", {start:.2f} s after the process started" if start is not None else "")
          + f" (prefill {r['prefill_seconds']:.2f} s)")
    print(f"KV {r['kv_bytes_per_token']:,.1f} B/token, {_human(r['kv_bytes_total'])} in total "
          f"(window rings {_human(r['window_state_bytes'])})   peak memory {_human(r['peak_memory_bytes'])}")
    t = r["kv_tiers"]
    if t:
        limit = f" of at most {t['device_page_limit']:,}" if t.get("device_page_limit") else ""
        print(f"KV pages: {t['device_pages']}{limit} on the device ({t['page_entries']} entries each), "
              f"{t['cold_pages']} cold in host memory" + (f" (budget {r['kv_budget']:,} B)" if r["kv_budget"] else ""))
    pc = r["prefix_cache"]
    if pc:
        print(f"prefix cache {pc['root']}: {pc['hits']} hit(s), {pc['misses']} miss(es)")
    g = r["step_capture"]
    if g:
        print(f"decode steps: {g['replayed']} replayed from CUDA graphs, {g['captured']} captured, "
              f"{g['eager']} eager, {g['fallback']} unbuffered (host-tier pages)")
    return 0


def add_plan(sub) -> None:
    from .args import float_range, nonempty, positive_int

    p = sub.add_parser("plan", help="parameters, KV bytes, FLOPs and capacity of a model (nothing allocated)")
    p.add_argument("--model", default="v4.1-flash", type=nonempty("model"),
                   help="tiny | small | v4.1-flash | deepseek-llm-67b | config dir")
    p.add_argument("--context", type=positive_int, default=1 << 20, help="context length for capacity (default 1M)")
    p.add_argument("--profile", dest="plan_profile", default=None, type=nonempty("profile"),
                   help="hardware profile whose memory (device_memory_gib x memory_utilization) to plan for")
    p.add_argument("--memory-gib", type=float_range(0.0, 2.0**20), default=None,
                   help="device memory in GiB (default: the profile's, else 141, an H200)")
    p.add_argument("--memory-utilization", type=float_range(0.0, 1.0), default=None,
                   help="fraction of the memory to plan for, in (0, 1] (default: the profile's, else 0.9)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from flashrt.graphs.plan_report import plan_report

    gib, util = 141.0, 0.9
    if args.plan_profile:
        from .commands import load_profile_option

        prof = load_profile_option(args.plan_profile)
        gib, util = prof.device_memory_gib or gib, prof.memory_utilization
    gib = args.memory_gib if args.memory_gib is not None else gib
    util = args.memory_utilization if args.memory_utilization is not None else util
    report = plan_report(args.model, args.context, gib * 2**30 * util)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        for line in report["lines"]:
            print(line)
    return 0
