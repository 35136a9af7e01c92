"""``flashrt bench serve``: load a running OpenAI-compatible server and report what clients see.

Each level of the sweep sends ``--num-prompts`` streamed completion requests of random token ids
(``--input-len`` tokens, ``--output-len`` new tokens with ``ignore_eos``, greedy), either at most
``N`` at a time (``--concurrency``) or arriving as a Poisson process of ``R`` requests/s
(``--request-rate``; ``inf``: all at once). Per level: completed and failed requests, request and
token throughput, and p50 / p99 / mean of the time to first token (TTFT), the time per output
token after the first (TPOT) and the end-to-end latency, and the client's own CPU time over the
level (``client_busy`` near 1: the client, not the server, bounded it). The client is ``aiohttp``,
as vLLM's benchmark uses: its cost per streamed chunk is a fraction of ``httpx``'s.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    s = sorted(values)
    pick = lambda q: s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
    return {"p50": pick(0.50), "p99": pick(0.99), "mean": statistics.fmean(s)}


def make_prompts(n: int, input_len: int, range_ratio: float, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo = max(1, int(input_len * (1 - range_ratio)))
    hi = max(lo, int(input_len * (1 + range_ratio)))
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class EventReader:
    """The ``data:`` payloads of a stream of server-sent events, fed as the network splits it
    (LF or CRLF line endings; a carriage return that ends a piece waits for the next piece)."""

    def __init__(self):
        self.buffer, self.cr = bytearray(), b""

    def feed(self, piece: bytes) -> list[bytes]:
        piece = self.cr + piece
        self.cr = b"\r" if piece.endswith(b"\r") else b""
        self.buffer += piece[:-1] if self.cr else piece
        self.buffer[:] = self.buffer.replace(b"\r\n", b"\n")
        end = self.buffer.rfind(b"\n\n")
        if end < 0:
            return []
        done = bytes(self.buffer[:end])
        del self.buffer[:end + 2]
        return [line[6:] for event in done.split(b"\n\n") for line in event.split(b"\n")
                if line.startswith(b"data: ")]


async def one_request(session, url: str, body: dict, headers: dict) -> dict:
    t0 = time.perf_counter()
    first, tokens, error = None, 0, None
    try:
        async with session.post(url, json=body, headers=headers) as r:
            if r.status != 200:
                return {"ok": False, "error": f"HTTP {r.status}: {(await r.read())[:200]!r}"}
            reader = EventReader()
            async for piece in r.content.iter_any():
                for data in reader.feed(piece):
                    if data == b"[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = chunk["error"].get("message")
                    elif chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif first is None and chunk.get("choices"):
                        first = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, the sweep goes on
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    latency = time.perf_counter() - t0
    if error is not None or first is None:
        return {"ok": False, "error": error or "no output"}
    tpot = (latency - first) / (tokens - 1) if tokens > 1 else None
    return {"ok": True, "ttft": first, "tpot": tpot, "latency": latency, "tokens": tokens}


async def run_level(base_url: str, model: str, prompts, output_len: int, concurrency: int | None,
                    rate: float | None, api_key: str | None, seed: int, timeout_s: float) -> dict:
    import aiohttp

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=max(concurrency or len(prompts), 1))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def go(p, delay):
            await asyncio.sleep(delay)
            async with sem:
                body = {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                return await one_request(session, url, body, headers)

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if rate is not None and math.isfinite(rate):
                t += rng.expovariate(rate)
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(go(p, d) for p, d in zip(prompts, delays)))
        duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["tokens"] for r in ok)
    in_tokens = sum(len(p) for p, r in zip(prompts, results) if r["ok"])
    return {
        "concurrency": concurrency, "request_rate": rate, "num_prompts": len(prompts),
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
        "output_tokens": out_tokens, "input_tokens": in_tokens,
        "ttft_s": percentiles([r["ttft"] for r in ok]), "tpot_s": percentiles([r["tpot"] for r in ok if r["tpot"]]),
        "latency_s": percentiles([r["latency"] for r in ok]),
        # the client's own CPU time over the level: near the duration, the client bounded the level
        "client_cpu_s": cpu, "client_busy": cpu / duration if duration else 0.0,
    }


def served_model(base_url: str, api_key: str | None, timeout_s: float) -> tuple[str, int]:
    """(model id, vocabulary bound for random prompts) of the server."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                 headers={"authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise ValueError(f"base_url: GET /v1/models answered HTTP {exc.code}: {exc.read()[:200]!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"base_url: no server answers at {base_url} ({type(exc).__name__}: {exc})") from None
    return body["data"][0]["id"], 256


def sweep(base_url: str, concurrency=None, request_rate=None, num_prompts: int = 64, input_len: int = 128,
          output_len: int = 64, range_ratio: float = 0.0, model: str | None = None, api_key: str | None = None,
          seed: int = 0, vocab: int | None = None, timeout_s: float = 600.0, log=print) -> dict:
    """Run every level; returns the report (JSON-ready)."""
    if not concurrency and not request_rate:
        raise ValueError("concurrency, request_rate: give at least one level of either")
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ValueError("aiohttp: flashrt bench serve needs it (pip install aiohttp)") from None
    name, default_vocab = served_model(base_url, api_key, timeout_s)
    model = model or name
    prompts = make_prompts(num_prompts, input_len, range_ratio, vocab or default_vocab, seed)
    levels = [(c, None) for c in concurrency or []] + [(None, r) for r in request_rate or []]
    report = {"base_url": base_url, "model": model, "num_prompts": num_prompts, "input_len": input_len,
              "output_len": output_len, "range_ratio": range_ratio, "seed": seed, "levels": []}
    for c, r in levels:
        level = asyncio.run(run_level(base_url, model, prompts, output_len, c, r, api_key, seed, timeout_s))
        report["levels"].append(level)
        log(f"{'concurrency ' + str(c) if c else f'rate {r}/s'}: {level['completed']}/{num_prompts} ok, "
            f"{level['output_throughput']:.1f} output tok/s, TTFT p50 {fmt(level['ttft_s']['p50'])} "
            f"p99 {fmt(level['ttft_s']['p99'])}, TPOT p50 {fmt(level['tpot_s']['p50'])} p99 {fmt(level['tpot_s']['p99'])}, "
            f"client busy {level['client_busy']:.0%}")
    return report


def fmt(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def add_parser(bsub) -> None:
    p = bsub.add_parser("serve", help="load a running server (like vllm bench serve): throughput, TTFT, TPOT")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=None, metavar="N", help="levels: requests in flight")
    p.add_argument("--request-rate", type=float, nargs="+", default=None, metavar="R",
                   help="levels: Poisson arrivals per second (inf: all at once)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request (ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="prompt lengths uniform in len*(1 +- ratio)")
    p.add_argument("--vocab", type=int, default=None, help="ids drawn below this (default 256: byte ids)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=None, metavar="FILE", help="write the JSON report here")
    p.set_defaults(func=cmd_serve_bench)


def cmd_serve_bench(args) -> int:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.concurrency and min(args.concurrency) < 1:
        raise ValueError(f"--concurrency: expected ints >= 1, got {args.concurrency}")
    if args.request_rate and min(args.request_rate) <= 0:
        raise ValueError(f"--request-rate: expected rates > 0, got {args.request_rate}")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio: expected a number in [0, 1), got {args.range_ratio}")
    report = sweep(args.base_url, args.concurrency, args.request_rate, args.num_prompts, args.input_len,
                   args.output_len, args.range_ratio, args.model, args.api_key, args.seed, args.vocab, args.timeout_s)
    if args.out:
        from pathlib import Path

        from flashrt.jit import atomic_write

        atomic_write(Path(args.out), (json.dumps(report, indent=2) + "\n").encode())
        print(f"wrote {args.out}")
    else:
        print(json.dumps(report, indent=2))
    return 1 if any(level["failed"] for level in report["levels"]) else 0
