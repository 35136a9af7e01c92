"""The engine in a process of its own (engine/client.py, engine/core_process.py) on the tiny model
(CPU): greedy outputs equal the in-process engine's, streamed deltas add up, bad input is refused
in the server process with the engine's own errors, metrics records arrive, the queue limit holds,
shutdown lets running requests finish, and a dead engine process fails every open request."""
import asyncio
import os
import signal
import time

import pytest
import torch

from flashrt.engine import Engine, EngineConfig, SamplingParams
from flashrt.engine.client import EngineClient
from flashrt.engine.core_process import CoreSpec
from flashrt.engine.errors import EngineStopped, PromptTooLong, QueueFull, RequestError
from flashrt.engine.run import load_model

SMALL = dict(prefill_chunk=16, max_step_tokens=48, max_running=8, max_model_len=96)


def spec(**over):
    return CoreSpec("tiny", "cpu", 0, EngineConfig(**{**SMALL, **over}), threads=1)


@pytest.fixture(scope="module")
def client():
    c = EngineClient(spec())
    yield c
    c.shutdown(grace_s=5)


def prompts_for(rng, lengths):
    return [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths]


async def _collect(engine, prompts, params):
    async def one(p):
        outs = [o async for o in engine.stream(engine.add_request(p, params))]
        return outs
    return await asyncio.gather(*(one(p) for p in prompts))


def test_the_engine_process_may_have_children(client):
    """On CUDA it forks its compile workers (engine/precompile.py), which a daemonic process may not."""
    assert client._proc.is_alive() and not client._proc.daemon


def test_greedy_equals_the_in_process_engine(client, rng):
    """Also the pipe's slim outputs (engine/wire.py): every streamed output is whole again, its
    cumulative fields the sum of the deltas so far; nothing of a request is kept once it ended."""
    model = load_model("tiny", torch.device("cpu"), 0, quiet=True)  # what the engine process loads
    prompts = prompts_for(rng, torch.randint(3, 30, (5,), generator=rng).tolist())
    params = SamplingParams(temperature=0, max_tokens=int(torch.randint(3, 12, (1,), generator=rng)), logprobs=1,
                            n=2, stop=["\ufffd\ufffd"])
    want = Engine(model, **SMALL).generate(prompts, params)
    got = asyncio.run(_collect(client, prompts, params))
    for p, w, outs in zip(prompts, want, got):
        assert outs[-1].finished and all(o.prompt_token_ids == p for o in outs)
        for i, wc in enumerate(w.outputs):
            last = outs[-1].outputs[i]
            assert (last.token_ids, last.text, last.finish_reason, last.stop_reason) == \
                (wc.token_ids, wc.text, wc.finish_reason, wc.stop_reason)
            assert [lp.token for lp in last.logprobs] == [lp.token for lp in wc.logprobs] == last.token_ids
            assert [lp.logprob for lp in last.logprobs] == pytest.approx([lp.logprob for lp in wc.logprobs], abs=1e-4)
            sofar = ([], "", [])
            for o in outs:
                c = o.outputs[i] if len(o.outputs) > i else None
                if c is not None:
                    sofar = (sofar[0] + c.delta_token_ids, sofar[1] + c.delta_text, sofar[2] + c.delta_logprobs)
                    assert (c.token_ids, c.text, c.logprobs) == sofar
    assert client.step_error is None and client.stats()["finished"] >= len(prompts)
    assert not client._sofar and not client._open


def test_a_stream_left_early_leaves_nothing_behind(client, rng):
    async def go():
        it = client.stream(client.add_request(prompts_for(rng, (12,))[0], SamplingParams(
            n=2, temperature=1.0, max_tokens=60, ignore_eos=True, logprobs=0)))
        first = await it.__anext__()
        await it.aclose()  # aborts the request; the engine's last output of it drops what the client kept
        return first
    first = asyncio.run(go())
    assert not first.finished
    for _ in range(200):
        if not client._sofar and not client._open:
            break
        time.sleep(0.05)
    assert not client._sofar and not client._open


def test_bad_input_is_refused_before_it_is_sent(client):
    async def go():
        with pytest.raises(RequestError, match="prompt"):
            client.add_request([client.model.cfg.vocab_size], SamplingParams(max_tokens=2))
        with pytest.raises(PromptTooLong, match="context of 96"):
            client.add_request([1] * 90, SamplingParams(max_tokens=10))
        with pytest.raises(RequestError, match="prompt"):
            client.add_request("", SamplingParams())
    asyncio.run(go())


def test_finish_records_reach_the_hooks(client, rng):
    records = []
    client.on_finish(records.append)
    asyncio.run(_collect(client, prompts_for(rng, (7, 9)), SamplingParams(temperature=0, max_tokens=4)))
    assert len(records) >= 2
    r = records[-1]
    assert r.output_tokens == 4 and r.n_seqs == 1 and r.arrival <= r.first_token_time <= r.finish_time


def test_bad_model_raises_the_engine_error():
    with pytest.raises(ValueError, match="model"):
        EngineClient(CoreSpec("/nonexistent/flashrt-model", "cpu", 0, EngineConfig(**SMALL), threads=1))


def test_queue_limit_and_shutdown_finish_running(rng):
    c = EngineClient(spec(max_waiting=2, max_running=4))

    async def go():
        p = prompts_for(rng, (20,))[0]
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        a, b = c.add_request(p, params), c.add_request(p, params)
        with pytest.raises(QueueFull, match="2 requests waiting"):
            c.add_request(p, params)
        it = c.stream(a)
        first = await it.__anext__()  # a is running now
        assert not first.finished
        c.shutdown(grace_s=60)  # running requests finish within the grace period
        return [first] + [o async for o in it]
    outs = asyncio.run(go())
    assert outs[-1].finished and outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == 30
    assert sum((o.outputs[0].delta_token_ids for o in outs), []) == outs[-1].outputs[0].token_ids
    assert not c._proc.is_alive() and c._proc.exitcode == 0
    with pytest.raises(EngineStopped):
        asyncio.run(_collect(c, [[1, 2, 3]], SamplingParams(max_tokens=2)))


def test_a_dead_engine_process_fails_open_requests(rng):
    c = EngineClient(spec())

    async def go():
        rid = c.add_request(prompts_for(rng, (10,))[0], SamplingParams(temperature=0, max_tokens=80,
                                                                        ignore_eos=True))
        os.kill(c._proc.pid, signal.SIGKILL)
        return [o async for o in c.stream(rid)]
    outs = asyncio.run(go())
    assert outs[-1].finished and "engine process" in outs[-1].error
    assert c.step_error is not None
    c.shutdown(grace_s=1)
