"""The engine in a process of its own (engine/client.py, engine/core_process.py) on the tiny model
(CPU): greedy outputs equal the in-process engine's, streamed deltas add up, bad input is refused
in the server process with the engine's own errors, metrics records arrive, the queue limit holds,
shutdown lets running requests finish, and a dead engine process fails every open request."""
import asyncio
import os
import signal

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


def test_greedy_equals_the_in_process_engine(client, rng):
    model = load_model("tiny", torch.device("cpu"), 0, quiet=True)  # what the engine process loads
    prompts = prompts_for(rng, torch.randint(3, 30, (5,), generator=rng).tolist())
    params = SamplingParams(temperature=0, max_tokens=int(torch.randint(3, 12, (1,), generator=rng)), logprobs=1)
    want = Engine(model, **SMALL).generate(prompts, params)
    got = asyncio.run(_collect(client, prompts, params))
    for w, outs in zip(want, got):
        last = outs[-1].outputs[0]
        assert outs[-1].finished and last.token_ids == w.outputs[0].token_ids
        assert sum((o.outputs[0].delta_token_ids for o in outs), []) == last.token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == last.text == w.outputs[0].text
    assert client.step_error is None and client.stats()["finished"] >= len(prompts)


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
