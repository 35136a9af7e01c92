"""``tiles.moe.act_dequantized``: the experts' activations handed to the MMA loops as the values of
their fp8 round trip (x by one launch, h by the up kernel's epilogue) instead of fp8 bytes each
program quantizes or decodes. The values are those the fp8 path computes in every program, so with
fp4 weights (no raw-E4M3 MMA on either path) the output is the same bits; fp8 weights then take
the dequantizing MMA (checked against the reference). On fresh random inputs, every row-tile
path (pairs, tables, direct, split K), bf16 and fp32 activations, in-kernel and separate x
quantization."""
import pytest
import torch

import flashrt
from flashrt import ops
from flashrt.kernels_cuda.round_trip import fp8_round_trip
from kernel_check import (DEVICE, assert_counters_zero, launches, pinned_tiles, rel_err,  # noqa: F401
                          requires_kernels)  # (launches: a fixture)
from test_cuda_moe_shared import SPLIT, _weights  # the split-K decode tile, random expert stacks

pytestmark = requires_kernels
moe = pytest.importorskip("flashrt.kernels_cuda.moe")

ON = dict(act_dequantized=True)


def _cuda(*args, **kw):
    with flashrt.use_backend("cuda"):
        return ops.moe_experts(*args, **kw)


def _args(rng, xdt, n, D, I, E, k, fmt="fp4_w"):
    x = (torch.randn(n, D, generator=rng) * 3.0).to(DEVICE, xdt)
    idx = torch.randint(0, E, (n, k), generator=rng, dtype=torch.int32).to(DEVICE)
    return (x, torch.rand(n, k, generator=rng).to(DEVICE), idx, *_weights(rng, fmt, E, I, D), 10.0)


# (name, x dtype, tokens, D, I, experts, slots, moe tiles besides act_dequantized)
CASES = [("pairs", torch.bfloat16, 1, 96, 64, 8, 2, dict(pair_tiles=16)),
         ("tables-in-kernel-quantize", torch.bfloat16, 7, 160, 96, 5, 3, dict(fused_max_tokens=64)),
         ("tables-act-quant-fp32", torch.float32, 9, 64, 32, 3, 2, dict(fused_max_tokens=0)),
         ("split-k", torch.bfloat16, 3, 160, 128, 6, 2, SPLIT),
         ("combine-launch", torch.bfloat16, 5, 96, 32, 4, 2, dict(combine=dict(in_kernel=False)))]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp4_experts_give_the_same_bits(rng, launches, case):
    """The fp8 path's bits, and the reference's result to the fp8 path's tolerance."""
    _, xdt, n, D, I, E, k, tiles = case
    args = _args(rng, xdt, n, D, I, E, k)
    add = (torch.randn(n, D, generator=rng) * 2.0).to(DEVICE)
    with pinned_tiles(moe=tiles):
        want = _cuda(*args, add=add, out_dtype=xdt)
    plain = list(launches)
    launches.clear()
    with pinned_tiles(moe={**tiles, **ON}):
        got = _cuda(*args, add=add, out_dtype=xdt)
        assert_counters_zero(got)
    assert torch.equal(got, want)
    with flashrt.use_backend("reference"):
        ref = ops.moe_experts(*args, add=add, out_dtype=xdt)
    assert rel_err(got.float(), ref.float()) < 5e-3
    # x through its round trip first (in place of act_quant, or one launch more where the up kernel
    # quantized x itself); the other launches unchanged
    assert launches[0] == "_fp8_round_trip_kernel"
    assert launches[1:] == [name for name in plain if name != "_quantize_kernel"], (plain, launches)


@pytest.mark.parametrize("shared_fmt", ["fp8_w", "fp4_w"])
def test_with_the_shared_expert_in_the_launches(rng, launches, shared_fmt):
    """The shared expert's rows in the same launches: fp4 shared weights give the same bits; fp8 ones
    take the dequantizing MMA (bf16 operands; the fp8 path may multiply raw E4M3 slices), checked
    against the reference as the fp8 path is."""
    n = int(torch.randint(1, 9, (1,), generator=rng))
    args = _args(rng, torch.bfloat16, n, 96, 64, 6, 2)
    shared = tuple(_weights(rng, shared_fmt, 1, 64, 96))
    with pinned_tiles(moe={}):
        plain = _cuda(*args, out_dtype=torch.bfloat16, shared=shared)
    with pinned_tiles(moe=ON):
        got = _cuda(*args, out_dtype=torch.bfloat16, shared=shared)
        assert_counters_zero(got)
        assert launches[-2:] == ["_moe_up_kernel", "_moe_down_kernel"]  # the shared rows in the routed launches
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, out_dtype=torch.bfloat16, shared=shared)
    if shared_fmt == "fp4_w":
        assert torch.equal(got, plain)
    assert rel_err(got.float(), want.float()) < 5e-3 and rel_err(plain.float(), want.float()) < 5e-3


def test_fp8_experts_against_the_reference(rng):
    """fp8_w routed weights under act_dequantized: the dequantizing MMA (PROMOTE off), the
    reference's result to the fp8 path's tolerance."""
    args = _args(rng, torch.bfloat16, 6, 128, 64, 4, 2, fmt="fp8_w")
    with pinned_tiles(moe=ON):
        plan = moe._plan(6, 2, 4, 128, 64)
        assert plan["adq"]
        got = _cuda(*args)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args)
    assert rel_err(got, want) < 2e-3


def test_the_round_trip_launch_gives_the_fp8_values(rng):
    """x's launch: every 32-block of a row quantized to fp8 and decoded back (the format's own
    quantize / dequantize), bf16, any row count and a width that ends in a partial tile."""
    from flashrt.kernels_cuda import quant

    n, D = int(torch.randint(1, 40, (1,), generator=rng)), 32 * int(torch.randint(1, 12, (1,), generator=rng))
    spread = torch.exp(torch.randn(n, D // 32, 1, generator=rng) * 4)  # blocks of very different scales
    x = (torch.randn(n, D // 32, 32, generator=rng) * spread).reshape(n, D).to(DEVICE, torch.bfloat16)
    got = fp8_round_trip(x, moe.TILES["round_trip"])
    want = quant.dequantize(quant.quantize(x, "fp8"), torch.float32)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want)
