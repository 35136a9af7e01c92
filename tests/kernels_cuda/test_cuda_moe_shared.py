"""``moe_experts(..., shared=)`` on the CUDA kernels: the shared expert (its own weight format) runs
in the routed experts' up and down launches, its row tiles after theirs, and the combine counts its
row. Against the unfused path (the routed experts and the shared one as separate ops) bit for bit
and against the reference, on fresh random inputs: routing tables or a row tile per pair (no tables
launch), the combine in the down kernel or its own launch, split K (the decode tile knobs), bf16 /
fp32 activations, in-kernel and separate activation quantization."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import (DEVICE, assert_counters_zero, launches, pinned_tiles, rel_err,  # noqa: F401
                          requires_kernels)  # (launches: a fixture)

pytestmark = requires_kernels
moe = pytest.importorskip("flashrt.kernels_cuda.moe")

IN_KERNEL = dict(combine=dict(in_kernel=True))
LAUNCH = dict(combine=dict(in_kernel=False))
SPLIT = dict(experts=((16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2, min_block_n=32,
                                 split_k=3)),
                      (None, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2))))


def _weights(rng, fmt, E, I, D):
    shapes = ((E, I, D), (E, I, D), (E, D, I))
    return [formats.quantize(torch.randn(*s, generator=rng) * 0.25, fmt).to(DEVICE) for s in shapes]


def _case(rng, xdt, n, D, I, E, k, routed_fmt="fp4_w", shared_fmt="fp8_w"):
    x = (torch.randn(n, D, generator=rng) * 3.0).to(DEVICE, xdt)
    idx = torch.randint(0, E, (n, k), generator=rng, dtype=torch.int32)  # a token's slots may repeat
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    return (x, rw, idx.to(DEVICE), *_weights(rng, routed_fmt, E, I, D), 10.0), tuple(_weights(rng, shared_fmt, 1, I, D))


def _cuda(*args, **kw):
    with flashrt.use_backend("cuda"):
        return ops.moe_experts(*args, **kw)


def _unfused(args, shared, add, out_dtype):
    """The routed sum and the shared expert as two ops, then the shared row and ``add`` added in
    the combine's order (fp32), and the cast."""
    n = args[0].shape[0]
    ones, first = torch.ones(n, 1, device=DEVICE), torch.zeros(n, 1, dtype=torch.int32, device=DEVICE)
    total = _cuda(*args) + _cuda(args[0], ones, first, *shared, args[-1])
    return (total if add is None else total + add).to(out_dtype)


# Each shape under two of the four (combine path, pair tiles) settings, each setting on two shapes
# (the full product costs minutes in the interpreter and adds no pairing the code branches on).
SHAPES = {"one-row": (torch.bfloat16, 1, 96, 64, 8, 2, 64), "uneven": (torch.bfloat16, 7, 160, 96, 5, 3, 64),
          "fp32": (torch.float32, 13, 64, 32, 3, 2, 64), "quantize-apart": (torch.bfloat16, 5, 96, 32, 4, 2, 0)}
SETTINGS = [("one-row", "in-kernel", 0), ("one-row", "launch", 16), ("uneven", "in-kernel", 0),
            ("uneven", "launch", 0), ("fp32", "in-kernel", 16), ("fp32", "launch", 16),
            ("quantize-apart", "in-kernel", 16), ("quantize-apart", "launch", 0)]


