"""The engine process's outputs on the pipe (engine/wire.py): a real engine on the tiny model (CPU)
runs random requests (stop strings, n > 1, logprobs, max_tokens cuts, an abort) through the engine
process's own sinks and channel; every output the server side rebuilds from the pickled slim
messages equals the one the engine made, step by step, and a step's message is smaller by at least
its prompts' share."""
import pickle
import random
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from flashrt.engine import Engine, SamplingParams
from flashrt.engine.core_process import Channel, PipeSink
from flashrt.engine.request import RequestOutput
from flashrt.engine.run import load_model
from flashrt.engine.wire import Accumulator, is_last, slim

SMALL = dict(prefill_chunk=16, max_step_tokens=48, max_running=8, max_model_len=96)
STOPS = ["\ufffd", "\ufffd\ufffd", " a", "o", "e "]  # frequent in the tiny model's random text


class Conn:
    """The engine's end of a pipe: each message kept as the bytes a multiprocessing pipe sends."""

    def __init__(self):
        self.sent: list[bytes] = []

    def send(self, msg) -> None:
        self.sent.append(bytes(ForkingPickler.dumps(msg)))


class Recording(PipeSink):
    """The engine process's sink, also keeping the whole outputs it was handed."""

    @staticmethod
    def deliver_batch(items) -> bool:
        items[0][0].channel.whole.append([(sink.request_id, out) for sink, out in items])
        return PipeSink.deliver_batch(items)


def random_params(rnd: random.Random) -> SamplingParams:
    stop = rnd.sample(STOPS, rnd.randint(1, 2)) if rnd.random() < 0.6 else ()
    return SamplingParams(n=rnd.choice([1, 1, 2, 3]), temperature=rnd.choice([0, 0.8, 1.0]), seed=rnd.randrange(1 << 30),
                          max_tokens=rnd.randint(2, 16), logprobs=rnd.choice([None, 0, 2]), stop=stop,
                          include_stop_str_in_output=rnd.random() < 0.3, ignore_eos=rnd.random() < 0.5)


def serve(engine, prompts, params):
    """Requests through the engine process's sinks and channel, ``r0`` aborted while it runs: the
    whole outputs of each step and the messages sent."""
    conn = Conn()
    channel = Channel(conn)
    channel.whole = []
    engine._apply([("add", (rid, p, params[rid], Recording(rid, channel))) for rid, p in prompts.items()])
    steps = 0
    while engine.step_loop.has_work:
        engine._deliver(engine.step_loop.step())
        steps += 1
        if steps == 4:
            engine._apply([("abort", "r0")])
    return channel.whole, conn.sent


@pytest.fixture(scope="module")
def served():
    """A run of random requests: (prompts by id, the whole outputs of each step, the messages sent).
    ``r1`` is greedy; a first run finds its text, the second stops it at a piece of that text."""
    seed = random.randrange(1 << 30)
    print(f"wire seed={seed}")
    rnd, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    engine = Engine(load_model("tiny", torch.device("cpu"), 0, quiet=True), **SMALL)
    prompts = {f"r{i}": torch.randint(0, 256, (rnd.randint(3, 40),), generator=gen).tolist() for i in range(7)}
    params = {rid: random_params(rnd) for rid in prompts}
    params["r0"] = SamplingParams(n=2, temperature=1.0, max_tokens=40, ignore_eos=True, logprobs=1, seed=seed)
    params["r1"] = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first, _ = serve(engine, prompts, params)
    text = [out for step in first for rid, out in step if rid == "r1"][-1].outputs[0].text
    k = rnd.randrange(0, max(1, len(text) - 1))
    params["r1"] = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[text[k:k + 2]],
                                  include_stop_str_in_output=rnd.random() < 0.5)
    whole, sent = serve(engine, prompts, params)
    return prompts, whole, sent


def test_rebuilt_outputs_equal_the_engines(served):
    prompts, whole, sent = served
    assert len(whole) == len(sent)
    sofar = {rid: Accumulator(list(p)) for rid, p in prompts.items()}
    kept, seen = {}, set()
    for want, raw in zip(whole, sent):
        kind, items, records, stats = pickle.loads(raw)
        assert kind == "out" and [rid for rid, _ in items] == [rid for rid, _ in want]
        for (rid, out), (_, w) in zip(want, items):
            assert isinstance(w, RequestOutput) == out.finished  # slim exactly while running
            got = sofar[rid].take(w)
            assert got == out
            for c in got.outputs:  # a new list each time: a consumer may keep the last one
                assert kept.get((rid, c.index)) is not c.token_ids
                kept[rid, c.index] = c.token_ids
                seen.add((c.finish_reason, type(c.stop_reason).__name__, c.logprobs is not None, len(got.outputs) > 1))
            if is_last(w):
                del sofar[rid]
    assert not sofar  # every request ended, its accumulator with it
    reasons = {s[:2] for s in seen}
    assert ("abort", "NoneType") in reasons and ("length", "NoneType") in reasons
    assert any(s[2] for s in seen) and any(s[3] for s in seen)  # logprobs asked for; n > 1
    assert ("stop", "str") in reasons, reasons  # a stop string cut some output


def test_a_steps_message_is_smaller_by_the_prompts_share(served):
    prompts, whole, sent = served
    compared = 0
    for want, raw in zip(whole, sent):
        running = [out for _, out in want if not out.finished]
        if not running:
            continue
        share = len(pickle.dumps([out.prompt_token_ids for out in running], 5)) - len(pickle.dumps([], 5))
        full = len(ForkingPickler.dumps(("out", want, [], None)))
        assert full - len(raw) >= share > 0
        compared += 1
    assert compared >= 3


def test_slim_leaves_finished_and_error_outputs_whole(served):
    _, whole, _ = served
    last = [out for step in whole for _, out in step if out.finished]
    assert last and all(slim(out) is out for out in last)
    err = RequestOutput("x", [1, 2], [], True, "ValueError: bad")
    assert slim(err) is err and Accumulator([1, 2]).take(err) is err and is_last(err)
