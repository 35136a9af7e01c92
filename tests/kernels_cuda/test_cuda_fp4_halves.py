"""The fp4 halves K order (``tiles.linear.fp4_halves``): within each 8 K positions the MMA loop takes
the four low nibbles' values, then the four high ones, and permutes the activation tile to match
(``linear_kernel._halves``). The sum over K is the same; only the order of the fp32 sums inside an
MMA differs, so results match the natural order to fp32 rounding and the reference within its
tolerance: ``linear`` and ``moe_experts`` (routed fp4 experts with an fp4 or fp8 shared expert,
pair tiles and routing tables, split K, ragged K, activations quantized in the kernels or handed
over dequantized), on fresh random inputs; the 64-row tiles keep the natural order."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import (DEVICE, GPU, assert_same_sums, gemm_outputs, launches, pinned_tiles,  # noqa: F401
                          random_experts, rel_err, requires_kernels)

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
SM90 = GPU and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.parametrize("decode", ["bits", "dot_scaled", "packed", "packed_prefetch"])
def test_the_constexpr_adds_halves_except_to_dot_scaled(decode):
    with pinned_tiles(linear=dict(fp4_decode=decode)):
        plain = lin.fp4_decode()
    with pinned_tiles(linear=dict(fp4_decode=decode, fp4_halves=True)):
        halves = lin.fp4_decode()
        assert lin._linear_plan(1, 64, 64, torch.bfloat16, "fp4_w")["constexprs"]["E2M1"] == halves
        assert lin._linear_plan(1, 64, 64, torch.bfloat16, "fp8_w")["constexprs"]["E2M1"] == 0
    assert halves == plain + (0 if decode == "dot_scaled" else lin.HALVES)
    assert halves % 8 == plain % 8 and lin.may_fold(halves) == lin.may_fold(plain)  # the other bits unchanged


# rows, K (ragged: K % 64 != 0 in some), split K, the shared expert's format, moe tiles beyond the rule
CASES = [(1, 96, None, "fp8_w", dict(pair_tiles=64)),
         (8, 160, 2, "fp4_w", dict(pair_tiles=0)),
         (13, 224, None, "fp4_w", dict(act_dequantized=True)),
         (5, 128, 3, "fp8_w", dict(act_dequantized=True, pair_tiles=0))]


@pytest.mark.parametrize("m,k,split,shared_fmt,moe_tiles", CASES)
def test_the_halves_order_gives_the_natural_orders_sums(rng, m, k, split, shared_fmt, moe_tiles):
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    w = formats.quantize(torch.randn(72, k, generator=rng) * 0.25, "fp4_w").to(DEVICE)
    routed = random_experts(rng, m, k, 4, 2, 64, shared_fmt)
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    out = {halves: gemm_outputs("cuda", x, [w], routed,
                                linear=dict(fp4_decode="packed_prefetch", fp4_halves=halves, linear=[[None, tile]],
                                            split_k=split),
                                moe=dict(moe_tiles, experts=[[None, dict(tile, split_k=split or 1)]]))
           for halves in (False, True)}
    assert_same_sums(out[True], out[False], gemm_outputs("reference", x, [w], routed))


def test_a_64_row_tile_keeps_the_natural_order(rng):
    """The 64-row tiles (the warpgroup MMA on a GPU) decode in the natural order with the tile on:
    the same bits as with it off."""
    m, k = 70, 128
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    w = formats.quantize(torch.randn(64, k, generator=rng) * 0.25, "fp4_w").to(DEVICE)
    tile = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    out = []
    for halves in (False, True):
        with flashrt.use_backend("cuda"), pinned_tiles(linear=dict(fp4_halves=halves, linear=[[None, tile]],
                                                                   fused_max_rows=0)):
            out.append(ops.linear(x, w))
    assert torch.equal(out[0], out[1])


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("n", [1, 8, 64])
def test_experts_halves_gpu(rng, n):
    """At the profile's tiles with the packed decode: routed fp4 experts and an fp8 shared expert in
    the same launches, against the natural order and the reference."""
    E, top, D, I = 64, 6, 1024, 512
    x = torch.randn(n, D, generator=rng).to(DEVICE, torch.bfloat16)
    rw, idx, experts, shared = random_experts(rng, n, D, E, top, I, "fp8_w")
    args = (x, rw, idx, *experts, 10.0)
    out = {}
    for halves in (False, True):
        with flashrt.use_backend("cuda"), pinned_tiles(linear=dict(fp4_decode="packed_prefetch", fp4_halves=halves)):
            out[halves] = ops.moe_experts(*args, shared=shared)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, shared=shared)
    assert rel_err(out[True], out[False]) < 1e-5 and rel_err(out[True], want) < 2e-3
