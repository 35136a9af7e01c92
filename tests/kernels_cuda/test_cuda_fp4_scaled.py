"""``fp4_w`` weights through ``tl.dot_scaled`` (``tiles.linear.fp4_decode: dot_scaled``): Triton
decodes the packed E2M1 bytes and UE8M0 scales in the MMA loop in place of the kernels' own decode.
The same values reach the same fp32 accumulation, so ``linear`` and ``moe_experts`` match the
reference and the kernels' own decode on fresh random inputs: ragged K and column edges, split K,
routing tables and pair tiles, the shared expert (fp8_w beside fp4_w routed experts, or fp4_w)."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import (DEVICE, GPU, assert_counters_zero, moe_reference_by_expert, pinned_tiles, rel_err,
                          requires_kernels)

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
moe = pytest.importorskip("flashrt.kernels_cuda.moe")

ON = dict(fp4_decode="dot_scaled")


def _weight(rng, fmt, *shape):
    return formats.quantize(torch.randn(*shape, generator=rng) * 0.25, fmt).to(DEVICE)


def _cuda(op, *args, **kw):
    with flashrt.use_backend("cuda"):
        return getattr(ops, op)(*args, **kw)


def _reference(op, *args, **kw):
    with flashrt.use_backend("reference"):
        return getattr(ops, op)(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,split", [(3, 72, 320, None), (20, 40, 96, 2), (1, 64, 160, 3)])
def test_linear_fp4(rng, dtype, m, n, k, split):
    """Column tiles past N, K blocks past K (K = 96, 160 in 64-wide blocks), split K."""
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE, dtype)
    w = _weight(rng, "fp4_w", n, k)
    rules = [[None, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)]]
    with pinned_tiles(linear=dict(ON, linear=rules, split_k=split)):
        assert lin._linear_plan(m, n, k, dtype, "fp4_w")["constexprs"]["E2M1"] == 1
        got = _cuda("linear", x, w)
        assert_counters_zero(got)
    with pinned_tiles(linear=dict(linear=rules, split_k=split)):
        own = _cuda("linear", x, w)
    want = _reference("linear", x, w)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert got.dtype == dtype and rel_err(got, want) < tol and rel_err(got, own) < tol


def test_fp8_weights_ignore_the_switch(rng):
    with pinned_tiles(linear=ON):
        assert lin._linear_plan(4, 64, 64, torch.bfloat16, "fp8_w")["constexprs"]["E2M1"] == 0


@pytest.mark.parametrize("n,pair_tiles", [(1, 1), (6, 0)])
@pytest.mark.parametrize("shared_fmt", [None, "fp8_w", "fp4_w"])
def test_experts_fp4(rng, n, pair_tiles, shared_fmt):
    E, k, D, I = 5, 2, 96, 64
    x = (torch.randn(n, D, generator=rng) * 3.0).to(DEVICE, torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(n)]).to(DEVICE, torch.int32)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    ws = [_weight(rng, "fp4_w", *s) for s in ((E, I, D), (E, I, D), (E, D, I))]
    shared = None if shared_fmt is None else tuple(_weight(rng, shared_fmt, *s)
                                                   for s in ((1, I, D), (1, I, D), (1, D, I)))
    args = (x, rw, idx, *ws, 10.0)
    rules = dict(experts=[[None, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2, split_k=2)]],
                 pair_tiles=pair_tiles)
    with pinned_tiles(linear=ON, moe=rules):
        got = _cuda("moe_experts", *args, shared=shared)
        assert_counters_zero(got)
    with pinned_tiles(moe=rules):
        own = _cuda("moe_experts", *args, shared=shared)
    want = _reference("moe_experts", *args, shared=shared)
    assert rel_err(got, want) < 2e-3 and rel_err(got, own) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("n", [1, 8, 64])
def test_experts_fp4_released_shape_gpu(rng, n):
    """384 experts, top-6, D = 5120, I = 2304 (random bytes: every E2M1 code), the default tiles with
    the switch on and off, against the reference expert by expert."""
    E, k, D, I = 384, 6, 5120, 2304
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(2**31, (1,), generator=rng)))

    def fp4(*shape):
        data = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), dtype=torch.uint8, device="cuda", generator=gen)
        scale = torch.randint(119, 123, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8, device="cuda", generator=gen)
        return formats.QTensor(data, scale.view(torch.float8_e8m0fnu), "fp4_w", shape)

    x = torch.randn(n, D, generator=rng).to(DEVICE, torch.bfloat16)
    idx = torch.rand(n, E, generator=rng).topk(k).indices.to(DEVICE, torch.int32)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    ws = [fp4(E, I, D), fp4(E, I, D), fp4(E, D, I)]
    args = (x, rw, idx, *ws, 10.0)
    with pinned_tiles(linear=ON):
        got = _cuda("moe_experts", *args)
    with pinned_tiles():
        own = _cuda("moe_experts", *args)
    assert rel_err(got, own) < 2e-3 and rel_err(got, moe_reference_by_expert(*args)) < 2e-3
