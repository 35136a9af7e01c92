"""Fused decode paths of the GEMM kernels against their unfused forms and the reference.

- ``linear`` / ``moe_experts`` up to ``fused_max_rows`` / ``fused_max_tokens`` rows quantize the
  activations inside the GEMM (no ``act_quant`` launch): the bytes are those of ``act_quant``, so
  the results equal the unfused path's bit for bit;
- a split K is summed by each output tile's last program (kernels_cuda/splitk.py), for the
  quantized and the plain-weight linear: one launch, the counters left at zero for the next.
Shapes are odd on purpose (rows, outputs and K blocks that fill no tile). Each test sets its
tiles through a pinned profile (``kernel_check.pinned_tiles``), so the device's profile (h200.yaml
sets ``linear.fused_max_rows``, ``moe.fused_max_tokens`` and the GEMM tiles) changes no path.
"""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import (DEVICE, GPU, assert_counters_zero, launches, pinned_tiles, requires_kernels,  # noqa: F401
                          rel_err, run_both)  # (launches: a fixture)

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
plain = pytest.importorskip("flashrt.kernels_cuda.linear_plain")
moe = pytest.importorskip("flashrt.kernels_cuda.moe")

SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)


def _randn(rng, *shape, scale=1.0):
    return (torch.randn(*shape, generator=rng) * scale).to(DEVICE)


def _weight(rng, fmt, *shape):
    return formats.quantize(_randn(rng, *shape, scale=0.25), fmt)


def _cuda(op, *args):
    with flashrt.use_backend("cuda"):
        return getattr(ops, op)(*args)


