"""The decode step's per-step glue that replaced per-layer launches: every layer's window indices
built once per step (``context.step_window_indices``) equal the per-layer ``window_indices`` on
fresh random positions and ring starts (odd batches, chunk lengths and windows; rings that start
mid-window, at 0 and past the chunk), and a decode-sized StepContext carries them for every ring."""
import pytest
import torch

from flashrt.graphs.context import STEP_ROWS, step_window_indices, window_indices, window_parts


def _positions(rng, B, S):
    start = torch.randint(0, 60, (B, 1), generator=rng)
    return start + torch.arange(S)


@pytest.mark.parametrize("B,S,W,L", [(1, 1, 8, 3), (3, 5, 7, 4), (5, 2, 13, 1), (2, 9, 4, 6)])
def test_step_indices_equal_the_per_layer_indices(rng, B, S, W, L):
    positions = _positions(rng, B, S)
    ring_start = {l: torch.randint(0, 70, (B,), generator=rng) for l in range(0, 2 * L, 2)}  # sparse layer ids
    ring_start[0][0] = 0
    parts = window_parts(positions, W)
    got = step_window_indices(parts, ring_start)
    assert sorted(got) == sorted(ring_start)
    for layer, start in ring_start.items():
        want = window_indices(positions, start, W)
        assert got[layer].dtype == want.dtype == torch.int32
        assert torch.equal(got[layer], want)
        assert torch.equal(want, window_indices(positions, start, W, parts))


def test_no_rings_give_no_indices(rng):
    assert step_window_indices(window_parts(_positions(rng, 2, 3), 5), {}) == {}


@pytest.mark.parametrize("S,expect", [(1, True), (STEP_ROWS + 1, False)])
def test_a_decode_sized_context_carries_every_rings_indices(rng, S, expect):
    """``StepContext.build`` of ``tiny``: a chunk of at most ``STEP_ROWS`` rows holds the indices of
    every ring layer (the layers read them); a longer chunk leaves them to the layers."""
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.context import RopeCache, StepContext, StepNeeds
    from flashrt.kv.state import KVState

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


def test_step_indices_cost_the_same_launches_for_any_layer_count(rng):
    """The torch operations of ``step_window_indices`` do not grow with the layers (a per-layer
    mask was two a layer): counted at dispatch, views and allocations aside."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in ("view", "select", "unsqueeze", "empty", "_unsafe_view", "detach", "alias"):
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    parts = window_parts(_positions(rng, 2, 1), 8)
    counts = []
    for L in (1, 5, 23):
        ring_start = {l: torch.randint(0, 9, (2,), generator=rng) for l in range(L)}
        with Count() as c:
            step_window_indices(parts, ring_start)
        counts.append(len(c.ops))
    assert counts[0] == counts[1] == counts[2] <= 4, counts
