"""Fewer ``moe_experts`` launches, each against the path its switch restores, bit for bit, and
against the reference, on fresh random inputs of odd token counts and widths (fp4_w / fp8_w
weights, bf16 / fp32 activations, in-kernel and separate activation quantization):

- one expert and one slot a token (the shared expert) in two launches (up and down, no routing
  tables, no combine: ``tiles.moe.direct``);
- routed experts with the combine summed by the down kernel's last program per (token, column
  tile) (``tiles.moe.combine.in_kernel``): three launches, the ticket counters left at zero; a
  token's slots may repeat an expert (two rows of one token in one row tile)."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import (DEVICE, GPU, assert_counters_zero, launches, pinned_tiles, rel_err,  # noqa: F401
                          requires_kernels, run_both)  # (launches: a fixture)

pytestmark = requires_kernels
moe = pytest.importorskip("flashrt.kernels_cuda.moe")
linear = pytest.importorskip("flashrt.kernels_cuda.linear")

# the paths under test, set through a pinned profile: the device's profile changes none of them
# (the routing tables' path at every token count: no pair tiles, test_cuda_moe_shared.py has them)
DIRECT = dict(direct=True, combine=dict(in_kernel=True), pair_tiles=0)
TABLES = dict(direct=False, combine=dict(in_kernel=False), pair_tiles=0)


def _case(rng, fmt, xdt, n, D, I):
    x = (torch.randn(n, D, generator=rng) * 3.0).to(DEVICE, xdt)
    rw = (torch.rand(n, 1, generator=rng) + 0.5).to(DEVICE)
    first = torch.zeros(n, 1, dtype=torch.int32, device=DEVICE)
    w = [formats.quantize(torch.randn(*s, generator=rng) * 0.25, fmt).to(DEVICE) for s in ((1, I, D), (1, I, D), (1, D, I))]
    return x, rw, first, *w, 10.0


def _cuda(*args):
    with flashrt.use_backend("cuda"):
        return ops.moe_experts(*args)


@pytest.mark.parametrize("fmt,xdt,n,D,I,fused", [("fp4_w", torch.bfloat16, 1, 96, 64, 64),
                                                 ("fp8_w", torch.bfloat16, 7, 160, 96, 64),
                                                 ("fp4_w", torch.float32, 19, 64, 160, 64),
                                                 ("fp8_w", torch.bfloat16, 5, 96, 32, 0)])
def test_direct_equals_the_tables_path_in_two_launches(rng, launches, fmt, xdt, n, D, I, fused):
    args = _case(rng, fmt, xdt, n, D, I)
    quantize = ["_quantize_kernel"] if n > fused else []  # past fused_max_tokens: one act_quant launch first
    with pinned_tiles(moe=dict(DIRECT, fused_max_tokens=fused)):
        direct = _cuda(*args)
    assert launches == quantize + ["_moe_up_kernel", "_moe_down_kernel"]
    assert direct.dtype == torch.float32 and tuple(direct.shape) == (n, D)
    launches.clear()
    with pinned_tiles(moe=dict(TABLES, fused_max_tokens=fused)):
        tables = _cuda(*args)
    assert launches == quantize + ["_route_kernel", "_moe_up_kernel", "_moe_down_kernel", "_moe_combine_kernel"]
    assert torch.equal(direct, tables)
    _, want = run_both("moe_experts", *args)
    assert rel_err(direct, want) < 1e-3


def _routed(rng, fmt, xdt, n, D, I, E, k, repeat=False):
    x = (torch.randn(n, D, generator=rng) * 3.0).to(DEVICE, xdt)
    if repeat:
        idx = torch.randint(0, E, (n, k), generator=rng, dtype=torch.int32)
    else:
        idx = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(n)]).to(torch.int32)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    w = [formats.quantize(torch.randn(*s, generator=rng) * 0.25, fmt).to(DEVICE) for s in ((E, I, D), (E, I, D), (E, D, I))]
    return x, rw, idx.to(DEVICE), *w, 10.0


@pytest.mark.parametrize("fmt,xdt,n,D,I,E,k,repeat", [("fp4_w", torch.bfloat16, 1, 96, 64, 8, 2, False),
                                                      ("fp8_w", torch.bfloat16, 7, 160, 96, 5, 3, False),
                                                      ("fp4_w", torch.float32, 13, 64, 32, 3, 2, True),
                                                      ("fp8_w", torch.bfloat16, 37, 96, 64, 2, 2, True)])
def test_combine_in_the_down_kernel_equals_the_combine_launch(rng, launches, fmt, xdt, n, D, I, E, k, repeat):
    args = _routed(rng, fmt, xdt, n, D, I, E, k, repeat)
    with pinned_tiles(moe=DIRECT):
        fused = _cuda(*args)
    assert [k for k in launches if k != "_quantize_kernel"] == ["_route_kernel", "_moe_up_kernel", "_moe_down_kernel"]
    assert_counters_zero(fused)
    launches.clear()
    with pinned_tiles(moe=TABLES):
        plain = _cuda(*args)
    assert [k for k in launches if k != "_quantize_kernel"] == ["_route_kernel", "_moe_up_kernel", "_moe_down_kernel",
                                                                "_moe_combine_kernel"]
    assert torch.equal(fused, plain)
    _, want = run_both("moe_experts", *args)
    # fp8 weights on a GPU with the fp8 MMA: within a K block its accumulator is narrower than fp32, so
    # a gate / up sum can land on the other side of an E4M3 rounding boundary of h from the
    # reference's, and h's fp8 quantization moves that element by a whole E4M3 step; with many rows an
    # expert, enough of them move for the output's error to pass 2e-3 (tools/moe_error.py measures
    # its spread over seeds)
    fp8_mma = fmt == "fp8_w" and GPU and linear.supports_fp8_mma()
    assert rel_err(fused, want) < (1e-2 if fp8_mma else 2e-3)


@pytest.mark.parametrize("fmt,xdt,n,D,I,E,k", [("fp4_w", torch.bfloat16, 3, 96, 64, 8, 2),
                                               ("fp8_w", torch.bfloat16, 11, 160, 32, 5, 3),
                                               ("fp4_w", torch.float32, 6, 64, 32, 3, 2)])
@pytest.mark.parametrize("paths", [DIRECT, TABLES])
def test_add_and_out_dtype_inside_the_combine(rng, launches, fmt, xdt, n, D, I, E, k, paths):
    """``add`` (the shared expert's output) and the cast to ``out_dtype`` happen in the combine
    (in the down kernel or the combine launch): no extra launch, and the bits of the fp32 sum
    plus ``add`` cast by torch; the shared expert itself (one expert, one slot) with ``add``."""
    args = _routed(rng, fmt, xdt, n, D, I, E, k)
    add = (torch.randn(n, D, generator=rng) * 2.0).to(DEVICE)
    with pinned_tiles(moe=paths):
        plain = _cuda(*args)
        before = list(launches)
        launches.clear()
        got = _cuda(*args, add, xdt)
    assert launches == before
    assert got.dtype == xdt and torch.equal(got, (plain + add).to(xdt))
    shared = _case(rng, fmt, xdt, n, D, I)
    with pinned_tiles(moe=paths):
        alone = _cuda(*shared)
        assert torch.equal(_cuda(*shared, add, torch.bfloat16), (alone + add).to(torch.bfloat16))
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, add, xdt)
    assert rel_err(got, want) < (1e-2 if xdt == torch.bfloat16 else 1e-3)