@pytest.mark.parametrize("shape,path,pair_tiles", SETTINGS, ids=["-".join(map(str, c)) for c in SETTINGS])
def test_shared_in_the_routed_launches(rng, launches, shape, path, pair_tiles):
    xdt, n, D, I, E, k, fused = SHAPES[shape]
    paths = IN_KERNEL if path == "in-kernel" else LAUNCH
    args, shared = _case(rng, xdt, n, D, I, E, k)
    quantize = ["_quantize_kernel"] if n > fused else []
    tables = [] if pair_tiles >= n else ["_route_kernel"]
    combine = [] if paths is IN_KERNEL else ["_moe_combine_kernel"]
    with pinned_tiles(moe=dict(paths, fused_max_tokens=fused, pair_tiles=pair_tiles)):
        got = _cuda(*args, out_dtype=xdt, shared=shared)
        assert launches == quantize + tables + ["_moe_up_kernel", "_moe_down_kernel"] + combine
        assert_counters_zero(got)
        assert torch.equal(got, _unfused(args, shared, None, xdt))
        add = (torch.randn(n, D, generator=rng) * 2.0).to(DEVICE)
        with_add = _cuda(*args, add=add, shared=shared)
        assert torch.equal(with_add, _unfused(args, shared, add, torch.float32))
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, add=add, shared=shared)
    assert rel_err(with_add, want) < 2e-3


@pytest.mark.parametrize("pair_tiles", [0, 16])
@pytest.mark.parametrize("paths", [IN_KERNEL, LAUNCH], ids=["in-kernel", "launch"])
def test_shared_in_launches_of_its_own(rng, launches, pair_tiles, paths):
    """``shared_in_launch`` False: the shared expert's up and down launches (the direct path), then
    the routed ones, which add its rows in the combine: bit for bit the one-launch result without
    ``add``; with ``add``, the routed sum plus (shared row + add), against the reference."""
    n = int(torch.randint(1, 9, (1,), generator=rng))
    args, shared = _case(rng, torch.bfloat16, n, 96, 64, 6, 2)
    add = (torch.randn(n, 96, generator=rng) * 2.0).to(DEVICE)
    with pinned_tiles(moe=dict(paths, pair_tiles=pair_tiles)):
        one = _cuda(*args, out_dtype=torch.bfloat16, shared=shared)
    launches.clear()
    with pinned_tiles(moe=dict(paths, pair_tiles=pair_tiles, shared_in_launch=False)):
        apart = _cuda(*args, out_dtype=torch.bfloat16, shared=shared)
        tables = [] if pair_tiles >= n else ["_route_kernel"]
        combine = [] if paths is IN_KERNEL else ["_moe_combine_kernel"]
        assert launches == ["_moe_up_kernel", "_moe_down_kernel"] + tables + ["_moe_up_kernel", "_moe_down_kernel"] \
            + combine
        assert_counters_zero(apart)
        with_add = _cuda(*args, add=add, shared=shared)
        ones, first = torch.ones(n, 1, device=DEVICE), torch.zeros(n, 1, dtype=torch.int32, device=DEVICE)
        own = _cuda(args[0], ones, first, *shared, args[-1]) + add
        assert torch.equal(with_add, _cuda(*args) + own)
    assert torch.equal(apart, one)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, add=add, shared=shared)
    assert rel_err(with_add, want) < 2e-3


@pytest.mark.parametrize("routed,shared_fmt,pair_tiles", [("fp4_w", "fp8_w", 0), ("fp4_w", "fp8_w", 16),
                                                           ("fp8_w", "fp4_w", 16), ("fp8_w", "fp8_w", 0)])
def test_shared_with_split_k(rng, launches, routed, shared_fmt, pair_tiles):
    """The decode tile knobs (split K, narrowed column tiles) over routed and shared row tiles
    alike: the tiles' last programs sum the partials, the counters end at zero."""
    args, shared = _case(rng, torch.bfloat16, 3, 160, 128, 6, 2, routed, shared_fmt)
    with pinned_tiles(moe=dict(SPLIT, pair_tiles=pair_tiles)):
        plan = moe._plan(3, 2, 6, 160, 128, True)
        assert plan["up"][1] > 1 and plan["down"][1] > 1, plan
        got = _cuda(*args, shared=shared)
        assert_counters_zero(got)
    with pinned_tiles(moe=dict(pair_tiles=pair_tiles)):
        unsplit = _cuda(*args, shared=shared)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, shared=shared)
    assert rel_err(got, want) < 2e-3 and rel_err(unsplit, want) < 2e-3
    # the fp32 sums in another order, then the same roundings: usually the same bits, but a sum one ulp
    # across a rounding point of gate / up (x.dtype) or of h's fp8 code moves that element by a step,
    # and a step of h reaches every output of its token (up to a few 1e-3 of the norm); a lost or
    # doubled partial of a 2-4-way split moves a tile's outputs by a quarter or more of their size
    assert rel_err(got, unsplit) < 2e-2