@pytest.mark.parametrize("promote", [True, False])
@pytest.mark.parametrize("fmt", ["fp8_w", "fp4_w"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,split", [(5, 40, 96, 1), (3, 72, 160, 2), (17, 33, 224, 3)])
def test_linear_fused_equals_unfused(rng, launches, promote, fmt, dtype, m, n, k, split):
    tiles = dict(fp8_mma=promote, linear=((None, SMALL),), split_k=split, fused_max_rows=64)
    x, w = _randn(rng, m, k, scale=3.0).to(dtype), _weight(rng, fmt, n, k)
    with pinned_tiles(linear=tiles):
        fused = _cuda("linear", x, w)
    assert launches == ["_linear_kernel"]  # no act_quant, no sum, no cast
    assert_counters_zero(fused)
    with pinned_tiles(linear={**tiles, "fused_max_rows": 0}):
        unfused = _cuda("linear", x, w)
    assert len(launches) > 1 and launches[1] == "_quantize_kernel"
    assert fused.dtype == dtype and fused.shape == (m, n)
    if split <= 2:  # a + b: the same fp32 sum in either order
        assert torch.equal(fused, unfused)
    _, want = run_both("linear", x, w)
    assert rel_err(fused, want) < (1e-5 if dtype == torch.float32 else 1e-2 if split > 1 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,split", [(3, 72, 160, 2), (17, 33, 224, 3)])
def test_linear_split_reduce_after_act_quant(rng, launches, dtype, m, n, k, split):
    """The ``split_reduce`` knob: past ``fused_max_rows`` (x quantized by act_quant) the split K is
    still summed by each tile's last program (act_quant + one GEMM launch, no sum and cast), the
    reference's values; ``False`` forces the sum and cast launches where x is quantized inside."""
    rule = dict(SMALL, split_reduce=True)
    tiles = dict(linear=((None, rule),), split_k=split, fused_max_rows=0)
    x, w = _randn(rng, m, k, scale=3.0).to(dtype), _weight(rng, "fp8_w", n, k)
    with pinned_tiles(linear=tiles):
        plan = lin._linear_plan(m, n, k, dtype, "fp8_w")
        got = _cuda("linear", x, w)
    assert not plan["fused"] and plan["reduce"] and plan["split"] > 1
    assert launches == ["_quantize_kernel", "_linear_kernel"]
    assert_counters_zero(got)
    _, want = run_both("linear", x, w)
    assert got.dtype == dtype and rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    with pinned_tiles(linear=dict(tiles, linear=((None, dict(SMALL, split_reduce=False)),), fused_max_rows=64)):
        plan = lin._linear_plan(m, n, k, dtype, "fp8_w")
        summed = _cuda("linear", x, w)
    assert plan["fused"] and not plan["reduce"] and plan["split"] > 1
    assert rel_err(summed, got.double()) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,split", [(1, 40, 192, 3), (7, 100, 320, 4)])
def test_plain_linear_reduces_in_kernel(rng, launches, xdt, m, n, k, split):
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    tiles = dict(plain=((None, tile),), split_k=split, reduce_in_kernel=True)
    x, w = _randn(rng, m, k).to(xdt), _randn(rng, n, k, scale=0.1).to(torch.bfloat16)
    with pinned_tiles(linear_plain=tiles):
        got = _cuda("linear", x, w)
        assert launches == ["_plain_linear_kernel"]
        assert_counters_zero(got)
        gate = plain.plain_linear(x, w, out_dtype=torch.float32)  # the MoE gate's fp32 output
        assert_counters_zero(gate)
    want = x.double() @ w.double().T
    assert got.dtype == xdt and rel_err(got, want) < (1e-5 if xdt == torch.float32 else 1e-2)
    assert gate.dtype == torch.float32 and rel_err(gate, want) < (1e-5 if xdt == torch.float32 else 1e-3)
    with pinned_tiles(linear_plain={**tiles, "reduce_in_kernel": False}):
        assert rel_err(_cuda("linear", x, w), got.double()) < (1e-6 if xdt == torch.float32 else 1e-2)


def test_split_k_counters_shared_across_launches(rng):
    """Consecutive split launches with different tile counts reuse the pool: each finds zeros."""
    for m, n in ((1, 64), (9, 96), (1, 64)):
        x, w = _randn(rng, m, 128).to(torch.bfloat16), _weight(rng, "fp8_w", n, 128)
        with pinned_tiles(linear=dict(linear=((None, SMALL),), split_k=2, fused_max_rows=64)):
            got, want = run_both("linear", x, w)
        assert rel_err(got, want) < 1e-2
        assert_counters_zero(got)


@pytest.mark.parametrize("promote", [True, False])
@pytest.mark.parametrize("fmt,E,k,n", [("fp4_w", 3, 2, 5), ("fp8_w", 1, 1, 7), ("fp4_w", 5, 3, 11)])
def test_moe_up_quantizes_x_itself(rng, launches, promote, fmt, E, k, n):
    D, I = 96, 64
    x = _randn(rng, n, D, scale=3.0).to(torch.bfloat16)
    idx = torch.randint(0, E, (n, k), generator=rng, dtype=torch.int32).to(DEVICE)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    w = (_weight(rng, fmt, E, I, D), _weight(rng, fmt, E, I, D), _weight(rng, fmt, E, D, I))
    with pinned_tiles(linear=dict(fp8_mma=promote), moe=dict(fused_max_tokens=64)):
        fused = _cuda("moe_experts", x, rw, idx, *w, 10.0)
    assert "_quantize_kernel" not in launches
    with pinned_tiles(linear=dict(fp8_mma=promote), moe=dict(fused_max_tokens=0)):
        unfused = _cuda("moe_experts", x, rw, idx, *w, 10.0)
    assert "_quantize_kernel" in launches
    assert torch.equal(fused, unfused)
    _, want = run_both("moe_experts", x, rw, idx, *w, 10.0)
    assert rel_err(fused, want) < 1e-3


@pytest.mark.parametrize("splits, chunk", [(2, 8), (3, 2), (7, 8), (20, 8), (20, 4)])
@pytest.mark.parametrize("B,S,hc,D", [(1, 1, 4, 96), (2, 9, 3, 40)])
def test_hc_coefficients_finish_in_kernel(rng, launches, splits, chunk, B, S, hc, D):
    """A split K's partials summed and finished by each token tile's last split program: one launch,
    the finish kernel's results (the same sums in the same order: bit for bit in the interpreter; a
    GPU compile may contract a multiply-add differently in the two kernels, a last-bit difference).
    ``chunk`` splits are summed per load: fewer or more splits than a chunk, a ragged last chunk."""
    mhc = pytest.importorskip("flashrt.kernels_cuda.mhc")
    tiles = dict(hc_coefficients_fp32=dict(BLOCK_K=16), hc_finish=dict(in_kernel=True, SPLIT_CHUNK=chunk))
    x = _randn(rng, B, S, hc, D, scale=2.0)
    fn = _randn(rng, (2 + hc) * hc, hc * D) / (hc * D) ** 0.5
    scale, base = (torch.rand(3, generator=rng) * 2 + 0.1).to(DEVICE), _randn(rng, (2 + hc) * hc, scale=0.5)
    args = (x, fn, scale, base, 5, 1e-6, 1e-6)
    with pinned_tiles(mhc=tiles):
        got = mhc.hc_coefficients(*args, splits=splits)
    assert launches == ["_hc_coefficients_kernel"]
    assert_counters_zero(x)
    with pinned_tiles(mhc={**tiles, "hc_finish": dict(in_kernel=False, SPLIT_CHUNK=chunk)}):
        two = mhc.hc_coefficients(*args, splits=splits)
    assert launches[1:] == ["_hc_coefficients_kernel", "_hc_finish_kernel"]
    with flashrt.use_backend("reference"):
        want = ops.hc_coefficients(*args)
    for a, b, c in zip(got, two, want):
        assert (rel_err(a, b) < 1e-6 if GPU else torch.equal(a, b)) and rel_err(a, c) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,hc,D", [(1, 1, 4, 64), (2, 3, 3, 40), (1, 5, 1, 130)])
def test_hc_collapse_norm_one_launch(rng, launches, dtype, B, S, hc, D):
    """Collapse + RMS norm in one program per token: one launch, equal to the two kernels in
    sequence (the collapse rounded to x.dtype first) and to the reference; a row longer than
    ``MAX_BLOCK_D`` or the switch ``in_kernel`` off runs the two kernels."""
    mhc = pytest.importorskip("flashrt.kernels_cuda.mhc")
    norm_rope = pytest.importorskip("flashrt.kernels_cuda.norm_rope")
    x = _randn(rng, B, S, hc, D, scale=2.0).to(dtype)
    pre = torch.rand(B, S, hc, generator=rng).to(DEVICE) * 2 - 0.5
    w = _randn(rng, D).to(torch.bfloat16)
    eps = float(torch.rand(1, generator=rng)) * 1e-3
    with pinned_tiles(mhc={}):
        got = mhc.hc_collapse_norm(x, pre, w, eps)
    assert launches == ["_hc_collapse_norm_kernel"]
    two = norm_rope.rms_norm(mhc.hc_collapse(x, pre), w, eps)
    with flashrt.use_backend("reference"):
        want = ops.hc_collapse_norm(x, pre, w, eps)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == (B, S, D)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got, two) < tol and rel_err(got, want) < tol
    for key, value in (("MAX_BLOCK_D", 32), ("in_kernel", False)):
        del launches[:]
        with pinned_tiles(mhc={"hc_collapse_norm": {key: value}}, norm_rope={}):
            assert torch.equal(mhc.hc_collapse_norm(x, pre, w, eps), two)
        assert launches == ["_hc_collapse_kernel", "_rms_norm_kernel"]


@pytest.mark.parametrize("rule_mma", [True, False])
def test_a_rules_fp8_mma_knob_overrides_the_tile_for_its_rows(rng, rule_mma):
    """``fp8_mma`` on one rule (the decode rows) picks that rule's path whatever the family's tile
    says; the next rule keeps the tile's. Both paths against the reference."""
    other = not rule_mma
    tiles = dict(fp8_mma=other, linear=((4, dict(SMALL, fp8_mma=rule_mma)), (None, SMALL)), fused_max_rows=64)
    w = _weight(rng, "fp8_w", 40, 160)
    lin = pytest.importorskip("flashrt.kernels_cuda.linear")
    with pinned_tiles(linear=tiles):
        assert lin._linear_plan(3, 40, 160, torch.bfloat16, "fp8_w")["constexprs"]["PROMOTE"] == rule_mma
        assert lin._linear_plan(9, 40, 160, torch.bfloat16, "fp8_w")["constexprs"]["PROMOTE"] == other
        for m in (3, 9):
            x = _randn(rng, m, 160, scale=3.0).to(torch.bfloat16)
            got = _cuda("linear", x, w)
            _, want = run_both("linear", x, w)
            assert rel_err(got, want) < 1e-2
