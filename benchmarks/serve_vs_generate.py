"""Serving throughput against the fixed-batch ``generate()`` of the same model, same run.

    python benchmarks/serve_vs_generate.py --model small --out benchmarks/results/h200-serve.json

1. ``flashrt.generate`` on ``--batch`` random prompts of ``--input-len`` byte ids, ``--output-len``
   new tokens each (CUDA graphs on CUDA): output tokens/s over the whole call (prefill included),
   after the same call untimed (kernel compiles; a call's decode graphs are its own, so the timed
   call captures its steps again, as every call of ``generate()`` does).
2. ``flashrt serve --model M`` started as a subprocess, then ``flashrt bench serve`` at the given
   concurrency levels with the same lengths (streamed requests through the OpenAI API): output
   tokens/s, TTFT and TPOT p50 / p99 per level, after one untimed warm-up pass at the highest
   level with the same prompts and lengths (kernel compiles and step captures); each level runs as
   its own ``bench serve`` call. The
   server is stopped with SIGTERM.
``ratio_to_generate`` of a level = its output tokens/s over step 1's; ``ratio_to_generate_same_batch``
= over ``generate()`` at a batch of the level's concurrency (measured the same way). Each level also carries
``engine``: the server's step counters over that level (``/metrics``, ``flashrt_engine_*``): steps/s,
mean step time, mean decode batch, prompt tokens per prefill forward, the share of wall time the
loop spent in steps (``engine_busy``) and, of the step time, the decode / prefill / sampling shares
(host wall time, and device time from CUDA events), the prefix-snapshot and join shares, the
server's mean time to first token, time in the queue and prefill time of the level's requests
(``server_mean_s``, from their arrival at the engine), and ``cpu``: the CPU seconds of the server's
processes (the HTTP server, the engine process) and their busiest threads' shares of the level's
wall time (a thread near 100% bounds the level), and the benchmark client's CPU seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
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
from proc_cpu import busiest, snapshot
from results_io import write_json


def generate_throughput(model_name: str, batch: int, input_len: int, output_len: int) -> dict:
    model = load_model(model_name, pick_device(None), quiet=True)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (batch, input_len), generator=gen).tolist()
    flashrt.generate(model, prompts, output_len)  # the same call untimed: kernel compiles, its shapes seen
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = flashrt.generate(model, prompts, output_len)
    sync()
    seconds = time.perf_counter() - t0
    del model
    return {"batch": batch, "seconds": seconds, "output_tokens": out.new_tokens,
            "decode_step_ms": 1e3 * out.decode_seconds / max(output_len - 1, 1),
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


def engine_counters(url: str) -> dict:
    """The server's ``flashrt_engine_*`` counters (``/metrics``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("flashrt_engine_") and "_total " in line:
            name, value = line.split(" ", 1)
            out[name[len("flashrt_engine_"):-len("_total")]] = float(value)
        elif line.startswith(tuple(f"flashrt_{h}_seconds_" for h in TIMES)) and line.split(" ", 1)[0].endswith(("_sum", "_count")):
            name, value = line.split(" ", 1)
            out[name[len("flashrt_"):]] = float(value)
    return out


# request-time histograms of /metrics whose means over a level are reported (the server's view:
# from a request's arrival at the engine, so the client's TTFT less these is transport)
TIMES = ("time_to_first_token", "request_queue_time", "request_prefill_time")