def test_pair_tiles_equal_the_tables(rng, launches):
    """A row tile per pair (no tables launch) gives the tables path's bits, with and without the
    shared expert; only the tables launch differs."""
    args, shared = _case(rng, torch.bfloat16, 4, 96, 64, 6, 3)
    for s in (None, shared):
        launches.clear()
        with pinned_tiles(moe=dict(pair_tiles=0)):
            tables = _cuda(*args, shared=s)
        with pinned_tiles(moe=dict(pair_tiles=4)):
            pairs = _cuda(*args, shared=s)
        assert launches.count("_route_kernel") == 1 and launches.count("_moe_up_kernel") == 2
        assert torch.equal(tables, pairs)


@pytest.mark.parametrize("with_add", [False, True])
def test_plain_shared_weights(rng, launches, with_add):
    """Plain shared weights (or w1 and w3 in two formats), which the kernels do not decode: the
    CUDA family serves them, the shared expert by the reference math joined as the combine's add,
    in the op's order (routed sum, shared row, add)."""
    args, shared = _case(rng, torch.bfloat16, 3, 64, 32, 4, 2)
    add = torch.randn(3, 64, generator=rng).to(DEVICE) if with_add else None
    for odd in (tuple(formats.dequantize(w).to(torch.bfloat16) for w in shared),
                (shared[0], formats.quantize(formats.dequantize(shared[1]), "fp4_w"), shared[2])):
        launches.clear()
        got = _cuda(*args, add=add, out_dtype=torch.bfloat16, shared=odd)
        assert "_moe_up_kernel" in launches
        with flashrt.use_backend("reference"):
            alone = ops.moe_experts(args[0], torch.ones(3, 1, device=DEVICE),
                                    torch.zeros(3, 1, dtype=torch.int32, device=DEVICE), *odd, args[-1])
            want = ops.moe_experts(*args, add=add, out_dtype=torch.bfloat16, shared=odd)
        assert torch.equal(got, _unfused_with(args, alone, add, torch.bfloat16))
        assert rel_err(got, want) < 1e-2


def _unfused_with(args, alone, add, out_dtype):
    total = _cuda(*args) + alone
    return (total if add is None else total + add).to(out_dtype)


def test_the_h200_decode_rule_with_the_shared_tiles(rng, monkeypatch):
    """132 SMs and the h200 profile's decode rule (``min_block_n`` 32, ``split_min_blocks`` 2) at
    batch 1: the shared tile counts among the row tiles that narrow the columns and split K."""
    from flashrt.kernels_cuda import linear as lin

    monkeypatch.setattr(lin, "num_sms", lambda: 132)
    rule = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3, min_block_n=32, split_min_blocks=2)
    args, shared = _case(rng, torch.bfloat16, 1, 256, 128, 8, 2)
    with pinned_tiles(moe=dict(experts=[[16, rule], [None, rule]])):
        plan = moe._plan(1, 2, 8, 256, 128, True)
        assert plan["pairs"] and plan["up"][0]["BLOCK_N"] == 32 and plan["up"][1] == 2, plan
        got = _cuda(*args, out_dtype=torch.bfloat16, shared=shared)
        assert_counters_zero(got)
        assert torch.equal(got, _unfused(args, shared, None, torch.bfloat16))  # the same tiles, unfused
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, out_dtype=torch.bfloat16, shared=shared)
    assert rel_err(got, want) < 1e-2
