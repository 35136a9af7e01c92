"""graphs.attention.window_indices against a per-position loop of its definition: the W most recent
positions of each query, in the chunk, in the ring (at or after the layer's ring start) or -1;
the per-call parts shared by the layers give the same indices as computing them per layer."""
import pytest
import torch

from flashrt.graphs.attention import window_indices, window_parts


def _loop(positions, ring_start, W):
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


@pytest.mark.parametrize("S,W", [(1, 8), (5, 8), (12, 4), (3, 16)])
def test_window_indices_match_the_definition(rng, S, W):
    B = 4
    start = torch.randint(0, 40, (B, 1), generator=rng)
    positions = start + torch.arange(S)
    for ring_start in (torch.zeros(B, dtype=torch.long), torch.randint(-10, 45, (B,), generator=rng),
                       start[:, 0] - W, start[:, 0] + 3):
        want = _loop(positions, ring_start, W)
        got = window_indices(positions, ring_start, W)
        shared = window_indices(positions, ring_start, W, window_parts(positions, W))
        assert got.dtype == torch.int32 and torch.equal(got, want) and torch.equal(shared, want)
