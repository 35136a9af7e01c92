"""``tiles.attention.dequant.packed_fp4_b16``: the sparse and prefix attention kernels decode the main
KV's fp4_b16 rows in packed registers on sm_90 (``codecs.dequant_rows``). The rows hold the same
values, so the outputs are the code-by-code decode's bit for bit on an sm_90 GPU (where the packed
path is taken; under the interpreter the knob reaches the kernels but not that path), and both stay
within the attention tests' tolerance of the reference backend; the launch plans carry the knob."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import DEVICE, GPU, pinned_tiles, rel_err, requires_kernels

pytestmark = requires_kernels
attention = pytest.importorskip("flashrt.kernels_cuda.attention")
pa = pytest.importorskip("flashrt.kernels_cuda.prefix_attention")
SM90 = GPU and torch.cuda.get_device_capability() >= (9, 0)
PACKED = dict(attention=dict(dequant=dict(packed_fp4_b16=True)))


def _kv(g, B, W, S, T, D):
    q = lambda kind, n: formats.quantize(torch.randn(B, n, D, generator=g), kind).to(DEVICE)
    return q("fp8", W), q("fp8", S), q("fp4_b16", T)


def _sparse(g, B, S, H, D, W, T, K):
    kv = _kv(g, B, W, S, T, D)
    idx = torch.randint(0, W + S + T, (B, S, K), generator=g, dtype=torch.int32)
    idx[torch.rand(B, S, K, generator=g) < 0.2] = -1
    q = torch.randn(B, S, H, D, generator=g).to(DEVICE, torch.bfloat16)
    return q, kv, idx.to(DEVICE), torch.randn(H, generator=g).to(DEVICE), D ** -0.5


def _prefix(g, B, S, H, D, W, T):
    kv = _kv(g, B, W, S, T, D)
    positions = (torch.tensor([0, 3 * W + 1][:B]).view(-1, 1) + torch.arange(S)).to(DEVICE)
    ring = torch.zeros(B, dtype=torch.int64, device=DEVICE)
    ent = (W + S + torch.stack([torch.randperm(T, generator=g) for _ in range(B)])).to(DEVICE, torch.int32)
    vis = torch.randint(0, T + 1, (B, S), generator=g, dtype=torch.int32).to(DEVICE)
    q = torch.randn(B, S, H, D, generator=g).to(DEVICE, torch.bfloat16)
    return q, kv, positions, ring, W, ent, vis, torch.randn(H, generator=g).to(DEVICE), D ** -0.5


def _both(call, args):
    """(the kernels' output without the knob, with it), each checked against the reference backend."""
    out = []
    for tiles in ({}, PACKED):
        with flashrt.use_backend("cuda"), pinned_tiles(**tiles):
            assert attention.packed_rows() == bool(tiles)
            out.append(call(*args))
    with flashrt.use_backend("reference"):
        want = call(*args).float().cpu()
    for got in out:
        assert rel_err(got.float().cpu(), want) < 2e-2
    return out


@pytest.mark.parametrize("B,S,H,D,W,T,K", [(2, 3, 16, 64, 8, 40, 24), (1, 1, 32, 128, 16, 64, 48)])
def test_packed_rows_give_the_same_outputs(rng, B, S, H, D, W, T, K):
    plain, packed = _both(ops.sparse_attention, _sparse(rng, B, S, H, D, W, T, K))
    assert torch.equal(plain, packed)
    plain, packed = _both(ops.prefix_attention, _prefix(rng, 2, 9, 16, D, W, T))
    assert torch.equal(plain, packed)


def test_the_plans_carry_the_knob(rng):
    q = torch.zeros(1, 4, 16, 64, dtype=torch.bfloat16)
    for tiles, want in (({}, False), (PACKED, True)):
        with pinned_tiles(**tiles):
            assert attention._launch_plan(q, 40, (1, 1, 2), True)["constexprs"]["PACKED"] is want
            assert pa._plan(q, (1, 1, 2), True, True)["constexprs"]["PACKED"] is want


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("B,S,T", [(1, 1, 4096), (64, 1, 1024), (1, 512, 2048)])
def test_packed_rows_gpu(rng, B, S, T):
    """The released shapes (64 heads x 512, a ring of 128, 640 indices) and `small`'s prefix chunk."""
    plain, packed = _both(ops.sparse_attention, _sparse(rng, B, S, 64, 512, 128, T, 640))
    assert torch.equal(plain, packed)
    plain, packed = _both(ops.prefix_attention, _prefix(rng, 2, 512, 16, 512, 128, 512))
    assert torch.equal(plain, packed)
