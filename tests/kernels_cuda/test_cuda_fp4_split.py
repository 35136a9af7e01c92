"""The split E2M1 decode (``tiles.linear.fp4_decode: split``, ``linear_kernel._w_halves``): each K
block of an ``fp4_w`` weight as two dot operands, the even and the odd K positions, decoded
elementwise from the loaded bytes. ``linear`` and ``moe_experts`` (routed fp4 experts, with an fp8
shared expert in the same launches) against the bit decode (the same exact products, summed in
another order) and the reference; K blocks cut by the end of K included."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import DEVICE, GPU, pinned_tiles, rel_err, requires_kernels

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")

SPLIT = dict(fp4_decode="split")


def _both(op, *args, **kw):
    """(split decode, bit decode) of ``op`` on the cuda backend, then the reference's."""
    with flashrt.use_backend("cuda"):
        with pinned_tiles(linear=SPLIT):
            got = op(*args, **kw)
        with pinned_tiles():
            bits = op(*args, **kw)
    with flashrt.use_backend("reference"):
        want = op(*args, **kw)
    return got, bits, want


def test_split_is_the_kernels_decode_mode():
    with pinned_tiles(linear=SPLIT):
        assert lin.fp4_decode() == 3
        assert lin._linear_plan(16, 64, 64, torch.bfloat16, "fp4_w")["constexprs"]["E2M1"] == 3


@pytest.mark.parametrize("m", [16, 40])
def test_linear_split(rng, m):
    n, k = 96, 160  # K blocks of 128: the second cut at 32
    x = torch.randn(m, k, generator=rng).to(DEVICE, torch.bfloat16)
    w = formats.quantize(torch.randn(n, k, generator=rng) * 0.05, "fp4_w").to(DEVICE)
    got, bits, want = _both(ops.linear, x, w)
    assert rel_err(got, bits) < 1e-6 and rel_err(got, want) < 1e-3


def _experts_args(rng, n, E, k, D, I):
    x = torch.randn(n, D, generator=rng).to(DEVICE, torch.bfloat16)
    idx = torch.rand(n, E, generator=rng).topk(k).indices.to(DEVICE, torch.int32)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    ws = [formats.quantize(torch.randn(*s, generator=rng) * 0.05, "fp4_w").to(DEVICE)
          for s in ((E, I, D), (E, I, D), (E, D, I))]
    shared = tuple(formats.quantize(torch.randn(1, *s, generator=rng) * 0.05, "fp8_w").to(DEVICE)
                   for s in ((I, D), (I, D), (D, I)))
    return (x, rw, idx, *ws, 10.0), shared


@pytest.mark.parametrize("n", [3, 20])
def test_experts_split(rng, n):
    args, shared = _experts_args(rng, n, E=8, k=2, D=96, I=64)
    got, bits, want = _both(ops.moe_experts, *args, shared=shared)
    assert rel_err(got, bits) < 1e-6 and rel_err(got, want) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 8, 64])
def test_experts_split_gpu(rng, n):
    args, shared = _experts_args(rng, n, E=64, k=6, D=1024, I=512)
    got, bits, want = _both(ops.moe_experts, *args, shared=shared)
    assert rel_err(got, bits) < 1e-6 and rel_err(got, want) < 2e-3
