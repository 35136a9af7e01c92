"""The ``gemv`` knob of a ``linear`` rule (kernels_cuda/gemv.py): fp8_w launches as one activation
row and BLOCK_N weight rows a program, multiply-adds on the CUDA cores. Against the reference and
against the MMA rule on the same fresh random inputs: one and several rows, ragged N and K tiles,
32-row tiles (the weight scale on the activations) and wider ones (on the weights), K split summed
in the kernel or by a launch after it, fp32 / bf16 activations; every E4M3 code and scale byte
read back exactly; the activations through their fp8 round trip by a launch before the GEMV
(``gemv_round_trip``) give the same bits; fp4_w launches keep the rule's MMA tile."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import (DEVICE, GPU, assert_counters_zero, launches, linear_three_ways, pinned_tiles,  # noqa: F401
                          rel_err, requires_kernels, run_both)  # (launches: a fixture)

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")


def _gemv_rule(rows, block_n=32, block_k=64, **knobs):
    return [rows, dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=2, gemv=True, **knobs)]


def _mma_rule(rows=None):
    return [rows, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)]


def _linear(x, w):
    with flashrt.use_backend("cuda"):
        return ops.linear(x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,block_n,split,reduce", [(1, 32, None, None), (1, 64, 3, None), (3, 32, 2, None),
                                                    (2, 64, 2, False), (1, 32, 3, False)])
def test_gemv_rows(rng, dtype, m, block_n, split, reduce):
    """m rows over a ragged weight (N 72: a partial last tile; K 352: a partial K block)."""
    n, k = 72, 352
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE, dtype)
    w = formats.quantize(torch.randn(n, k, generator=rng) * 0.25, "fp8_w").to(DEVICE)
    tiles = dict(linear=[_gemv_rule(16, block_n, split_reduce=reduce), _mma_rule()], split_k=split)
    with pinned_tiles(linear=tiles):
        plan = lin._linear_plan(m, n, k, dtype, "fp8_w")
    assert plan["gemv"] and plan["split"] == (split or 1) and plan["reduce"] == (split is not None and reduce is None)
    assert plan["grid"][0] == m * -(-n // block_n)
    got, dot, want = linear_three_ways(x, w, tiles, dict(tiles, linear=[_mma_rule()]))
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got, want) < tol and rel_err(got, dot) < tol


@pytest.mark.parametrize("m,rows,block_n,split", [(2, 2, 32, None), (3, 4, 64, 2), (5, 2, 32, 3), (8, 4, 64, None)])
def test_gemv_several_rows_a_program(rng, m, rows, block_n, split):
    """``gemv_rows``: a program's rows (the last row tile short of them where m is not a multiple)
    share one weight block's load and conversion; each row's output is its own, against the reference,
    the MMA rule and the one-row GEMV (the same products, summed in the same order)."""
    n, k = 72, 352
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE)
    w = formats.quantize(torch.randn(n, k, generator=rng) * 0.25, "fp8_w").to(DEVICE)
    tiles = dict(linear=[_gemv_rule(16, block_n, gemv_rows=rows), _mma_rule()], split_k=split)
    with pinned_tiles(linear=tiles):
        plan = lin._linear_plan(m, n, k, x.dtype, "fp8_w")
    assert plan["gemv"] and plan["constexprs"]["ROWS"] == rows and plan["grid"][0] == -(-m // rows) * -(-n // block_n)
    got, dot, want = linear_three_ways(x, w, tiles, dict(tiles, linear=[_mma_rule()]))
    with pinned_tiles(linear=dict(tiles, linear=[_gemv_rule(16, block_n), _mma_rule()])):
        one = _linear(x, w)
    assert got.shape == (m, n) and rel_err(got, want) < 1e-5 and rel_err(got, dot) < 1e-5
    assert rel_err(got, one) < 1e-6


def test_gemv_rows_at_most_the_launch_rows():
    """A rule's ``gemv_rows`` over the launch's rows: the program takes the rows rounded up to a power
    of two, not more (no program of all-masked rows)."""
    tiles = dict(linear=[_gemv_rule(16, 32, gemv_rows=4), _mma_rule()])
    with pinned_tiles(linear=tiles):
        assert [lin._linear_plan(m, 64, 128, torch.float32, "fp8_w")["constexprs"]["ROWS"] for m in (1, 2, 3, 8)] \
            == [1, 2, 4, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,rows,block_n,split", [(1, 1, 32, None), (1, 1, 64, 3), (2, 2, 32, 2), (3, 4, 64, None),
                                                  (5, 2, 32, 3)])
def test_gemv_round_trip_same_bits(rng, launches, dtype, m, rows, block_n, split):
    """``gemv_round_trip``: x through its fp8 round trip by one launch, then the GEMV loading those
    values (QX ACT_DEQUANTIZED): the bits of the GEMV that quantizes its rows itself, and the
    reference's result. Blocks of very different scales, a ragged weight."""
    n, k = 72, 352
    spread = torch.exp(torch.randn(m, k // 32, 1, generator=rng) * 3)
    x = (torch.randn(m, k // 32, 32, generator=rng) * spread).reshape(m, k).to(DEVICE, dtype)
    w = formats.quantize(torch.randn(n, k, generator=rng) * 0.25, "fp8_w").to(DEVICE)
    plain = dict(linear=[_gemv_rule(16, block_n, gemv_rows=rows), _mma_rule()], split_k=split)
    trip = dict(plain, linear=[_gemv_rule(16, block_n, gemv_rows=rows, gemv_round_trip=True), _mma_rule()])
    with pinned_tiles(linear=trip):
        plan = lin._linear_plan(m, n, k, dtype, "fp8_w")
        assert plan["round_trip"] and plan["constexprs"]["QX"] == 2
        got = _linear(x, w)
        assert_counters_zero(got)
    assert launches[:2] == ["_fp8_round_trip_kernel", "_gemv_kernel"]
    with pinned_tiles(linear=plain):
        assert "QX" not in lin._linear_plan(m, n, k, dtype, "fp8_w")["constexprs"]
        want = _linear(x, w)
    with flashrt.use_backend("reference"):
        ref = ops.linear(x, w)
    assert got.dtype == dtype and torch.equal(got, want)
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_gemv_shared_rows_only_from_the_weight_size(rng, launches):
    """``gemv_shared_min_weights``: a weight of fewer elements (N x K) takes one row a program and no
    round trip, the rows' values unchanged (each row's sums do not depend on the program it is in);
    one of that many elements the rule's rows a program and its round trip."""
    m, k = 2, 32 * int(torch.randint(4, 12, (1,), generator=rng))
    n_small, n_big = 32 * int(torch.randint(1, 4, (1,), generator=rng)), 160
    rule = _gemv_rule(16, 32, gemv_rows=2, gemv_round_trip=True, gemv_shared_min_weights=n_big * k)
    with pinned_tiles(linear=dict(linear=[rule, _mma_rule()])):
        big, small = (lin._linear_plan(m, n, k, torch.bfloat16, "fp8_w") for n in (n_big, n_small))
    assert big["constexprs"]["ROWS"] == 2 and big["round_trip"] and big["grid"][0] == n_big // 32
    assert small["constexprs"]["ROWS"] == 1 and not small["round_trip"] and small["grid"][0] == m * n_small // 32
    for n in (n_small, n_big):
        x = torch.randn(m, k, generator=rng).to(DEVICE, torch.bfloat16)
        w = formats.quantize(torch.randn(n, k, generator=rng) * 0.25, "fp8_w").to(DEVICE)
        launches.clear()
        with pinned_tiles(linear=dict(linear=[rule, _mma_rule()])):
            got = _linear(x, w)
        assert ("_fp8_round_trip_kernel" in launches) == (n == n_big)
        with pinned_tiles(linear=dict(linear=[_gemv_rule(16, 32), _mma_rule()])):
            one = _linear(x, w)
        with flashrt.use_backend("reference"):
            ref = ops.linear(x, w)
        assert (torch.equal(got, one) if n == n_small else rel_err(got, one) < 1e-6) and rel_err(got, ref) < 1e-2


def test_a_rule_serves_weights_up_to_its_max_weights(rng):
    """``max_weights``: a rule serves a weight of at most that many elements (N x K); a larger one's
    launch takes the next rule serving its rows; with no rule left, an error naming the rows and size."""
    k = 32 * int(torch.randint(4, 10, (1,), generator=rng))
    limit = 64 * k
    rules = [_gemv_rule(8, 32, max_weights=limit), _mma_rule()]
    for n in (64, 96):
        x = torch.randn(5, k, generator=rng).to(DEVICE, torch.bfloat16)
        w = formats.quantize(torch.randn(n, k, generator=rng) * 0.25, "fp8_w").to(DEVICE)
        with pinned_tiles(linear=dict(linear=rules)):
            plan = lin._linear_plan(5, n, k, torch.bfloat16, "fp8_w")
            got = _linear(x, w)
        assert plan["gemv"] == (n * k <= limit)
        with flashrt.use_backend("reference"):
            ref = ops.linear(x, w)
        assert rel_err(got, ref) < 1e-2
    with pinned_tiles(linear=dict(linear=[_gemv_rule(None, 32, max_weights=limit)])):
        with pytest.raises(ValueError, match=f"serving 5 rows and a weight of {96 * k} elements"):
            lin._linear_plan(5, 96, k, torch.bfloat16, "fp8_w")


@pytest.mark.parametrize("block_n", [32, 64])
def test_gemv_every_e4m3_code_and_scale(rng, block_n):
    """One-hot activation rows read back each finite E4M3 weight code times its tile's scale
    exactly: the E4M3 conversion, the scale on the activations (32-row tiles) or on the weights."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    data = codes[torch.randperm(256, generator=rng)].view(64, 4).repeat(1, 16).view(torch.float8_e4m3fn)
    scale_bytes = torch.randint(100, 150, (2, 2), generator=rng, dtype=torch.uint8)
    w = formats.QTensor(data.to(DEVICE), scale_bytes.view(torch.float8_e8m0fnu).to(DEVICE), "fp8_w", (64, 64))
    values = data.to(torch.float32) * torch.pow(2.0, scale_bytes.to(torch.float32) - 127).repeat_interleave(
        32, 0).repeat_interleave(32, 1)
    with pinned_tiles(linear=dict(linear=[_gemv_rule(None, block_n, 32)])):
        for i in torch.randperm(64, generator=rng)[:8].tolist():
            got = _linear(torch.eye(64, device=DEVICE)[i:i + 1], w)
            assert torch.equal(got[0].cpu(), values[:, i])


def test_fp4_w_keeps_the_mma_tile(rng):
    """The knob is for fp8_w: an fp4_w launch of the same rule runs the rule's MMA tile."""
    x = torch.randn(1, 128, generator=rng).to(DEVICE)
    w = formats.quantize(torch.randn(64, 128, generator=rng), "fp4_w").to(DEVICE)
    with pinned_tiles(linear=dict(linear=[_gemv_rule(None)])):
        assert not lin._linear_plan(1, 64, 128, torch.float32, "fp4_w")["gemv"]
        got = _linear(x, w)
    with flashrt.use_backend("reference"):
        want = ops.linear(x, w)
    assert rel_err(got, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("block_n,block_k", [(32, 512), (64, 256)])
@pytest.mark.parametrize("round_trip", [False, True])
def test_gemv_released_shapes_gpu(rng, m, block_n, block_k, round_trip):
    """The released projections' shapes with the knob, K split over the SMs and summed in the kernel,
    the activations quantized in the GEMV or by the round trip's launch."""
    for n, k in ((1792, 5120), (5120, 8192)):
        x = torch.randn(m, k, generator=rng).to(DEVICE, torch.bfloat16)
        w = formats.quantize(torch.randn(n, k, generator=rng) * 0.05, "fp8_w").to(DEVICE)
        with pinned_tiles(linear=dict(linear=[[16, dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
                                                         num_stages=3, split_min_blocks=1, gemv=True,
                                                         gemv_round_trip=round_trip)]])):
            got, want = run_both("linear", x, w)
            assert_counters_zero(got)
        assert rel_err(got, want) < 1e-3
