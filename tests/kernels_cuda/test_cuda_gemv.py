"""Row tiles under 16 in the block-scaled GEMMs (``linear`` and ``moe_experts``): the multiply-add
K loop (kernels_cuda/linear_kernel.py ``_fma_k_loop``) a profile picks with ``BLOCK_M`` < 16.
Against the reference and against the MMA path's 16-row tile on the same fresh random inputs:
both weight formats, fp32 / bf16 activations, several row tiles, split K (summed in the kernel or
by a sum launch), activations quantized in the kernel or by ``act_quant``, pairs mode and routing
tables, the shared expert in the routed launches."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import (DEVICE, GPU, assert_counters_zero, linear_three_ways, pinned_tiles, rel_err,
                          requires_kernels, run_both)

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
moe = pytest.importorskip("flashrt.kernels_cuda.moe")
kern = pytest.importorskip("flashrt.kernels_cuda.linear_kernel")


def _rule(rows, block_m, **kw):
    return [rows, dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2, **kw)]


def _weight(rng, fmt, *shape):
    return formats.quantize(torch.randn(*shape, generator=rng) * 0.25, fmt).to(DEVICE)


def _linear(x, w):
    with flashrt.use_backend("cuda"):
        return ops.linear(x, w)


@pytest.mark.parametrize("fmt", ["fp8_w", "fp4_w"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_m,m,split,fused", [(1, 1, None, 64), (1, 3, 2, 64), (4, 6, 3, 0), (8, 5, 2, 64)])
def test_linear_few_rows(rng, fmt, dtype, block_m, m, split, fused):
    """m rows through BLOCK_M-row tiles; split K summed by each tile's last program (fused) or by
    the sum launch (act_quant first)."""
    n, k = 72, 320
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE, dtype)
    w = _weight(rng, fmt, n, k)
    tiles = dict(linear=[_rule(16, block_m), _rule(None, 16)],
                 split_k=split, fused_max_rows=fused)
    with pinned_tiles(linear=tiles):
        plan = lin._linear_plan(m, n, k, dtype, fmt)
    assert plan["constexprs"]["BLOCK_M"] == block_m and plan["split"] == (split or 1)
    got, dot, want = linear_three_ways(x, w, tiles, dict(tiles, linear=[_rule(None, 16)]))
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert rel_err(got, want) < tol and rel_err(got, dot) < tol


def test_linear_every_e4m3_code_one_row():
    """One-hot activation rows read back each finite E4M3 weight code exactly through the
    multiply-add loop (scale 1): the decode of both operands is exact."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    data = codes.view(8, 32).view(torch.float8_e4m3fn)
    scale = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = formats.QTensor(data.to(DEVICE), scale.to(DEVICE), "fp8_w", (8, 32))
    with pinned_tiles(linear=dict(linear=[_rule(None, 1)])):
        for i in torch.randperm(32)[:6].tolist():
            got = _linear(torch.eye(32, device=DEVICE)[i:i + 1], w)
            assert torch.equal(got[0].cpu(), data[:, i].to(torch.float32))


def _experts_case(rng, n, E, k, D, I, xdt=torch.bfloat16):
    x = (torch.randn(n, D, generator=rng) * 3.0).to(DEVICE, xdt)
    idx = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(n)]).to(DEVICE, torch.int32)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    ws = [_weight(rng, "fp4_w", *s) for s in ((E, I, D), (E, I, D), (E, D, I))]
    shared = tuple(_weight(rng, "fp8_w", *s) for s in ((1, I, D), (1, I, D), (1, D, I)))
    return (x, rw, idx, *ws, 10.0), shared


