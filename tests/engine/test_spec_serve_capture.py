"""The serving engine's speculative rounds through the static-buffer steps (engine/spec_serve.py).

Two engines serve the same staggered requests in lockstep: one eager (``cuda_graphs=False``), one
through the static draft / verify steps (``cuda_graphs=True``; on the CPU the fake recorder of
test_spec_generate_capture replays by re-running the body into the recorded outputs) and
StepCapture for plain steps. Requests join and finish at different steps, so the decode batch
moves between buckets (4 and 8 rows) and carries padding rows; a deterministic oracle draft makes
acceptance ragged; a sampled and a penalized request ride along. After every step the requests'
tokens and every real row's state (positions, rings, compressor, compressed entries, Engram
history) are identical. ``-m gpu``: the real CUDA-graph replays against the uncaptured static
steps (bit for bit) and against the eager engine (greedy tokens, near-ties allowed).
"""
import random

import pytest
import torch

from flashrt.engine import Engine, SamplingParams
from flashrt.engine import slots as slots_mod
from flashrt.engine.step_capture import StepCapture

from test_spec_generate_capture import TensorRecorder
from test_verify_capture import _cuda_model

SMALL = dict(prefill_chunk=16, max_step_tokens=40, max_running=8)


class LockstepOracle:
    """Replaces ``Drafts.draft`` for every engine in ``engines``: proposes the continuation in
    ``reference`` (prompt -> tokens) of each decode row, a position corrupted where a hash of
    (prompt, position, j) says so: the same drafts however often it is called. Its host-side
    choices cannot live in a CUDA graph: on CUDA it reads a value back first, so the draft step's
    first run meets a host sync and DraftCapture keeps it eager."""

    def __init__(self, model, engines, reference, corrupt=0.35):
        self.real, self.engines, self.reference, self.corrupt = model.drafts.draft, engines, reference, corrupt
        self.V = model.cfg.vocab_size

    def __call__(self, next_ids, state, temperature=0.0, generator=None):
        if next_ids.device.type == "cuda":
            int(next_ids[0])  # a host sync: never recorded into a graph with stale choices
        out, logits, confidence = self.real(next_ids, state, temperature, generator)
        out = out.clone()
        engine = next(e for e in self.engines if e.step_loop.slots.state is state)
        for row, seq in enumerate(engine.step_loop.slots.owner):
            if seq is None:
                continue
            prompt = tuple(seq.request.prompt)
            ref, t = self.reference.get(prompt, []), seq.computed - seq.prompt_len
            for j in range(1, out.shape[1]):
                r = random.Random(hash((prompt, t, j)))
                want = ref[t + j] if t + j < len(ref) else r.randrange(self.V)
                out[row, j] = (want + 1 + r.randrange(self.V - 1)) % self.V if r.random() < self.corrupt else want
        return out, logits, confidence


def workload(rng, V):
    """step -> [(prompt, params)]: up to seven requests at once (a decode batch of 8 rows, then
    4 as they finish), of different lengths and budgets."""
    p = lambda n: torch.randint(0, V, (n,), generator=rng).tolist()
    g = lambda m: SamplingParams(temperature=0, max_tokens=m)
    return {0: [(p(14), g(16)), (p(5), g(4)), (p(7), g(18))],
            1: [(p(9), SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=14)), (p(11), g(15)),
                (p(17), SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.2))],
            2: [(p(6), g(14))],
            6: [(p(8), g(6))]}


def reference_outputs(model, arrivals) -> dict:
    """prompt -> plain (non-speculative) served output: what the oracle proposes."""
    engine = Engine(model, cuda_graphs=False, **SMALL)
    reqs = [engine.step_loop.add(f"r{i}", pr, pa) for i, (pr, pa) in
            enumerate(x for step in sorted(arrivals) for x in arrivals[step])]
    while engine.step_loop.has_work:
        engine.step_loop.step()
    return {tuple(r.prompt): r.seqs[0].output for r in reqs}


def same_rows(model, a, b) -> None:
    """The decode batches of engines ``a`` and ``b`` hold the same requests in the same rows, and
    every real row's state is identical."""
    sa, sb = a.step_loop.slots, b.step_loop.slots
    assert [o and o.request.id for o in sa.owner] == [o and o.request.id for o in sb.owner]
    if sa.state is None:
        return
    x, y = sa.state, sb.state
    u8 = torch.uint8
    for row, seq in enumerate(sa.owner):
        if seq is None:
            continue
        pos = x.host_positions[row]
        assert pos == y.host_positions[row] == int(x.positions[row]) == int(y.positions[row])
        assert torch.equal(x.engram_history[row], y.engram_history[row])
        for l in x.rings:
            for t in ("data", "scale"):
                assert torch.equal(getattr(x.rings[l], t).view(u8)[row], getattr(y.rings[l], t).view(u8)[row]), l
        for l in model.cfg.kv_source_layers:
            ca, cb, n = x.compressed[l], y.compressed[l], pos // model.cfg.ratio(l)
            if ca.kv_state is not None:
                assert torch.equal(ca.kv_state[row], cb.kv_state[row])
                assert torch.equal(ca.score_state[row], cb.score_state[row])
            assert torch.equal(ca.index_k.read_row(row, 0, n).data.view(u8), cb.index_k.read_row(row, 0, n).data.view(u8))
            assert torch.equal(ca.main.read_row(row, n).data.view(u8), cb.main.read_row(row, n).data.view(u8))


