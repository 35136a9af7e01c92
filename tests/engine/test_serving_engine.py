"""The serving engine on the tiny model (CPU): continuous batching with staggered arrivals gives every
request the tokens it gets alone (bit-identical), chunked prefill keeps decodes running, pages go
back to the pool on finish / abort / error, preemption (swap and recompute) changes no token,
prefix-cache hits change no token, n > 1, stops and lengths."""
import os

import pytest
import torch

from flashrt.engine import Engine, SamplingParams
from flashrt.engine.errors import PromptTooLong, RequestError
from flashrt.engine.scheduler import pages_at

GREEDY = SamplingParams(temperature=0, max_tokens=6)
SMALL = dict(prefill_chunk=16, max_step_tokens=24, max_running=8)


def prompts_for(rng, lengths):
    return [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths]


def run_staggered(engine, arrivals):
    """``arrivals``: step -> [(prompt, params)]; returns the final outputs in arrival order and the
    decode rows that ran in each step."""
    core, names, done, step = engine.step_loop, [], {}, 0
    while step <= max(arrivals) or core.has_work:
        for prompt, params in arrivals.get(step, []):
            req = core.add(f"r{len(names)}", prompt, params)
            req.sink = None
            names.append(req)
        for req in core.step():
            if req.finished:
                done[req.id] = [s.output for s in req.seqs]
        step += 1
    return [done[r.id] for r in names]


def test_alone_equals_staggered_mixed_batch(model, rng):
    prompts = prompts_for(rng, (40, 7, 23, 3, 12))
    engine = Engine(model, **SMALL)
    alone = [engine.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    # arrivals while others prefill (40 tokens: three chunks) and decode; rows join and leave
    arrivals = {0: [(prompts[0], GREEDY), (prompts[1], GREEDY)], 2: [(prompts[2], GREEDY)],
                3: [(prompts[3], GREEDY)], 7: [(prompts[4], GREEDY)]}
    mixed = run_staggered(Engine(model, **SMALL), arrivals)
    assert [m[0] for m in mixed] == alone


def test_long_prompt_never_stalls_running_decodes(model, rng):
    engine = Engine(model, prefill_chunk=8, max_step_tokens=10, max_running=4)
    core = engine.step_loop
    short = prompts_for(rng, (5, 6))
    for i, p in enumerate(short):
        core.add(f"s{i}", p, SamplingParams(temperature=0, max_tokens=12))
    core.step()  # both prompts fit one step's budget (5 + 6 > 10: the second waits one step)
    core.step()
    running = list(core.scheduler.running)
    assert len(running) == 2
    core.add("long", prompts_for(rng, (60,))[0], SamplingParams(temperature=0, max_tokens=2))
    long = core.requests["long"].seqs[0]
    steps = 0
    while long.computed < long.prompt_len:
        before = [len(s.output) for s in running]
        core.step()
        steps += 1
        assert [len(s.output) for s in running] == [b + 1 for b in before]  # every decode ran
        assert long.computed <= 8 * steps  # at most one chunk per step
    assert steps >= 60 // 8


def test_pages_return_on_finish_abort_and_error(model, rng, monkeypatch):
    engine = Engine(model, **SMALL)
    core, pool = engine.step_loop, engine.step_loop.pool
    prompts = prompts_for(rng, (20, 30, 9))
    for i, p in enumerate(prompts):
        core.add(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20))
    for _ in range(4):
        core.step()
    assert pool.pages_in_use > 0 and pool.index_pool.pages_in_use > 0
    core.abort("r1")
    original = core.model.forward

    def failing(ids, state=None, **kw):  # the next prefill or decode call fails, its pages reserved
        core.model.context(ids, state)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(core.model, "forward", failing)
    touched = core.step()
    monkeypatch.setattr(core.model, "forward", original)
    assert all(r.error and "injected failure" in r.error for r in touched)
    while core.has_work:
        core.step()
    assert pool.pages_in_use == 0 and pool.index_pool.pages_in_use == 0
    assert engine.stats()["kv_pages_device"] == 0


