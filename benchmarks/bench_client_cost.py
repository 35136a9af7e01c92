"""CPU a streaming benchmark client spends per server-sent chunk: ``flashrt bench serve``'s client
(``aiohttp``) against an ``httpx`` line reader (the client it replaced), same server, same run.

    python benchmarks/bench_client_cost.py --out benchmarks/results/cpu-bench-client-cost.json

A local server (FastAPI + uvicorn, in a process of its own) streams ``--tokens`` OpenAI-style
completion chunks to each of ``--requests`` requests, ``--concurrency`` at a time, as fast as it
can, one write per chunk. Each client runs the same level twice (the first warms connections and
imports); reported: the second run's process CPU seconds over the chunks received (``us_per_chunk``),
and its wall time. On a machine with few cores the server competes with the client: compare the
two clients, not absolute rates.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request

from results_io import write_json

SERVER = r'''
import asyncio, json, sys
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
import uvicorn
app = FastAPI()
@app.get("/v1/models")
def models():
    return {"data": [{"id": "m"}]}
@app.post("/v1/completions")
async def completions(body: dict):
    n = body["max_tokens"]
    async def chunks():
        for _ in range(n):
            yield "data: " + json.dumps({"id": "c", "object": "text_completion", "model": "m",
                                         "choices": [{"index": 0, "text": "ab", "finish_reason": None}]}) + "\n\n"
            await asyncio.sleep(0)  # one write per chunk, as a server streaming step by step
        yield "data: " + json.dumps({"id": "c", "choices": [], "usage": {"completion_tokens": n}}) + "\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(chunks(), media_type="text/event-stream")
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


async def httpx_level(url: str, prompts, tokens: int, concurrency: int) -> int:
    """The replaced client's reading: ``httpx`` streaming, ``aiter_lines``, one JSON parse a chunk."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one(p):
            n = 0
            async with sem, client.stream("POST", url + "/v1/completions", json={
                    "model": "m", "prompt": p, "max_tokens": tokens, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        n += "usage" not in json.loads(line[6:])
            return n
        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(run) -> dict:
    run()  # warm: connections, imports
    cpu, t0 = time.process_time(), time.perf_counter()
    chunks = run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - t0
    return {"chunks": chunks, "cpu_s": cpu, "wall_s": wall, "us_per_chunk": 1e6 * cpu / max(chunks, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=0, help="the local server's port (0: a free one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for name in ("requests", "concurrency", "tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    from flashrt.bench.serve import run_level

    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    try:
        for _ in range(300):
            if server.poll() is not None:
                raise RuntimeError(f"the local server exited with {server.returncode} (port {port})")
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        prompts = [[1, 2, 3]] * args.requests

        def bench_client() -> int:  # chunks received: the usage chunks' token counts
            level = asyncio.run(run_level(url, "m", prompts, args.tokens, args.concurrency, None, None, 0, 600))
            if level["completed"] != args.requests:
                raise RuntimeError(f"the bench client completed {level['completed']} of {args.requests}: {level['errors']}")
            return level["output_tokens"]

        aio = measure(bench_client)
        hx = measure(lambda: asyncio.run(httpx_level(url, prompts, args.tokens, args.concurrency)))
    finally:
        server.terminate()
        server.wait(timeout=30)
    result = {"host": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "requests": args.requests,
              "concurrency": args.concurrency, "tokens": args.tokens, "aiohttp_bench_client": aio, "httpx_reader": hx,
              "ratio_httpx_to_aiohttp": hx["us_per_chunk"] / aio["us_per_chunk"]}
    print(f"bench serve client (aiohttp): {aio['us_per_chunk']:.1f} us CPU a chunk; httpx reader: "
          f"{hx['us_per_chunk']:.1f} us ({result['ratio_httpx_to_aiohttp']:.1f}x)")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
