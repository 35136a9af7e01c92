"""``flashrt serve``: the OpenAI-compatible server (FastAPI + uvicorn) over the serving engine.

SIGTERM / SIGINT: the engine stops admitting (new requests get 503), the listener closes, running
requests may finish for ``--grace-s`` seconds, the rest are aborted, and the process exits 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default="tiny", help="tiny | small | checkpoint directory (default tiny)")
    p.add_argument("--served-model-name", default=None, help="the model id clients ask for (default: --model's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("FLASHRT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $FLASHRT_API_KEY, else none)")
    p.add_argument("--max-waiting", type=int, default=None, metavar="N",
                   help="requests queued before new ones get 429 (default: no limit)")
    p.add_argument("--max-running", type=int, default=64, metavar="N", help="sequences decoding at once")
    p.add_argument("--max-step-tokens", type=int, default=None, metavar="N",
                   help="tokens per engine step (default: the hardware profile's serve_max_step_tokens)")
    p.add_argument("--device-timing", action="store_true",
                   help="time each step's forwards on the device too (metrics; costs a host sync per step)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each engine step before the host has read the previous step's tokens (default: on)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run every decode batch size and prefill shape class once with synthetic requests before "
                        "admitting any, so serving never stops to compile or capture (default: on with CUDA graphs)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N", help="prompt tokens per forward call")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N", help="prompt + output tokens")
    p.add_argument("--kv-budget", type=int, default=None, metavar="BYTES", help="device bytes for KV pages")
    p.add_argument("--max-kv-pages", type=int, default=None, metavar="N",
                   help="main-KV pages held at once before the scheduler preempts")
    p.add_argument("--prefix-cache-bytes", type=int, default=1 << 30, metavar="BYTES",
                   help="host memory for prefix snapshots (0: no prefix cache)")
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR", help="also keep prefix snapshots on disk")
    p.add_argument("--swap-bytes", type=int, default=4 << 30, metavar="BYTES",
                   help="host memory for preempted sequences (beyond it: drop and recompute)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="decode from captured CUDA graphs (default: on CUDA devices)")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay prompt chunks of at most 4,096 tokens (rows x chunk) and 8 rows from CUDA graphs, in prefill "
                        "states reused by request after request (default: with --cuda-graph, one device, "
                        "no --speculative)")
    p.add_argument("--speculative", default=None, choices=("dspark",),
                   help="speculative decoding with the model's draft layers (docs/speculative.md)")
    p.add_argument("--draft-tokens", default="auto", type=draft_tokens_arg, metavar="K|auto",
                   help="drafts verified per round with --speculative (default auto: chosen each round)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="weights seed of the built-in models")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: 1 for tiny on CPU)")
    p.add_argument("--grace-s", type=float, default=30.0, help="seconds running requests get at shutdown")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per group (docs/parallel.md)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel groups; tp x ep ranks, one per device")
    p.add_argument("--collective-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a rank waits for its peers before the server fails (with --tp / --ep)")
    p.add_argument("--dp-attention", action="store_true",
                   help="with --ep: each group runs only the requests placed on it (docs/parallel.md)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, apart from the HTTP server (default on; "
                        "one device; docs/serving.md)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=cmd_serve)


def draft_tokens_arg(value: str):
    """``--draft-tokens`` (run and serve): ``auto`` or a positive int (the model checks it against
    its block size)."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'auto', got {value!r}")
    return int(value)


SWITCH_INTERVAL_MS = 5.0  # Python's own default


def switch_interval_s(value: str | None) -> float:
    """The interpreter's thread switch interval for the server, in seconds, from
    ``FLASHRT_SWITCH_INTERVAL_MS`` (None: :data:`SWITCH_INTERVAL_MS`). The engine thread and the
    HTTP event loop share one interpreter: how long one may hold it while the other waits decides
    how much the streaming work delays the next engine step (docs/serving.md)."""
    if value is None:
        return SWITCH_INTERVAL_MS / 1e3
    try:
        ms = float(value)
    except ValueError:
        ms = float("nan")
    if not 0.01 <= ms <= 1000:
        raise ValueError(f"FLASHRT_SWITCH_INTERVAL_MS: expected milliseconds in [0.01, 1000], got {value!r}")
    return ms / 1e3


def cmd_serve(args) -> int:
    import torch
    import uvicorn

    from flashrt.engine import EngineConfig
    from flashrt.engine.run import pick_device
    from flashrt.engine.server.app import create_app

    for name in ("port", "max_waiting", "max_running", "max_step_tokens", "prefill_chunk"):
        v = getattr(args, name)
        if v is not None and (v < 1 or (name == "port" and v > 65535)):
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive {'port' if name == 'port' else 'count'}, got {v}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dev = pick_device(args.device)
    threads = args.threads or (1 if dev.type == "cpu" and args.model == "tiny" else None)
    if threads:
        torch.set_num_threads(threads)
    config = EngineConfig(max_running=args.max_running, max_step_tokens=args.max_step_tokens,
                          prefill_chunk=args.prefill_chunk, max_model_len=args.max_model_len,
                          max_waiting=args.max_waiting, kv_budget=args.kv_budget, max_kv_pages=args.max_kv_pages,
                          prefix_cache_bytes=args.prefix_cache_bytes, prefix_cache_dir=args.prefix_cache_dir,
                          swap_bytes=args.swap_bytes, cuda_graphs=args.cuda_graph,
                          speculative=args.speculative, draft_tokens=args.draft_tokens,
                          device_timing=args.device_timing, overlap=args.overlap, warmup=args.warmup,
                          prefill_graphs=args.prefill_graphs)
    if args.tp != 1 or args.ep != 1 or args.dp_attention:  # several ranks; rank 0 serves (engine/parallel_serve_run.py)
        from flashrt.engine.parallel_serve_run import ServeJob, serve_parallel

        return serve_parallel(ServeJob(args.model, args.tp, args.ep, config, args.host, args.port,
                                       args.served_model_name, args.api_key, args.device, args.seed, args.threads,
                                       args.grace_s, args.log_level, args.collective_timeout,
                                       dp_attention=args.dp_attention))
    from flashrt.engine.core_process import CoreSpec, build

    spec = CoreSpec(args.model, args.device, args.seed, config, threads, args.log_level)
    if args.engine_process:
        from flashrt.engine.client import EngineClient

        engine = EngineClient(spec)
    else:  # on CUDA the kernels compile on a pool while the model loads and warms up, as in the engine process
        engine = build(spec)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = create_app(engine, name, api_key=args.api_key)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.accepting = False  # stop admitting at once; uvicorn then drains the connections
            super().handle_exit(sig, frame)
            # a drained shutdown is a normal exit: uvicorn would re-raise the signal afterwards
            getattr(self, "_captured_signals", []).clear()

    if not args.engine_process:  # the engine thread shares this interpreter with the event loop
        sys.setswitchinterval(switch_interval_s(os.environ.get("FLASHRT_SWITCH_INTERVAL_MS")))
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.grace_s, access_log=args.log_level == "debug"))
    logging.getLogger("flashrt").info("serving %s on http://%s:%d (OpenAI API under /v1; tokenizer: %s)", name,
                                      args.host, args.port, engine.tokenizer.describe())
    server.run()
    return 0 if server.started else 1
