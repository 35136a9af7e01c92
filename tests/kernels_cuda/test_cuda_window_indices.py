"""``window_indices`` (kernels_cuda/kv_store.py): every ring layer's window indices in one launch,
against the reference and a per-position loop, on fresh random positions and ring starts (odd
batches, chunk lengths, windows and layer counts; rings that start at 0, mid-window and past the
chunk; rows before their first full window and far past it); the plain-torch switch gives the same."""
import pytest
import torch

import flashrt
from flashrt import ops
from kernel_check import DEVICE, launches, pinned_tiles, requires_kernels  # noqa: F401 (launches: a fixture)
from test_window_indices import loop

pytestmark = requires_kernels


def _case(rng, B, S, W, L):
    start = torch.randint(0, 3 * W, (B, 1), generator=rng)
    start[0] = 70000  # far past the window
    ring_start = torch.randint(0, 3 * W + S, (L, B), generator=rng)
    ring_start[0] = 0
    return (start + torch.arange(S)).to(DEVICE), ring_start.to(DEVICE)


@pytest.mark.parametrize("B,S,W,L", [(1, 1, 8, 9), (3, 5, 7, 4), (5, 2, 13, 1), (2, 9, 4, 6), (4, 1, 128, 43)])
def test_kernel_matches_the_reference_and_the_loop(rng, launches, B, S, W, L):
    positions, ring_start = _case(rng, B, S, W, L)
    with flashrt.use_backend("cuda"):
        got = ops.window_indices(positions, ring_start, W)
    assert launches == ["_window_indices_kernel"]
    with flashrt.use_backend("reference"):
        want = ops.window_indices(positions, ring_start, W)
    assert got.dtype == torch.int32 and got.shape == (L, B, S, W)
    assert torch.equal(got.cpu(), want.cpu())
    for l in range(L):
        assert torch.equal(got[l].cpu(), loop(positions.cpu(), ring_start[l].cpu(), W))


def test_plain_torch_switch_gives_the_same(rng, launches):
    positions, ring_start = _case(rng, 3, 2, 8, 5)
    with flashrt.use_backend("cuda"):
        got = ops.window_indices(positions, ring_start, 8)
        with pinned_tiles(kv_store={"window_indices": {"in_kernel": False}}):
            plain = ops.window_indices(positions, ring_start, 8)
    assert launches == ["_window_indices_kernel"]
    assert torch.equal(got, plain)
