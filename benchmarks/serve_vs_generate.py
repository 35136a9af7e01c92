"""Serving throughput against the fixed-batch ``generate()`` of the same model, same run.

    python benchmarks/serve_vs_generate.py --model small --out benchmarks/results/h200-serve.json

1. ``flashrt.generate`` on ``--batch`` random prompts of ``--input-len`` byte ids, ``--output-len``
   new tokens each (CUDA graphs on CUDA): output tokens/s over the whole call (prefill included),
   after a warm-up call on the same prompts that compiles the kernels and captures the steps.
2. ``flashrt serve --model M`` started as a subprocess, then ``flashrt bench serve`` at the given
   concurrency levels with the same lengths (streamed requests through the OpenAI API): output
   tokens/s, TTFT and TPOT p50 / p99 per level, after one untimed warm-up pass at the highest
   level (kernel compiles and step captures). The server is stopped with SIGTERM.
``ratio_to_generate`` of a level = its output tokens/s over step 1's.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

import flashrt
from flashrt.engine.run import load_model, pick_device
from results_io import write_json


def generate_throughput(model_name: str, batch: int, input_len: int, output_len: int) -> dict:
    model = load_model(model_name, pick_device(None), quiet=True)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (batch, input_len), generator=gen).tolist()
    flashrt.generate(model, prompts, 8)  # compiles this batch's kernel variants and captures its decode steps
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = flashrt.generate(model, prompts, output_len)
    sync()
    seconds = time.perf_counter() - t0
    del model
    return {"batch": batch, "seconds": seconds, "output_tokens": out.new_tokens,
            "output_throughput": out.new_tokens / seconds, "decode_seconds": out.decode_seconds,
            "prefill_seconds": out.prefill_seconds}


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"flashrt serve exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"flashrt serve was not healthy after {timeout:.0f} s")


def serve_levels(args) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "flashrt.cli", "serve", "--model", args.model, "--port", str(args.port),
           "--max-running", str(max(args.concurrency)), "--max-model-len", str(args.input_len + args.output_len + 64)]
    proc = subprocess.Popen(cmd)
    try:
        wait_healthy(url, proc, args.start_timeout)
        bench = [sys.executable, "-m", "flashrt.cli", "bench", "serve", "--base-url", url,
                 "--input-len", str(args.input_len)]
        top = str(max(args.concurrency))
        subprocess.run([*bench, "--concurrency", top, "--num-prompts", top, "--output-len", "8"], check=True)  # warm-up
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "serve.json"
            subprocess.run([*bench, "--concurrency", *map(str, args.concurrency), "--num-prompts", str(args.num_prompts),
                            "--output-len", str(args.output_len), "--out", str(out)], check=True)
            return json.loads(out.read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = generate_throughput(args.model, args.batch, args.input_len, args.output_len)
    print(f"generate(): batch {args.batch}: {base['output_throughput']:.1f} output tok/s", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    served = serve_levels(args)
    for level in served["levels"]:
        level["ratio_to_generate"] = level["output_throughput"] / base["output_throughput"]
        print(f"serve, concurrency {level.get('concurrency')}: {level['output_throughput']:.1f} output tok/s "
              f"= {level['ratio_to_generate']:.2f}x generate()", flush=True)
    write_json(args.out, {"model": args.model, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                          else "cpu", "generate": base, "serve": served})


if __name__ == "__main__":
    main()
