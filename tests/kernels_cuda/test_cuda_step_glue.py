"""The decode step's per-step glue that replaced per-layer launches: every ring layer's window
indices built once per step (``context.step_window_indices``, one ``ops.window_indices`` call)
equal the per-layer ``window_indices`` on fresh random positions and ring starts, for a state whose
rings share one ring-start store and for one whose do not (a merged state), and a decode-sized
StepContext carries them for every ring."""
import pytest
import torch

from flashrt.graphs.config import shipped_config
from flashrt.graphs.context import STEP_ROWS, RopeCache, StepContext, StepNeeds, step_window_indices, window_indices
from flashrt.kv.state import KVState


def _positions(rng, B, S):
    start = torch.randint(0, 60, (B, 1), generator=rng)
    return start + torch.arange(S)


def _state(rng, B, S):
    state = KVState(shipped_config("tiny"), B, S + 70, "cpu")
    for start in state.ring_start.values():
        start.copy_(torch.randint(0, 70, (B,), generator=rng))
    return state


@pytest.mark.parametrize("B,S", [(1, 1), (3, 5), (5, 2)])
@pytest.mark.parametrize("merged", [False, True])
def test_step_indices_equal_the_per_layer_indices(rng, B, S, merged):
    state = _state(rng, B, S)
    if merged:  # as KVState.cat leaves it: each layer's ring start its own tensor, no shared store
        state.ring_start = {l: t.clone() for l, t in state.ring_start.items()}
        state._ring_start_store = None
    positions = _positions(rng, state.batch, S)
    W = state.cfg.window_size
    got = step_window_indices(positions, state, W)
    assert sorted(got) == sorted(state.ring_start)
    for layer, start in state.ring_start.items():
        want = window_indices(positions, start, W)
        assert got[layer].dtype == want.dtype == torch.int32
        assert torch.equal(got[layer], want)


@pytest.mark.parametrize("S,expect", [(1, True), (STEP_ROWS + 1, False)])
def test_a_decode_sized_context_carries_every_rings_indices(rng, S, expect):
    """``StepContext.build`` of ``tiny``: a chunk of at most ``STEP_ROWS`` rows holds the indices of
    every ring layer (the layers read them); a longer chunk leaves them to the layers."""
    cfg = shipped_config("tiny")
    state = KVState(cfg, 1, S + 8, "cpu")
    for start in state.ring_start.values():
        start.fill_(int(torch.randint(0, 3, (1,), generator=rng)))
    positions = torch.arange(S).view(1, S)
    ctx = StepContext.build(StepNeeds.of(cfg), RopeCache(cfg, "cpu"), state, positions, S)
    assert (ctx.window_index is not None) == expect
    if expect:
        for layer, start in state.ring_start.items():
            assert torch.equal(ctx.window_index[layer], window_indices(positions, start, cfg.window_size))