def where_time_goes(before: dict, after: dict, duration: float) -> dict:
    """One level's engine counters (differences over the level) as rates and shares."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    step_s = d.get("step_seconds", 0.0)
    share = lambda k: d.get(k, 0.0) / step_s if step_s else 0.0  # noqa: E731
    return {
        "steps": int(d.get("steps", 0)), "steps_per_s": d.get("steps", 0) / duration,
        "step_ms": 1e3 * step_s / d["steps"] if d.get("steps") else 0.0,
        "mean_decode_batch": d["decode_rows"] / d["decode_steps"] if d.get("decode_steps") else 0.0,
        "prefill_forwards": int(d.get("prefill_forwards", 0)),
        "decode_captures": int(d.get("decode_captures", 0)),  # captures during the level (not warm-up)
        "prefill_captures": int(d.get("prefill_captures", 0)), "prefill_replays": int(d.get("prefill_replays", 0)),
        "prefill_tokens_per_forward": d["prefill_step_tokens"] / d["prefill_forwards"] if d.get("prefill_forwards") else 0.0,
        "engine_busy": step_s / duration,  # the rest: the loop waited for requests
        "share_decode": share("decode_seconds"), "share_prefill": share("prefill_seconds"),
        "share_sample": share("sample_seconds"), "share_prefix": share("prefix_seconds"),
        "share_join": share("join_seconds"),
        "share_decode_device": share("decode_device_seconds"), "share_prefill_device": share("prefill_device_seconds"),
        "counters": d,
        "server_mean_s": {h: d[f"{h}_seconds_sum"] / d[f"{h}_seconds_count"] for h in TIMES
                          if d.get(f"{h}_seconds_count")},
    }


def built_in(log_path: str, start: float, end: float) -> dict:
    """The kernel variants the server built (compiled or loaded) during ``[start, end)``: their
    count, seconds, and each one's kernel and specialisation key (``core/jit_log.py``)."""
    from flashrt.jit_log import between, read

    rows = between(read(log_path), start, end) if os.path.exists(log_path) else []
    return {"count": len(rows), "seconds": round(sum(r["s"] or 0 for r in rows), 3),
            "variants": [{k: r.get(k) for k in ("t", "s", "name", "repr", "key")} for r in rows]}


def traced(path: str, start: float, end: float) -> dict:
    """The server's engine steps during ``[start, end)`` (Unix time) from its step trace, summarised
    (``engine/step_trace.py``). The trace is written in blocks: a short wait lets the last one land."""
    from flashrt.engine.step_trace import read, summary

    time.sleep(0.5)
    steps = [s for s in read(path) if start <= s["t"] < end] if os.path.exists(path) else []
    return summary(steps)