@pytest.mark.parametrize("n,pair_tiles,block_m,split", [(1, 1, 1, None), (1, 1, 1, 3), (3, 4, 2, 3), (5, 0, 1, None)])
@pytest.mark.parametrize("with_shared", [False, True])
def test_experts_few_rows(rng, n, pair_tiles, block_m, split, with_shared):
    """The experts rule with BLOCK_M < 16: a row tile per pair (pairs mode picks the rule for one
    row) or routing-table tiles of BLOCK_M rows; against the 16-row MMA tile and the reference."""
    args, shared = _experts_case(rng, n, 6, 2, 96, 64)
    shared = shared if with_shared else None
    few = dict(experts=[_rule(16, block_m, split_k=split), _rule(None, 16)],
               pair_tiles=pair_tiles)
    with pinned_tiles(moe=few):
        plan = moe._plan(n, 2, 6, 96, 64, with_shared)
        assert plan["block_m"] == block_m and plan["pairs"] == (n <= pair_tiles)
        with flashrt.use_backend("cuda"):
            got = ops.moe_experts(*args, shared=shared)
        assert_counters_zero(got)
    with pinned_tiles(moe=dict(pair_tiles=pair_tiles)), flashrt.use_backend("cuda"):
        dot = ops.moe_experts(*args, shared=shared)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, shared=shared)
    assert rel_err(got, want) < 2e-3 and rel_err(got, dot) < 2e-3


@pytest.mark.parametrize("block_m", [1, 2])
def test_few_rows_with_e2m1_words(rng, block_m):
    """fp4_w weights in the E2M1 word layout (formats.with_e2m1_words, the h200 profile's experts)
    through the multiply-add loop: ``linear`` and the experts (with the fp8 shared expert) give the
    reference's values of the same weights and the 16-row MMA tile's."""
    x = (torch.randn(3, 320, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    w = formats.with_e2m1_words(_weight(rng, "fp4_w", 72, 320))
    with pinned_tiles(linear=dict(linear=[_rule(None, block_m)], split_k=2)):
        got = _linear(x, w)
    with pinned_tiles(linear=dict(linear=[_rule(None, 16)], split_k=2)):
        dot = _linear(x, w)
    with flashrt.use_backend("reference"):
        want = ops.linear(x, w)
    assert rel_err(got, want) < 1e-3 and rel_err(got, dot) < 1e-3
    args, shared = _experts_case(rng, 2, 6, 2, 96, 64)
    args = (*args[:3], *(formats.with_e2m1_words(a) for a in args[3:6]), args[6])
    with pinned_tiles(moe=dict(experts=[_rule(16, block_m), _rule(None, 16)], pair_tiles=2)):
        with flashrt.use_backend("cuda"):
            got = ops.moe_experts(*args, shared=shared)
    with pinned_tiles(moe=dict(pair_tiles=2)), flashrt.use_backend("cuda"):
        dot = ops.moe_experts(*args, shared=shared)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, shared=shared)
    assert rel_err(got, want) < 2e-3 and rel_err(got, dot) < 2e-3


def test_pairs_mode_picks_the_one_row_rule():
    """In pairs mode a tile holds one row, so a rule for one row serves it whatever the mean rows
    per expert; with routing tables the mean rows per expert pick the rule."""
    rules = dict(experts=[_rule(1, 1), _rule(None, 16)], pair_tiles=1)
    with pinned_tiles(moe=rules):
        assert moe._plan(1, 6, 4, 64, 32)["block_m"] == 1  # 1.5 rows per expert, one row per pair tile
        assert moe._plan(2, 6, 4, 64, 32)["block_m"] == 16  # tables: 3 rows per expert
        assert moe._plan(2, 1, 8, 64, 32)["block_m"] == 1  # tables: 0.25 rows per expert


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["fp8_w", "fp4_w"])
@pytest.mark.parametrize("m", [1, 4])
def test_linear_few_rows_gpu(rng, fmt, m):
    """The released shapes' projections with one- and four-row tiles, split K over the SMs."""
    x = torch.randn(m, 5120, generator=rng).to(DEVICE, torch.bfloat16)
    w = _weight(rng, fmt, 2304, 5120)
    with pinned_tiles(linear=dict(linear=[[m, dict(BLOCK_M=m, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3,
                                                   split_min_blocks=1)]])):
        got, want = run_both("linear", x, w)
        assert_counters_zero(got)
    assert rel_err(got, want) < 1e-3
