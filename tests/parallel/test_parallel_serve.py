"""``flashrt serve --tp / --ep``: rank 0 serves HTTP, every rank runs the same steps (gloo on CPU).

The server runs in this process's main thread (it owns the signal handlers, as the CLI does); a
client thread talks to it, then stops it with SIGTERM or stops one of its ranks."""
import os
import re
import signal
import time

import pytest
from parallel_text import random_text
from serve_client import get as _get, gone as _gone, post as _post, serve
import torch

from flashrt.engine import Engine, EngineConfig, SamplingParams
from flashrt.engine.launch import free_port
from flashrt.engine.parallel_serve_run import ServeJob
from flashrt.engine.run import load_model

CONFIG = dict(max_running=4, prefill_chunk=8, max_step_tokens=16)


def _text(rng, n):
    return random_text(rng, n)


def _serve(tp, ep, port, client, timeout_s):
    """Run the server until it stops; the ranks' process ids and its exit status (or exception)."""
    job = ServeJob("tiny", tp, ep, EngineConfig(**CONFIG), port=port, log_level="warning", timeout_s=timeout_s,
                   threads=1)
    return serve(job, client)


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_server_on_two_ranks_answers_like_one_process(cache, rng, tp, ep):
    """Greedy completions equal one process's, a repeated prompt hits the prefix cache (on every
    rank alike: a rank out of step would stop the server), a seeded sampled request completes, and
    SIGTERM drains and ends every rank with status 0."""
    prompts = [_text(rng, 21), _text(rng, 5)]
    torch.set_num_threads(1)
    one = Engine(load_model("tiny", torch.device("cpu"), 0, quiet=True), **CONFIG)
    want = [o.outputs[0].text for o in one.generate(prompts, SamplingParams(max_tokens=6, temperature=0))]
    got = []

    def client(pids):
        for p in prompts + prompts[:1]:
            status, body = _post(port, {"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0})
            assert status == 200, body
            got.append(body["choices"][0]["text"])
        status, body = _post(port, {"model": "tiny", "prompt": prompts[1], "max_tokens": 5, "temperature": 1.0,
                                    "seed": 7})
        assert status == 200 and body["usage"]["completion_tokens"] == 5, body
        hits = re.search(r"^flashrt_prefix_cache_hits_total (\S+)", _get(port, "/metrics"), re.M)
        assert hits and float(hits.group(1)) >= 1  # the repeated 21-token prompt reused 16 cached tokens
        os.kill(os.getpid(), signal.SIGTERM)  # the parent hands it to rank 0, which drains and stops all

    port = free_port()
    pids, box = _serve(tp, ep, port, client, timeout_s=60)
    assert box.get("exit") == 0, box
    assert got == want + want[:1]
    assert len(pids) == 2
    _gone(pids)


def test_a_hung_rank_fails_the_request_and_ends_the_server(cache, rng):
    """Rank 1 is stopped (SIGSTOP) while serving: the next request gets an error naming the
    collective timeout, the server ends, the launcher names rank 1 and no rank process is left."""
    answers = []

    def client(pids):
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        answers.append((*_post(port, {"model": "tiny", "prompt": _text(rng, 9), "max_tokens": 4}),
                        time.monotonic() - t0))

    port = free_port()
    t0 = time.monotonic()
    pids, box = _serve(2, 1, port, client, timeout_s=4)
    status, body, waited = answers[0]
    assert status == 500 and "collective timeout" in body["error"]["message"], body
    assert waited < 4 + 10  # the timeout, plus a busy machine
    err = box["error"]
    assert err.rank == 1 and re.search(r"rank 1 stopped answering .*4 s collective timeout", str(err)), str(err)
    assert time.monotonic() - t0 < 240
    _gone(pids)


def test_replicated_dispatch_is_refused_where_groups_run_different_sequences():
    from flashrt.engine.parallel import parallel_generate
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model
    from flashrt.graphs.parallel import Layout, Parallel

    cfg = shipped_config("tiny")
    model = Model(cfg, init_weights(cfg, seed=0), parallel=Parallel(Layout(), "replicated"))
    with pytest.raises(ValueError, match="'replicated' MoE dispatch is for engines"):
        parallel_generate(model, [[1, 2, 3]], 2)
    with pytest.raises(ValueError, match=r"dispatch: expected one of \['gather', 'all_to_all', 'replicated'\]"):
        Parallel(Layout(), "scatter")


def test_bad_serve_requests_are_refused_before_any_rank_starts(cache, tmp_path, capsys):
    from flashrt.cli.commands import main

    assert main(["serve", "--tp", "3"]) == 2
    assert "tp: expected a divisor of n_heads=4" in capsys.readouterr().err
    assert main(["serve", "--tp", "2", "--prefix-cache-dir", str(tmp_path / "p")]) == 2
    assert "prefix_cache_dir: a disk prefix cache is not shared by the ranks" in capsys.readouterr().err
    assert main(["serve", "--ep", "2", "--cuda-graph"]) == 2
    assert "cuda_graph: CUDA graphs need a CUDA device, the device is cpu" in capsys.readouterr().err
    assert main(["serve", "--tp", "2", "--collective-timeout", "0"]) == 2
    assert "collective_timeout: expected seconds > 0, got 0.0" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
