"""The swapped MMA operands (``tiles.linear.swap_operands``): tiles of 64 rows and more multiply the
dequantized weights by the activations (``w @ x.T``) and transpose the tile after the K loop
(``linear_kernel._mma``). The products are the same; only the order of the fp32 sums inside an MMA
may differ, so results match the unswapped loop to fp32 rounding and the reference within its
tolerance: ``linear`` on fp4 and dequantized fp8 weights, ``moe_experts`` (routed fp4 experts with an
fp4 or fp8 shared expert, split K, ragged K and rows, activations quantized in the kernels or handed
over dequantized), on fresh random inputs; tiles under 64 rows do not swap."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import (DEVICE, GPU, assert_same_sums, gemm_outputs, pinned_tiles, random_experts,  # noqa: F401
                          rel_err, requires_kernels)

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
SM90 = GPU and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.parametrize("decode", ["bits", "dot_scaled", "packed", "packed_prefetch"])
def test_the_constexpr_adds_the_swap_where_the_loop_dequantizes(decode):
    with pinned_tiles(linear=dict(fp4_decode=decode)):
        plain, plain8 = lin.fp4_decode(), lin.fp8_decode(False)
    with pinned_tiles(linear=dict(fp4_decode=decode, swap_operands=True)):
        swapped = lin.fp4_decode()
        assert lin._linear_plan(64, 64, 64, torch.bfloat16, "fp4_w")["constexprs"]["E2M1"] == swapped
        assert lin.fp8_decode(False) == plain8 + lin.SWAP_AB  # fp8 weights the loop dequantizes
        assert lin.fp8_decode(True) == 0  # the fp8 MMA on raw E4M3 multiplies no decoded weights
    assert swapped == plain + (0 if decode == "dot_scaled" else lin.SWAP_AB)
    assert swapped % 8 == plain % 8 and lin.may_fold(swapped) == lin.may_fold(plain)  # the other bits unchanged


# rows, K (ragged: K % 64 != 0 in some), split K, the shared expert's format, moe tiles beyond the rule
CASES = [(70, 96, None, "fp8_w", dict(pair_tiles=64)),
         (64, 160, 2, "fp4_w", dict(pair_tiles=0)),
         (90, 224, None, "fp4_w", dict(act_dequantized=True)),
         (65, 128, 3, "fp8_w", dict(act_dequantized=True, pair_tiles=0))]


@pytest.mark.parametrize("m,k,split,shared_fmt,moe_tiles", CASES)
def test_the_swapped_operands_give_the_same_sums(rng, m, k, split, shared_fmt, moe_tiles):
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    w4 = formats.quantize(torch.randn(72, k, generator=rng) * 0.25, "fp4_w").to(DEVICE)
    w8 = formats.quantize(torch.randn(96, k, generator=rng) * 0.25, "fp8_w").to(DEVICE)
    routed = random_experts(rng, m, k, 4, 2, 64, shared_fmt)
    tile = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    # fp8_mma off: the fp8 weights are dequantized in the loop, as the swap needs
    out = {swap: gemm_outputs("cuda", x, [w4, w8], routed,
                              linear=dict(fp4_decode="packed_prefetch", swap_operands=swap, linear=[[None, tile]],
                                          split_k=split, fp8_mma=False, fused_max_rows=128),
                              moe=dict(moe_tiles, fused_max_tokens=128,
                                       experts=[[None, dict(tile, split_k=split or 1)]]))
           for swap in (False, True)}
    assert_same_sums(out[True], out[False], gemm_outputs("reference", x, [w4, w8], routed))


def test_a_16_row_tile_does_not_swap(rng):
    """Tiles under 64 rows (mma.sync on a GPU, both operands in registers) keep their operands:
    the same bits with the tile on as with it off."""
    m, k = 20, 128
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    w = formats.quantize(torch.randn(64, k, generator=rng) * 0.25, "fp4_w").to(DEVICE)
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    out = []
    for swap in (False, True):
        with flashrt.use_backend("cuda"), pinned_tiles(linear=dict(swap_operands=swap, linear=[[None, tile]],
                                                                   fused_max_rows=0)):
            out.append(ops.linear(x, w))
    assert torch.equal(out[0], out[1])


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("n", [64, 512])
def test_experts_swapped_gpu(rng, n):
    """At the profile's tiles with the packed decode: routed fp4 experts and an fp8 shared expert in
    the same launches, against the unswapped loop and the reference."""
    E, top, D, I = 64, 6, 1024, 512
    x = torch.randn(n, D, generator=rng).to(DEVICE, torch.bfloat16)
    rw, idx, experts, shared = random_experts(rng, n, D, E, top, I, "fp8_w")
    args = (x, rw, idx, *experts, 10.0)
    out = {}
    for swap in (False, True):
        with flashrt.use_backend("cuda"), pinned_tiles(linear=dict(swap_operands=swap)):
            out[swap] = ops.moe_experts(*args, shared=shared)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, shared=shared)
    assert rel_err(out[True], out[False]) < 1e-5 and rel_err(out[True], want) < 2e-3


def test_an_experts_rule_swaps_on_its_own_knob(rng):
    """An experts rule's ``swap_operands`` knob decides for the launches it serves, over linear's
    tile either way; the rule beside it without the knob follows the tile. A rule swapped by its
    knob gives the same bits as the tile swapping every launch, and the reference's sums."""
    moe = pytest.importorskip("flashrt.kernels_cuda.moe")
    n, D, E, top, I = 96, 128, 4, 2, 64  # 48 rows an expert: the second rule
    tile = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    x = (torch.randn(n, D, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    rw, idx, experts, shared = random_experts(rng, n, D, E, top, I, "fp8_w")
    args = (x, rw, idx, *experts, 10.0)
    out = {}
    for swap_tile, knob in ((False, True), (True, None), (True, False)):
        rules = [[16, dict(tile, BLOCK_M=16)], [None, dict(tile, swap_operands=knob)]]
        tiles = dict(linear=dict(fp4_decode="packed_prefetch", swap_operands=swap_tile, fp8_mma=False),
                     moe=dict(experts=rules, pair_tiles=0, fused_max_tokens=128))
        with flashrt.use_backend("cuda"), pinned_tiles(**tiles):
            swapped = knob if knob is not None else swap_tile
            assert bool(moe._plan(n, top, E, D, I)["e2m1"] & lin.SWAP_AB) == swapped
            # 4 tokens: 2 rows an expert, the first rule
            assert bool(moe._plan(4, top, E, D, I)["e2m1"] & lin.SWAP_AB) == swap_tile
            out[swapped, knob] = ops.moe_experts(*args, shared=shared)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, shared=shared)
    assert torch.equal(out[True, True], out[True, None])
    assert rel_err(out[True, True], out[False, False]) < 1e-5 and rel_err(out[True, True], want) < 1e-2