def lockstep(model, arrivals, a, b, before_step=None) -> list:
    """Serve ``arrivals`` on engines ``a`` and ``b`` one step at a time, comparing after each step;
    returns the finished requests of ``b``."""
    reqs, step = [], 0
    while step <= max(arrivals) or a.step_loop.has_work or b.step_loop.has_work:
        for i, (prompt, params) in enumerate(arrivals.get(step, [])):
            rid = f"s{step}-{i}"
            reqs.append((a.step_loop.add(rid, prompt, params), b.step_loop.add(rid, prompt, params)))
        for which, engine in enumerate((a, b)):
            if before_step is not None:
                before_step(which)
            engine.step_loop.step()
        for ra, rb in reqs:
            assert ra.seqs[0].output == rb.seqs[0].output, ra.id
            assert ra.finished == rb.finished and ra.error is None and rb.error is None
        same_rows(model, a, b)
        step += 1
    assert a.step_loop.pool.pages_in_use == b.step_loop.pool.pages_in_use == 0
    return [rb for _, rb in reqs]


@pytest.mark.parametrize("draft_tokens", ["auto", 3])
def test_static_serving_rounds_equal_eager(model, rng, monkeypatch, draft_tokens):
    arrivals = workload(rng, model.cfg.vocab_size)
    reference = reference_outputs(model, arrivals)
    eager = Engine(model, speculative="dspark", draft_tokens=draft_tokens, cuda_graphs=False, **SMALL)
    static = Engine(model, speculative="dspark", draft_tokens=draft_tokens, cuda_graphs=True, **SMALL)
    recorder = TensorRecorder()
    static.step_loop.spec.record = recorder
    monkeypatch.setattr(model.drafts, "draft", LockstepOracle(model, (eager, static), reference))
    done = lockstep(model, arrivals, eager, static)
    assert all(r.finished for r in done)
    spec = static.step_loop.spec
    assert set(spec.runners) == {4, 8}  # both buckets drafted and verified through their own runners
    st = spec.capture_stats()
    assert recorder.recorded == st["captured"] > 0 and recorder.replayed == st["replayed"] > 0
    assert st["fallback"] == 0 and eager.step_loop.spec.runners == {}
    s = spec.stats
    assert 0 < s.accepted < s.drafted and s.as_dict()["k_counts"] == eager.step_loop.spec.stats.as_dict()["k_counts"]
    plain_steps = sum(sc.stats["eager"] for _, sc in static.step_loop.slots.cache.values())
    assert plain_steps > 0  # plain steps (k = 0, or no row could speculate) ran the static one-token step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_serving_replays_equal_static_steps(rng, monkeypatch):
    """CUDA graphs (the default on CUDA) against the same static steps uncaptured, in lockstep with
    the oracle draft (kept eager: ragged acceptance through captured verify steps): tokens and real
    rows' states identical. Then, with the real draft captured too, against the eager engine: the
    same greedy tokens (a near-tie of the target's logits may part them)."""
    from spec_helpers import assert_same_greedy

    model = _cuda_model()
    arrivals = workload(rng, model.cfg.vocab_size)
    reference = reference_outputs(model, arrivals)
    graphs = Engine(model, speculative="dspark", draft_tokens="auto", **SMALL)
    static = Engine(model, speculative="dspark", draft_tokens="auto", cuda_graphs=True, **SMALL)
    static.step_loop.spec.capture = False
    capture = {"on": True}
    monkeypatch.setattr(slots_mod, "StepCapture", lambda m, s: StepCapture(m, s, capture=capture["on"]))
    monkeypatch.setattr(model.drafts, "draft", LockstepOracle(model, (graphs, static), reference))
    lockstep(model, arrivals, graphs, static, lambda which: capture.update(on=which == 0))
    st = graphs.step_loop.spec.capture_stats()
    assert st["replayed"] > 0 and st["captured"] > 0, st
    assert graphs.step_loop.spec.stats.accepted > 0
    monkeypatch.undo()

    greedy = {s: [(p, SamplingParams(temperature=0, max_tokens=8)) for p, _ in reqs] for s, reqs in arrivals.items()}
    outs = []
    for kw in ({"cuda_graphs": False}, {}):
        engine = Engine(model, speculative="dspark", **kw, **SMALL)
        reqs = [engine.step_loop.add(f"r{i}", p, pa) for i, (p, pa) in
                enumerate(x for s in sorted(greedy) for x in greedy[s])]
        while engine.step_loop.has_work:
            engine.step_loop.step()
        outs.append([r.seqs[0].output for r in reqs])
    draft = sum(r.drafter.stats["replayed"] for r in engine.step_loop.spec.runners.values())
    assert draft > 0 and engine.step_loop.spec.capture_stats()["eager"] == 0
    prompts = [p for s in sorted(greedy) for p, _ in greedy[s]]
    assert_same_greedy(model, prompts, outs[0], outs[1])
