"""``flashrt serve --ep M --dp-attention``: each expert-parallel group runs only the requests placed on it.

The server runs in this process's main thread; client threads send concurrent requests, read the
per-group figures from /metrics, then stop it with SIGTERM."""
import os
import re
import signal
import threading

import pytest
from parallel_text import random_text
from serve_client import get, gone, post, serve
import torch

from flashrt.engine import Engine, EngineConfig, SamplingParams
from flashrt.engine.launch import free_port
from flashrt.engine.parallel_groups import pool_bytes
from flashrt.engine.parallel_serve_run import ServeJob
from flashrt.engine.run import load_model

# the pools are reserved for max_running rows up front (kv_budget): their bytes follow max_running
CONFIG = dict(max_running=4, prefill_chunk=8, max_step_tokens=16, max_model_len=256, kv_budget=1 << 24)


def _metric(text, name, group):
    m = re.search(rf'^flashrt_{name}{{group="{group}"}} (\S+)', text, re.M)
    assert m, f"{name} of group {group} not in /metrics"
    return float(m.group(1))


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 2)])
def test_groups_serve_concurrent_requests_like_one_process(cache, rng, tp, ep):
    """Concurrent greedy completions equal one process's, the requests land on every group, a
    repeated prompt hits its group's prefix cache, each rank's page pool is one process's for the
    group's share of max_running (not the whole server's), and SIGTERM ends every rank with status 0."""
    prompts = [random_text(rng, n) for n in (21, 5, 13, 17, 9, 26)]
    torch.set_num_threads(1)
    model = load_model("tiny", torch.device("cpu"), 0, quiet=True)
    one = Engine(model, **CONFIG)
    want = [o.outputs[0].text for o in one.generate(prompts, SamplingParams(max_tokens=6, temperature=0))]
    group_pool = pool_bytes(Engine(model, **dict(CONFIG, max_running=CONFIG["max_running"] // ep)).step_loop.pool)
    whole_pool = pool_bytes(one.step_loop.pool)
    got, seen = {}, {}

    def ask(i, p):
        status, body = post(port, {"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0})
        got[i] = body["choices"][0]["text"] if status == 200 else body

    def client(pids):
        threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ask(len(prompts), prompts[0])  # the 21-token prompt again: 16 tokens from the prefix cache
        seen["metrics"] = get(port, "/metrics")
        os.kill(os.getpid(), signal.SIGTERM)  # the parent hands it to rank 0, which drains and stops all

    port = free_port()
    job = ServeJob("tiny", tp, ep, EngineConfig(**CONFIG), port=port, log_level="warning", timeout_s=60, threads=1,
                   dp_attention=True)
    pids, box = serve(job, client)
    assert box.get("exit") == 0, box
    assert [got[i] for i in range(len(prompts) + 1)] == want + want[:1]
    text = seen["metrics"]
    placed = [_metric(text, "group_requests_total", g) for g in range(ep)]
    assert sum(placed) == len(prompts) + 1 and min(placed) >= 1, placed
    hits = re.search(r"^flashrt_prefix_cache_hits_total (\S+)", text, re.M)
    assert hits and float(hits.group(1)) >= 1
    assert sum(_metric(text, "group_prefix_hits_total", g) for g in range(ep)) == float(hits.group(1))
    for g in range(ep):
        assert _metric(text, "group_kv_pool_bytes", g) == group_pool < whole_pool
    assert len(pids) == tp * ep
    gone(pids)