@pytest.fixture(scope="module")
def unconstrained(model):
    """Prompts and their greedy outputs with pages to spare (shared by the preemption tests)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    prompts = prompts_for(torch.Generator().manual_seed(seed), (30, 20, 26, 35))
    params = SamplingParams(temperature=0, max_tokens=12)
    return prompts, params, [o.outputs[0].token_ids for o in Engine(model, **SMALL).generate(prompts, params)]


@pytest.mark.parametrize("swap_bytes", [1 << 30, 0], ids=["swap", "recompute"])
def test_preemption_changes_no_token(model, unconstrained, swap_bytes):
    prompts, params, free = unconstrained
    one = max(pages_at(model.cfg, 8, len(p) + 12) for p in prompts)  # 8 entries a page: many pages
    pad = 3 * pages_at(model.cfg, 8, 1)
    tight = Engine(model, **SMALL, max_kv_pages=2 * one + pad, swap_bytes=swap_bytes, kv_page_entries=8)
    got = tight.generate(prompts, params)  # room for about two of the four at a time
    stats = tight.stats()
    assert stats["preemptions"] > 0
    assert stats["swaps" if swap_bytes else "recomputes"] > 0
    assert [o.outputs[0].token_ids for o in got] == free
    assert tight.step_loop.pool.pages_in_use == 0 and stats["swap_bytes"] == 0


def test_prefix_hits_change_no_token(model, rng):
    base = prompts_for(rng, (40,))[0]
    a, b = base + [1, 2, 3], base[:35] + [9, 9]  # b shares two 16-token chunks with a
    engine = Engine(model, **SMALL)
    cold = [Engine(model, **SMALL, prefix_cache_bytes=0).generate(p, GREEDY)[0].outputs[0].token_ids for p in (a, b)]
    first = engine.generate(a, GREEDY)[0]
    second = engine.generate(b, GREEDY)[0]
    again = engine.generate(a, GREEDY)[0]
    assert first.prefix_hit_tokens == 0 and second.prefix_hit_tokens == 32 and again.prefix_hit_tokens == 32
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == cold
    assert again.outputs[0].token_ids == cold[0]
    s = engine.stats()
    assert (s["prefix_hits"], s["prefix_queries"], s["prefix_hit_tokens"]) == (2, 3, 64)


def test_n_seeds_logprobs_and_stops(model, rng):
    engine = Engine(model, **SMALL)
    p = prompts_for(rng, (18,))[0]
    sampled = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=5, logprobs=2)
    x = engine.generate(p, sampled)[0]
    y = Engine(model, **SMALL).generate([prompts_for(rng, (9,))[0], p], sampled)[1]  # other company
    assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
    assert len(x.outputs) == 3 and all(len(c.token_ids) == 5 and len(c.logprobs) == 5 for c in x.outputs)
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for c in x.outputs for lp in c.logprobs)
    greedy = engine.generate(p, SamplingParams(n=2, temperature=0, max_tokens=5))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    ref = greedy.outputs[0].token_ids
    stop_id = engine.generate(p, SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[ref[2]]))[0].outputs[0]
    first = ref.index(ref[2])  # the stop id may occur earlier: generation stops at its first occurrence
    assert stop_id.token_ids == ref[:first + 1] and stop_id.finish_reason == "stop" and stop_id.stop_reason == ref[2]
    text = engine.tokenizer.decode(ref)
    cut = text[1:3] if len(text) >= 3 else None
    if cut and "\ufffd" not in cut:
        out = engine.generate(p, SamplingParams(temperature=0, max_tokens=5, stop=[cut]))[0].outputs[0]
        assert out.finish_reason == "stop" and out.text == text[:text.find(cut)]
    length = engine.generate(p, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert length.finish_reason == "length" and length.token_ids == ref


def test_request_errors_name_the_parameter(model):
    import flashrt

    assert flashrt.Engine is Engine and flashrt.SamplingParams is SamplingParams  # the package root names them
    engine = Engine(model, **SMALL, max_model_len=64)
    with pytest.raises(PromptTooLong, match=r"prompt: 60 prompt tokens \+ max_tokens 10 = 70 exceed the model's context of 64"):
        engine.generate([1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match=r"prompt: expected token ids in \[0, 320\), got 400"):
        engine.generate([[1, 400]], SamplingParams())
    with pytest.raises(RequestError, match="stop_token_ids"):
        engine.generate("hi", SamplingParams(stop_token_ids=[999]))
    small = Engine(model, **SMALL, max_kv_pages=2)
    with pytest.raises(PromptTooLong, match=r"need \d+ KV pages \(\+ 3 for the padding rows of a decode batch\), the engine holds at most 2"):
        small.generate([1] * 200, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="max_step_tokens: expected at least prefill_chunk"):
        Engine(model, prefill_chunk=32, max_step_tokens=16)


def test_generate_while_the_loop_thread_runs(model, rng):
    p = prompts_for(rng, (11,))[0]
    want = Engine(model, **SMALL).generate(p, GREEDY)[0].outputs[0].token_ids
    engine = Engine(model, **SMALL)
    engine.start()
    try:
        got = engine.generate([p, p], GREEDY)
        assert [o.outputs[0].token_ids for o in got] == [want, want]
    finally:
        engine.shutdown(grace_s=5)
    assert engine._thread is None and not engine.step_loop.has_work
    with pytest.raises(Exception, match="shutting down"):
        engine.add_request(p, GREEDY)


def test_a_stream_behind_the_engine_gets_merged_outputs(model, rng):
    """A consumer slower than the engine gets fewer outputs than tokens; their deltas still add up
    to exactly the final token ids, text and logprobs, each covered once."""
    import asyncio
    import time

    p = prompts_for(rng, (int(torch.randint(5, 14, (1,), generator=rng)),))[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    engine = Engine(model, **SMALL)
    engine.start()

    async def consume():
        rid = engine.add_request(p, params)
        got = []
        async for out in engine.stream(rid):
            got.append(out)
            end = time.monotonic() + 60
            while engine.step_loop.has_work and time.monotonic() < end:  # the loop blocked: outputs queue up
                time.sleep(0.01)
        return got

    try:
        got = asyncio.run(consume())
    finally:
        engine.shutdown(grace_s=5)
    final = got[-1].outputs[0]
    assert got[-1].finished and len(final.token_ids) == 12
    assert len(got) == 2  # the first, then everything that queued up behind it as one
    assert sum((o.outputs[0].delta_token_ids for o in got), []) == final.token_ids
    assert "".join(o.outputs[0].delta_text for o in got) == final.text
    assert [lp.token for o in got for lp in o.outputs[0].delta_logprobs] == final.token_ids


def test_loop_profile_written_on_stop_and_never_over_a_file(model, rng, tmp_path, monkeypatch):
    import pstats

    path = tmp_path / "loop.prof"
    monkeypatch.setenv("FLASHRT_PROFILE_ENGINE", str(path))
    p = prompts_for(rng, (7,))[0]
    engine = Engine(model, **SMALL)
    engine.start()
    try:
        engine.generate(p, GREEDY)
    finally:
        engine.shutdown(grace_s=5)
    names = {fn for _, _, fn in pstats.Stats(str(path)).stats}
    assert "step" in names  # the loop thread's steps were profiled
    with pytest.raises(ValueError, match="FLASHRT_PROFILE_ENGINE.*exists"):
        Engine(model, **SMALL).start()
    monkeypatch.setenv("FLASHRT_PROFILE_ENGINE", str(tmp_path / "no" / "x.prof"))
    with pytest.raises(ValueError, match="existing folder"):
        Engine(model, **SMALL).start()