def serve_levels(args) -> dict:
    """Each concurrency level as its own ``flashrt bench serve`` run, with the server's engine
    counters read before and after it."""
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "flashrt.cli", "serve", "--model", args.model, "--port", str(args.port),
           "--max-running", str(max(args.concurrency)), "--max-model-len", str(args.input_len + args.output_len + 64)]
    if args.max_step_tokens is not None:
        cmd += ["--max-step-tokens", str(args.max_step_tokens)]
    if args.device_timing:
        cmd += ["--device-timing"]
    cmd += args.serve_arg
    env = dict(os.environ)
    if args.profile_engine:
        env["FLASHRT_PROFILE_ENGINE"] = args.profile_engine  # engine/loop_profile.py
    if args.step_trace:
        env["FLASHRT_STEP_TRACE"] = args.step_trace  # engine/step_trace.py: a line per engine step
    if args.jit_log:
        env["FLASHRT_JIT_LOG"] = args.jit_log  # core/jit_log.py: a line per kernel variant built
    launched = time.time()
    proc = subprocess.Popen(cmd, env=env)
    try:
        wait_healthy(url, proc, args.start_timeout)
        start_s = round(time.time() - launched, 2)  # load, warm-up and the compiles they wait on
        bench = [sys.executable, "-m", "flashrt.cli", "bench", "serve", "--base-url", url,
                 "--input-len", str(args.input_len)]
        top = str(max(args.concurrency))
        # warm-up: the highest level's whole run, untimed (kernel variants, decode graphs of every
        # bucket and position the timed runs reach)
        subprocess.run([*bench, "--concurrency", top, "--num-prompts", str(args.num_prompts),
                        "--output-len", str(args.output_len)], check=True)
        result = None
        with tempfile.TemporaryDirectory() as tmp:
            for level in args.concurrency:
                out = Path(tmp) / f"serve-{level}.json"
                before, started = engine_counters(url), time.time()
                cpu0, client0 = snapshot(proc.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
                subprocess.run([*bench, "--concurrency", str(level), "--num-prompts", str(args.num_prompts),
                                "--output-len", str(args.output_len), "--out", str(out)], check=True)
                cpu1, client1 = snapshot(proc.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
                wall = time.time() - started
                one = json.loads(out.read_text())
                for lv in one["levels"]:
                    lv["engine"] = where_time_goes(before, engine_counters(url), lv["duration_s"])
                    # which thread of the server's processes ran all the time (a GIL-bound
                    # bottleneck), and the benchmark client's CPU, over the whole bench call
                    lv["cpu"] = {"wall_s": round(wall, 3), "server": busiest(cpu0, cpu1, wall),
                                 "client_cpu_s": round(client1.ru_utime + client1.ru_stime
                                                       - client0.ru_utime - client0.ru_stime, 3)}
                    if args.jit_log:
                        lv["jit_built"] = built_in(args.jit_log, started, time.time())
                    if args.step_trace:
                        lv["steps"] = traced(args.step_trace, started, time.time())
                if result is None:
                    result = one
                else:
                    result["levels"] += one["levels"]
        result["server_start_s"] = start_s
        return result
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains and exits), then a kill if it has not exited a minute later."""
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
    ap.add_argument("--max-step-tokens", type=int, default=None, help="the server's (default: its profile's)")
    ap.add_argument("--device-timing", action="store_true",
                    help="the server times its forwards on the device (a host sync per step: slows it down)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for flashrt serve (repeatable), e.g. --serve-arg=--no-engine-process")
    ap.add_argument("--profile-engine", default=None, metavar="FILE",
                    help="cProfile the server's engine loop thread into FILE (written when the server stops)")
    ap.add_argument("--step-trace", default=None, metavar="FILE",
                    help="the server writes a line per engine step to FILE (a new file); each level "
                         "gets a summary of its steps")
    ap.add_argument("--jit-log", default=None, metavar="FILE",
                    help="log every kernel variant the server builds to FILE (appended) and list, per "
                         "timed level, those built during it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = generate_throughput(args.model, args.batch, args.input_len, args.output_len)
    print(f"generate(): batch {args.batch}: {base['output_throughput']:.1f} output tok/s", flush=True)
    same = {args.batch: base}  # generate() at each concurrency level's batch size
    for level in args.concurrency:
        if level not in same:
            same[level] = generate_throughput(args.model, level, args.input_len, args.output_len)
            print(f"generate(): batch {level}: {same[level]['output_throughput']:.1f} output tok/s", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    served = serve_levels(args)
    print(f"serve: healthy {served['server_start_s']:.1f} s after launch (load, warm-up, compiles)", flush=True)
    for level in served["levels"]:
        level["ratio_to_generate"] = level["output_throughput"] / base["output_throughput"]
        level["generate_same_batch"] = same[level["concurrency"]]["output_throughput"]
        level["ratio_to_generate_same_batch"] = level["output_throughput"] / level["generate_same_batch"]
        e = level["engine"]
        print(f"serve, concurrency {level.get('concurrency')}: {level['output_throughput']:.1f} output tok/s "
              f"= {level['ratio_to_generate']:.2f}x generate() at batch {args.batch}, "
              f"{level['ratio_to_generate_same_batch']:.2f}x at batch {level['concurrency']}; {e['steps_per_s']:.0f} steps/s, "
              f"{e['step_ms']:.1f} ms/step, mean decode batch {e['mean_decode_batch']:.1f}, "
              f"{e['prefill_tokens_per_forward']:.0f} prefill tokens/forward, engine busy {e['engine_busy']:.0%} "
              f"(decode {e['share_decode']:.0%}, prefill {e['share_prefill']:.0%}, sample {e['share_sample']:.0%}; "
              f"device: decode {e['share_decode_device']:.0%}, prefill {e['share_prefill_device']:.0%})", flush=True)
        if e.get("server_mean_s"):
            print("  server means: " + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in e["server_mean_s"].items()),
                  flush=True)
        if "cpu" in level:
            c = level["cpu"]
            print(f"  CPU over {c['wall_s']:.1f} s: client {c['client_cpu_s']:.1f} s "
                  f"({level.get('client_busy', 0):.0%} busy in the level); " + "; ".join(
                f"{p['command'][:40]!r} {p['cpu_s']:.1f} s (threads " + ", ".join(
                    f"{t['name']} {t['share']:.0%}" for t in p["threads"]) + ")" for p in c["server"]), flush=True)
    write_json(args.out, {"model": args.model, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                          else "cpu", "serve_args": args.serve_arg, "generate": base, "generate_by_batch": same,
                          "serve": served})


if __name__ == "__main__":
    main()
