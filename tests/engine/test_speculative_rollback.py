"""Rollback after a verify step leaves no trace of the rejected tokens.

A verify step runs ``k + 1`` tokens per row and keeps the first ``counts[b]``. Compared exactly
(every byte: window rings of every layer including the draft's, compressor pending groups, main
KV and index K up to each row's position, positions, Engram history, pages held):
- against the same step whose rejected tokens were other random ids (ragged counts, rows at their
  own positions, ring wrap-around and half-full ratio-2 groups);
- against a plain chunk forward of only the kept tokens (equal counts, >= 2: the same chunk path);
and the decode steps and verify steps that follow give bit-identical logits.
"""
import copy

import pytest
import torch
from test_step_retry import assert_same_state

from flashrt.engine import speculative as spec


def random_ids(rng, model, batch, n):
    return torch.randint(0, model.cfg.vocab_size, (batch, n), generator=rng)


def ragged_state(model, rng, batch=3):
    """Rows prefilled together, then one verify step with ragged counts: rows at their own positions."""
    state = model.new_state(batch, 64)
    model.forward(random_ids(rng, model, batch, int(torch.randint(9, 20, (1,), generator=rng))), state=state)
    ids = random_ids(rng, model, batch, 4)
    spec.verify(model, state, ids)
    spec.keep(model, state, ids, torch.randint(1, 5, (batch,), generator=rng))
    return state


def pages(state):
    return [state.row_pages(r) for r in range(state.batch)], state.pool.pages_in_use, state.index_pool.pages_in_use


def continue_run(model, state, rng_seed):
    """Two decode steps and one verify step (drafted ids from a fixed seed): their logits."""
    g = torch.Generator().manual_seed(rng_seed)
    out = []
    for _ in range(2):
        out.append(model.forward(random_ids(g, model, state.batch, 1), state=state))
    ids = random_ids(g, model, state.batch, 3)
    logits, _ = spec.verify(model, state, ids)
    spec.keep(model, state, ids, torch.tensor([1, 3, 2][:state.batch]))
    out.append(logits)
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rejected_tokens_leave_no_trace(model, rng, k):
    before = ragged_state(model, rng)
    B = before.batch
    ids = random_ids(rng, model, B, k + 1)
    counts = torch.randint(1, k + 2, (B,), generator=rng)
    other = ids.clone()
    rejected = torch.arange(k + 1).unsqueeze(0) >= counts.unsqueeze(1)
    other[rejected] = (ids[rejected] + 1 + random_ids(rng, model, 1, int(rejected.sum()))[0] % 300) % model.cfg.vocab_size
    a, b = copy.deepcopy(before), copy.deepcopy(before)
    la, _ = spec.verify(model, a, ids)
    lb, _ = spec.verify(model, b, other)
    spec.keep(model, a, ids, counts)
    spec.keep(model, b, other, counts)
    for row, c in enumerate(counts.tolist()):  # the kept positions saw the same inputs
        assert torch.equal(la[row, :c], lb[row, :c])
    assert a.host_positions == [p + c for p, c in zip(before.host_positions, counts.tolist())]
    assert_same_state(a, b)
    assert pages(a) == pages(b)
    for x, y in zip(continue_run(model, a, 7), continue_run(model, b, 7)):
        assert torch.equal(x, y)
    assert_same_state(a, b)


@pytest.mark.parametrize("start, k, kept", [(13, 3, 2), (14, 3, 3), (21, 2, 2), (6, 3, 4)])
def test_rollback_equals_running_only_the_kept_tokens(model, rng, start, k, kept):
    """Rows at one position: verify ``k + 1`` tokens, keep ``kept`` == a chunk of those ``kept``."""
    before = model.new_state(2, 64)
    model.forward(random_ids(rng, model, 2, start), state=before)
    ids = random_ids(rng, model, 2, k + 1)
    a, ref = copy.deepcopy(before), copy.deepcopy(before)
    logits, _ = spec.verify(model, a, ids)
    spec.keep(model, a, ids, torch.full((2,), kept))
    want = model.forward(ids[:, :kept], state=ref, all_positions=True)
    assert torch.equal(logits[:, :kept], want)
    assert_same_state(a, ref)
    assert pages(a) == pages(ref)
    for x, y in zip(continue_run(model, a, 3), continue_run(model, ref, 3)):
        assert torch.equal(x, y)


def test_pages_past_the_kept_tokens_go_back(model, rng):
    """With 2-entry pages, a verify step that crosses a page boundary and is rolled back returns
    the page: the state holds exactly the pages of a run that never drafted."""
    from flashrt.kv.state import KVState

    state = KVState(model.cfg, 2, 64, model.device, page_entries=2, window_fmt=model.window_fmt)
    model.forward(random_ids(rng, model, 2, 11), state=state)
    used = pages(state)
    ids = random_ids(rng, model, 2, 4)
    spec.verify(model, state, ids)
    assert pages(state) != used  # the step reserved pages for its 4 tokens
    spec.keep(model, state, ids, torch.tensor([1, 1]))
    ref = KVState(model.cfg, 2, 64, model.device, page_entries=2, window_fmt=model.window_fmt)
    g = random_ids(rng, model, 2, 11)
    model.forward(g, state=ref)
    model.forward(g[:, :1], state=ref)
    assert pages(state) == pages(ref)
