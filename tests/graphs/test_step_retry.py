"""A forward call that fails part-way leaves the state as it was: the retry is bit-exact.

Failures are injected on the N-th ``ops.linear`` call of a step (every layer's projections, the
compressors, indexers, Engram, the draft seeding and the head) for decode steps, chunks from
position 0 and chunks from a position > 0. After the failure the same call is retried; its logits,
every byte of the state (window rings of every layer including the draft's, compressor partial
groups, main KV and index K entries, positions, Engram history) and the next greedy tokens must
equal those of a run that never failed (tiny config, CPU, reference ops).
"""
import copy

import pytest
import torch

from flashrt import ops
from flashrt.engine.step_capture import StepCapture

STRIDE = 4  # inject at every STRIDE-th linear call (random phase): each layer is hit at least once


class Injected(RuntimeError):
    pass


def fail_on_call(monkeypatch, n: int):
    """Make the ``n``-th ``ops.linear`` call from now raise :class:`Injected`."""
    real, calls = ops.linear, [0]

    def linear(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise Injected(f"linear call {n}")
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "linear", linear)


def linear_calls(fn) -> int:
    real, calls = ops.linear, [0]

    def linear(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    ops.linear = linear
    try:
        fn()
    finally:
        ops.linear = real
    return calls[0]


def state_bytes(state) -> dict:
    """Everything a state carries into the next step, as comparable tensors."""
    u8 = torch.uint8
    out = {"positions": state.positions, "host_positions": torch.tensor(state.host_positions),
           "history": state.engram_history}
    for l, ring in state.rings.items():
        out[f"ring{l}"], out[f"ring{l}.scale"] = ring.data.view(u8), ring.scale.view(u8)
        out[f"ring{l}.start"] = state.ring_start[l]
    for l, c in state.compressed.items():
        if c.kv_state is not None:
            out[f"partial{l}.kv"], out[f"partial{l}.score"] = c.kv_state, c.score_state
        for row, pos in enumerate(state.host_positions):
            n = pos // state.cfg.ratio(l)
            main, index = c.main.read_row(row, n), c.index_k.read_row(row, 0, n)
            out[f"main{l}.{row}"], out[f"main{l}.{row}.scale"] = main.data.view(u8), main.scale.view(u8)
            out[f"index{l}.{row}"], out[f"index{l}.{row}.scale"] = index.data.view(u8), index.scale.view(u8)
    return {k: v.clone() for k, v in out.items()}


def assert_same_state(got, want):
    a, b = state_bytes(got), state_bytes(want)
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"state differs in {bad}"


def check_retries(model, monkeypatch, rng, before, ids, step=None, greedy: int = 2):
    """For failures at every STRIDE-th linear call of ``step(state, ids)`` (default: Model.forward)
    on copies of ``before``: the retry's logits and state equal a run that never failed, and so do
    the next ``greedy`` decode steps after the last retry."""
    step = step or (lambda state, x: model.forward(x, state=state))
    clean = copy.deepcopy(before)
    calls = linear_calls(lambda: step(copy.deepcopy(before), ids))
    want = step(clean, ids).clone()
    first = int(torch.randint(1, STRIDE + 1, (1,), generator=rng))
    assert calls > 8 * STRIDE  # the tiny model: 8 layers, drafts, head
    for n in list(range(first, calls + 1, STRIDE)) + [calls]:
        state = copy.deepcopy(before)
        with monkeypatch.context() as m:
            fail_on_call(m, n)
            with pytest.raises(Injected):
                step(state, ids)
        got = step(state, ids)
        assert torch.equal(got, want), f"retry after a failure at linear call {n} of {calls}: other logits"
        assert_same_state(state, clean)
    for _ in range(greedy):
        tok = want.argmax(-1, keepdim=True)
        want = model.forward(tok, state=clean)
        assert torch.equal(model.forward(tok, state=state), want)
    assert_same_state(state, clean)


def prefilled(model, rng, batch: int, tokens: int):
    state = model.new_state(batch, 64)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, tokens), generator=rng)
    tok = model.forward(ids, state=state).argmax(-1, keepdim=True)
    return state, tok


def test_decode_step_retry_is_exact(model, rng, monkeypatch):
    """One token per row (rows at their own positions): the step rewrites what it wrote."""
    state, tok = prefilled(model, rng, 2, 21)  # past the window (8), a ratio-2 group half full
    check_retries(model, monkeypatch, rng, state, tok)


def test_static_decode_step_retry_is_exact(model, rng, monkeypatch):
    """The static-buffer step (engine/step_capture.py, eager on the CPU) after a failure."""
    state, tok = prefilled(model, rng, 2, 19)

    def step(s, x):
        return StepCapture(model, s, capture=False).step(x[:, 0])

    check_retries(model, monkeypatch, rng, state, tok, step=step, greedy=1)


@pytest.mark.parametrize("length", [5, 11])
def test_chunk_from_zero_retry_is_exact(model, rng, monkeypatch, length):
    """A prompt chunk at position 0, shorter and longer than the window."""
    state = model.new_state(2, 64)
    ids = torch.randint(0, model.cfg.vocab_size, (2, length), generator=rng)
    check_retries(model, monkeypatch, rng, state, ids, greedy=1)


@pytest.mark.parametrize("start, length", [(13, 6), (21, 11)])
def test_chunk_from_a_position_retry_is_exact(model, rng, monkeypatch, start, length):
    """A chunk continuing a sequence (odd start: a ratio-2 group pending): its tokens overwrite
    ring slots the chunk's first queries read and the pending group it completes."""
    state, _ = prefilled(model, rng, 2, start)
    ids = torch.randint(0, model.cfg.vocab_size, (2, length), generator=rng)
    check_retries(model, monkeypatch, rng, state, ids)


def test_one_token_steps_write_in_place_chunks_at_commit(model, rng):
    """What a captured decode step relies on: a one-token step's ring and partial-group writes land
    inside Model.run (a CUDA graph records them); a chunk's land only when the state advances."""
    rings = lambda s: torch.cat([r.data.view(torch.uint8).flatten() for r in s.rings.values()])
    partial = lambda s: torch.cat([c.kv_state.flatten() for c in s.compressed.values() if c.kv_state is not None])
    state, tok = prefilled(model, rng, 2, 13)
    for ids in (tok, torch.randint(0, model.cfg.vocab_size, (2, 5), generator=rng)):
        before_rings, before_partial = rings(state), partial(state)
        ctx = model.context(ids, state)
        model.run(ids, ctx)
        one = ids.shape[1] == 1
        assert torch.equal(rings(state), before_rings) != one
        assert torch.equal(partial(state), before_partial) != one
        state.advance(ids.shape[1], ctx.next_history)
        assert not torch.equal(rings(state), before_rings) and not torch.equal(partial(state), before_partial)
