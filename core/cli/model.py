"""``flashrt run`` and ``flashrt plan``: argument wiring and report printing."""
from __future__ import annotations

import argparse
import json
import sys

from .serve import draft_tokens_arg


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1024 or prefix == "P":
            return f"{n:,.1f} {prefix}{unit}" if prefix else f"{n:,.0f} {unit}"
        n /= 1024
    return f"{n} {unit}"


def add_run(sub) -> None:
    from flashrt.argtypes import add_simulation_options, device, float_range, nonempty, positive_int, seed

    p = sub.add_parser("run", help="generate with the tiny built-in model (or --model small|PATH) and report")
    p.add_argument("--model", default="tiny", type=nonempty("model"),
                   help="tiny | small | tiny-vl | checkpoint directory (default tiny)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--prompt", default=None, type=nonempty("prompt"),
                      help="text to continue for --max-new-tokens tokens")
    text.add_argument("--chat", default=None, metavar="MESSAGE", type=nonempty("chat"),
                      help="a user message, rendered in the model's chat format and answered until EOS")
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt of --chat")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image shown before the prompt / chat text (repeatable; needs a vision model, e.g. tiny-vl)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="--chat in thinking mode (reasoning before the answer; default on)")
    p.add_argument("--effort", default=None, metavar="LEVEL",
                   help="reasoning effort of thinking mode: low | high | max (50 / 75 / 100) or 1..100 (default high)")
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
    p.add_argument("--speculative", choices=("dspark",), default=None,
                   help="speculative decoding with the model's DSpark draft layers (docs/speculative.md)")
    p.add_argument("--draft-tokens", type=draft_tokens_arg, default="auto", metavar="K|auto",
                   help="drafts verified per step with --speculative: 1..block size, or auto (default)")
    p.add_argument("--no-check-weights", action="store_true", help="skip the NaN / Inf check of the weights at load")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per group (docs/parallel.md)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel groups; tp x ep ranks, one per device")
    p.add_argument("--moe-dispatch", choices=("gather", "all_to_all"), default="gather",
                   help="how MoE tokens reach the experts' ranks with --tp / --ep (docs/parallel.md)")
    p.add_argument("--collective-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a rank waits for its peers before the run fails (with --tp / --ep)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_simulation_options(p)
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from flashrt.engine.run import DEFAULT_PROMPT, run
    from flashrt.graphs.finite import weight_checks

    if args.tp != 1 or args.ep != 1:  # several ranks, same arguments (engine/parallel_run.py)
        from functools import partial

        from flashrt.engine.parallel_run import run_parallel

        run = partial(run_parallel, tp=args.tp, ep=args.ep, timeout_s=args.collective_timeout,
                      dispatch=args.moe_dispatch)
    with weight_checks(not args.no_check_weights):
        report = run(args.model, DEFAULT_PROMPT if args.prompt is None else args.prompt, args.max_new_tokens,
                     args.device, args.backend, args.prefill, args.temperature, args.seed, quiet=args.json,
                     threads=args.threads, kv_budget=args.kv_budget, prefill_chunk=args.prefill_chunk,
                     cuda_graph=args.cuda_graph, prefix_cache=args.prefix_cache, chat=args.chat, system=args.system,
                     thinking=args.thinking, effort=args.effort, images=args.image,
                     weights_seed=args.weights_seed, **_speculative_args(args))
    if report is None:  # a torchrun rank other than 0: rank 0 prints
        return 0
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    r = report
    print(f"model {r['model']} on {r['device']} ({r['cpu_threads']} CPU threads), prefill {r['prefill']}")
    print("backends: " + ", ".join(f"{k} {v}" for k, v in r["backend_per_op_family"].items()))
    print(f"tokenizer: {r['tokenizer']}")
    _print_text(r)
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
    if "memory" in r:  # a single-device run (a --tp / --ep report has its own per-rank lines)
        _print_memory(r)
    pc = r["prefix_cache"]
    if pc:
        print(f"prefix cache {pc['root']}: {pc['hits']} hit(s), {pc['misses']} miss(es)")
    if r.get("parallel"):
        _print_parallel(r["parallel"])
    sp = r.get("speculative")
    if sp:
        print(f"speculative (dspark): acceptance {sp['acceptance_rate']:.1%}, {sp['mean_accepted_length']:.2f} tokens per "
              f"verify step, {sp['rounds']} verify + {sp['plain_steps']} plain steps, draft {sp['draft_seconds']:.2f} s, "
              f"verify {sp['verify_seconds']:.2f} s")
    g = r["step_capture"]
    if g:
        print(f"decode steps: {g['replayed']} replayed from CUDA graphs, {g['captured']} captured, "
              f"{g['eager']} eager, {g['fallback']} unbuffered (host-tier pages)")
    return 0


def _print_memory(r: dict) -> None:
    """The profile, where the Engram tables are, the --memory-limit cap and the KV budget sized from it."""
    mem = r["memory"]
    cap = f", device memory capped at {_human(mem['memory_limit_bytes'])}" if mem["memory_limit_bytes"] else ""
    sized = mem["kv_budget_bytes"] and mem["sized_from_bytes"]
    print(f"profile {r['profile']} (Engram tables: {r['engram_placement']}){cap}"
          + (f"; KV budget {_human(mem['kv_budget_bytes'])} from {_human(mem['sized_from_bytes'])}" if sized else ""))


def _speculative_args(args) -> dict:
    """--speculative / --draft-tokens for run() and run_parallel()."""
    if args.speculative is None:
        return {}
    return {"speculative": args.speculative, "draft_tokens": args.draft_tokens}


def _print_parallel(p: dict) -> None:
    """The ranks of a --tp / --ep run: bytes held and the experts' load per decode step."""
    ranks = ", ".join(f"rank {r['rank']} {_human(r['weight_bytes'])}" for r in p["ranks"])
    print(f"parallel: tp {p['tp']} x ep {p['ep']} = {p['world']} ranks over {p['collectives']}; weights {ranks}")
    steps = p["expert_pairs_per_rank_per_decode_step"]
    if steps:
        mean = [sum(col) / len(steps) for col in zip(*steps)]
        print("expert (token, expert) pairs per rank per decode step (all layers): "
              + ", ".join(f"{m:,.1f}" for m in mean) + f" (max / mean {max(mean) / max(sum(mean) / len(mean), 1e-9):.2f})")


def _print_text(r: dict) -> None:
    """The prompt or chat turn, the generated text, and for a chat the parsed answer."""
    c = r["chat"]
    if c is None:
        print(f"prompt ({r['prompt_tokens']} tokens): {r['prompt']!r}")
    else:
        mode = f"thinking, effort {c['effort']}" if c["thinking"] else "no thinking"
        print(f"chat ({r['prompt_tokens']} tokens, {mode}): " + (f"system {c['system']!r}, " if c["system"] else "")
              + f"user {c['user']!r}")
    if r.get("image_tokens"):
        print(f"images: {', '.join(r['images'])} ({r['image_tokens']} of the prompt tokens)")
    print(f"new ({r['new_tokens']} tokens): {r['new_text']!r}  ids {r['new_token_ids']}")
    m = r["message"]
    if m is not None:
        if c["thinking"]:
            print(f"reasoning: {m['reasoning_content']}")
        print(f"answer: {m['content']}")
        for call in m["tool_calls"]:
            print(f"tool call: {call['function']['name']}({call['function']['arguments']})")


def add_plan(sub) -> None:
    from flashrt.argtypes import float_range, nonempty, positive_int

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
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks per group: per-rank bytes (docs/parallel.md)")
    p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel groups (tp x ep ranks, one device each)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from flashrt.graphs.plan_report import plan_report

    gib, util, placement = 141.0, 0.9, "device"
    if args.plan_profile:
        from .commands import load_profile_option

        prof = load_profile_option(args.plan_profile)
        gib, util, placement = prof.device_memory_gib or gib, prof.memory_utilization, prof.engram_placement
    gib = args.memory_gib if args.memory_gib is not None else gib
    util = args.memory_utilization if args.memory_utilization is not None else util
    report = plan_report(args.model, args.context, gib * 2**30 * util, tp=args.tp, ep=args.ep,
                         engram_placement=placement)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        for line in report["lines"]:
            print(line)
    return 0
