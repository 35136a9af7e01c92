"""Overlapped steps (``EngineConfig.overlap``, engine/step_loop.py): a step's drawn tokens are read by
the host in the next step, after that step's decode was launched from them on the device. The
outputs must be exactly those of the engine that reads every step's tokens at once, on fresh
random workloads (greedy and seeded draws, penalties, logprobs, stop ids and strings, min_tokens,
n > 1, staggered arrivals, aborts, a page limit that preempts); the decode steps must really run
ahead of the host; a sequence that ends by length costs no extra step, one that ends on a token
costs one row of one step."""
import pytest
import torch

from flashrt.engine import Engine, SamplingParams
from flashrt.engine import sampling as sampling_mod
from flashrt.engine import slots as slots_mod

SMALL = dict(prefill_chunk=16, max_step_tokens=40, max_running=8)


def _params(rng, i: int) -> SamplingParams:
    """A mix over ``i``: greedy, seeded draws with filters, penalties, logprobs, min_tokens, n = 2."""
    r = lambda: float(torch.rand((), generator=rng))  # noqa: E731
    n_tok = int(torch.randint(3, 14, (), generator=rng))
    kinds = [dict(temperature=0),
             dict(temperature=0.5 + r(), top_p=0.5 + r() / 2, top_k=int(torch.randint(0, 40, (), generator=rng)),
                  seed=int(torch.randint(0, 1 << 30, (), generator=rng))),
             dict(temperature=0, repetition_penalty=1 + r(), frequency_penalty=r(), presence_penalty=r()),
             dict(temperature=0.8, seed=i, logprobs=int(torch.randint(0, 4, (), generator=rng))),
             dict(temperature=0, min_tokens=n_tok // 2, stop_token_ids=[int(torch.randint(0, 256, (), generator=rng))]),
             dict(temperature=1.0, seed=i + 7, n=2)]
    return SamplingParams(max_tokens=n_tok, **kinds[i % len(kinds)])


def _workload(rng, count: int) -> dict:
    """step -> [(prompt, params)]: staggered arrivals of random prompts."""
    arrivals: dict = {}
    for i in range(count):
        step = int(torch.randint(0, 12, (), generator=rng))
        prompt = torch.randint(0, 256, (int(torch.randint(2, 40, (), generator=rng)),), generator=rng).tolist()
        arrivals.setdefault(step, []).append((prompt, _params(rng, i)))
    return arrivals


def _run(model, arrivals: dict, aborts: dict | None = None, counters: dict | None = None, **kw) -> dict:
    """Final outputs by request id (token ids, text, finish reason, logprobs per sequence); ``aborts``:
    step -> request ids aborted before it; ``counters``: filled with the engine's. The page pool is
    empty at the end."""
    engine = Engine(model, **SMALL, **kw)
    core, done, step, n = engine.step_loop, {}, 0, 0
    while step <= max(arrivals) or core.has_work:
        for rid in (aborts or {}).get(step, []):
            core.abort(rid)
        for prompt, params in arrivals.get(step, []):
            core.add(f"r{n}", prompt, params).sink = None
            n += 1
        for req in core.step():
            if req.finished:
                done[req.id] = [(s.output, s.text, s.finish_reason,
                                 None if s.logprobs is None else [(t.token, round(t.logprob, 5)) for t in s.logprobs])
                                for s in req.seqs]
        step += 1
    assert core.pool.pages_in_use == 0
    if counters is not None:
        counters.update(core.counters)
    return done


@pytest.mark.parametrize("pages", [None, "tight"])
def test_overlapped_steps_give_the_outputs_of_plain_steps(model, rng, pages):
    arrivals = _workload(rng, 12)
    kw = {}
    if pages == "tight":  # room for a few sequences: preemptions (swaps, and recomputes past swap_bytes)
        kw = dict(max_kv_pages=8, swap_bytes=1 << 14)
        # four sequences admitted first (the earliest arrivals) at 2 pages each fill the 8; each needs
        # a third past position 64 (no early end on the end-of-sequence token)
        burst = [torch.randint(0, 256, (60,), generator=rng).tolist() for _ in range(4)]
        arrivals[0] = [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in burst] + \
            arrivals.get(0, [])
    plain, counters = _run(model, arrivals, overlap=False, **kw), {}
    assert _run(model, arrivals, counters=counters, overlap=True, **kw) == plain
    assert (counters["preemptions"] > 0) == (pages == "tight")


def test_stop_strings_and_aborts(model, rng):
    """Stop strings cut from each request's own text; two requests aborted mid-way: every other
    request's output is unchanged, the aborted ones end as aborted."""
    arrivals = _workload(rng, 8)
    plain = _run(model, arrivals, overlap=False)
    n, with_stop = 0, {}
    for step in sorted(arrivals):
        reqs = []
        for prompt, params in arrivals[step]:
            text = plain[f"r{n}"][0][1]
            if len(text) >= 4 and params.n == 1:  # a stop string from the middle of its own text
                i = int(torch.randint(1, len(text) - 2, (), generator=rng))
                params = SamplingParams(**{**params.__dict__, "stop": (text[i:i + 2],)})
            reqs.append((prompt, params))
            n += 1
        with_stop[step] = reqs
    aborts = {3: ["r1"], 6: ["r4"]}
    want = _run(model, with_stop, aborts, overlap=False)
    got = _run(model, with_stop, aborts, overlap=True)
    for rid in want:
        if rid in ("r1", "r4"):
            continue
        assert got[rid] == want[rid], rid


def _count_launches(monkeypatch) -> dict:
    """Counts decode launches, and those made while drawn tokens were still unread by the host."""
    seen = {"launches": 0, "ahead": 0, "unread": 0}
    step, result = slots_mod.DecodeSlots.step, sampling_mod.SampleJob.result
    jobs = []

    def counting_step(self, tokens, drawn=None):
        seen["launches"] += 1
        seen["ahead"] += any(j._result is None for j in jobs)
        return step(self, tokens, drawn)

    def made(init):
        def wrapped(self, *a, **k):
            init(self, *a, **k)
            jobs.append(self)
        return wrapped

    monkeypatch.setattr(slots_mod.DecodeSlots, "step", counting_step)
    monkeypatch.setattr(sampling_mod.SampleJob, "__init__", made(sampling_mod.SampleJob.__init__))
    monkeypatch.setattr(sampling_mod.SampleJob, "result", result)
    return seen


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_runs_ahead_of_the_host_and_ending_by_length_costs_nothing(model, rng, monkeypatch, overlap):
    seen = _count_launches(monkeypatch)
    n = int(torch.randint(4, 12, (), generator=rng))
    prompt = torch.randint(0, 256, (9,), generator=rng).tolist()
    out = Engine(model, overlap=overlap, **SMALL).generate(prompt, SamplingParams(temperature=0, max_tokens=n))
    assert len(out[0].outputs[0].token_ids) == n
    assert seen["launches"] == n - 1  # the first token comes from the prefill; none wasted at the end
    assert seen["ahead"] == (n - 1 if overlap else 0)  # every decode launched before its input was read


def test_ending_on_a_token_costs_one_row_of_one_step(model, rng, monkeypatch):
    prompt = torch.randint(0, 256, (9,), generator=rng).tolist()
    free = Engine(model, **SMALL).generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    k = int(torch.randint(2, 10, (), generator=rng))
    stop = free.token_ids[k]
    k = free.token_ids.index(stop)  # its first occurrence ends the request
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    counts = {}
    for overlap in (False, True):
        seen = _count_launches(monkeypatch)
        out = Engine(model, overlap=overlap, **SMALL).generate(prompt, params)[0].outputs[0]
        assert out.token_ids == free.token_ids[:k + 1] and out.finish_reason == "stop"
        counts[overlap] = seen["launches"]
        monkeypatch.undo()
    assert counts[False] == k and counts[True] == k + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_steps_overlapped_give_the_outputs_of_plain_steps(rng):
    """On CUDA (decode steps replayed from graphs, tokens read through pinned copies): the same."""
    from test_verify_capture import _cuda_model

    model = _cuda_model()
    arrivals = _workload(rng, 12)
    assert _run(model, arrivals, overlap=True) == _run(model, arrivals, overlap=False)
