"""``ops.window_indices`` (reference backend) and the graphs' per-layer ``window_indices`` against a
per-position loop of the definition on fresh random positions and ring starts: the W most recent
positions of each query, in the chunk, in the ring (at or after the layer's ring start) or -1;
and its argument checks."""
import pytest
import torch

import flashrt
from flashrt import ops
from flashrt.graphs.attention import window_indices
from kernel_check import assert_error


def loop(positions, ring_start, W):
    """int32 [B, S, W] of one layer, position by position."""
    B, S = positions.shape
    out = torch.full((B, S, W), -1, dtype=torch.int32)
    for b in range(B):
        start = int(positions[b, 0])
        for s in range(S):
            for w in range(W):
                p = int(positions[b, s]) - w
                if p >= start:
                    out[b, s, w] = W + p - start
                elif p >= 0 and p >= int(ring_start[b]):
                    out[b, s, w] = p % W
    return out


@pytest.mark.parametrize("S,W", [(1, 8), (5, 8), (12, 4), (3, 16), (2, 1)])
def test_window_indices_match_the_definition(rng, S, W):
    B = 4
    start = torch.randint(0, 40, (B, 1), generator=rng)
    positions = start + torch.arange(S)
    starts = [torch.zeros(B, dtype=torch.long), torch.randint(0, 45, (B,), generator=rng),
              (start[:, 0] - W).clamp_min(0), start[:, 0] + 3]
    with flashrt.use_backend("reference"):
        every = ops.window_indices(positions, torch.stack(starts), W)
        assert every.dtype == torch.int32 and every.shape == (len(starts), B, S, W)
        for l, ring_start in enumerate(starts):
            want = loop(positions, ring_start, W)
            assert torch.equal(every[l], want)
            assert torch.equal(window_indices(positions, ring_start, W), want)


def test_no_layers_give_an_empty_result(rng):
    positions = torch.randint(0, 9, (3, 1), generator=rng)
    with flashrt.use_backend("reference"):
        assert ops.window_indices(positions, torch.zeros(0, 3, dtype=torch.long), 8).shape == (0, 3, 1, 8)


def test_window_indices_check_their_arguments(rng):
    positions = torch.randint(0, 9, (2, 3), generator=rng)
    starts = torch.zeros(4, 2, dtype=torch.long)
    assert_error(lambda: ops.window_indices(positions.int(), starts, 8), "positions", "int64")
    assert_error(lambda: ops.window_indices(positions, starts[:, :1], 8), "ring_start", "B=2")
    assert_error(lambda: ops.window_indices(positions, starts.int(), 8), "ring_start", "int64")
    assert_error(lambda: ops.window_indices(positions, starts, 0), "window", "[1,")
    assert_error(lambda: ops.window_indices(positions - 10, starts, 8), "positions", "[0,")
