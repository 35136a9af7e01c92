"""CUDA kernels of norm_rope.py (rms_norm, rope) and mhc.py (hc_coefficients, hc_collapse, hc_expand)."""
import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_check import (CountingKernel, DEVICE, assert_counters_zero, pinned_tiles, rel_err,  # noqa: E402
                          requires_kernels, run_both)

import flashrt  # noqa: E402
from flashrt import dispatch, ops  # noqa: E402
from flashrt.rope import rope_table  # noqa: E402
from flashrt.kernels_cuda import mhc, norm_rope  # noqa: E402

pytestmark = requires_kernels
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


def _randn(shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def _check(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) < _tol(dtype)


# ------------------------------------------------------------------------------------ rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 40), (1, 7), (2, 9000)])
def test_rms_norm(shape, dtype, rng):
    x = _randn(shape, rng, dtype, 3.0)
    w = _randn(shape[-1], rng, torch.bfloat16)  # any float weight dtype
    _check(*run_both("rms_norm", x, w, 1e-6), dtype)


def test_rms_norm_strided_rows(rng):
    x = _randn((6, 96), rng)[:, 16:80]
    _check(*run_both("rms_norm", x, _randn(64, rng), 1e-5), torch.float32)


# ---------------------------------------------------------------------------------------- rope


def _freqs(S, R, g, batch=None):
    angles = torch.randn(*((batch,) if batch else ()), S, R // 2, generator=g) * 3
    return torch.polar(torch.ones_like(angles), angles).to(DEVICE)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["SR", "BSR", "BSHR", "BSR-perseq", "BSHR-perseq"])
def test_rope(layout, dtype, inverse, rng):
    B, S, H, R = 2, 5, 3, 16
    shape = {"SR": (S, R), "BSR": (B, S, R), "BSHR": (B, S, H, R)}[layout.split("-")[0]]
    f = _freqs(S, R, rng, B if layout.endswith("perseq") else None)
    _check(*run_both("rope", _randn(shape, rng, dtype), f, inverse), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_on_a_slice(dtype, rng):
    """The model ropes q[..., -64:] of a wider head in place: strided x, table rows sliced too."""
    x = _randn((2, 4, 3, 40), rng, dtype)[..., -16:]
    f = rope_table(16, 32, 10000.0).to(DEVICE)[7:11]
    _check(*run_both("rope", x, f), dtype)
    _check(*run_both("rope", x, f, True), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,pairs,per_seq", [((2, 3, 3, 40), 8, False), ((2, 5, 24), 3, True), ((7, 10), 1, False)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_table(dtype, shape, pairs, per_seq, inverse, rng):
    """A table of P < R/2 pairs: the last 2P channels rotate, the head is copied bit for bit, in one launch."""
    x = _randn(shape, rng, dtype)
    S = shape[1] if len(shape) >= 3 else shape[0]
    f = _freqs(S, 2 * pairs, rng, shape[0] if per_seq else None)
    got, want = run_both("rope", x, f, inverse)
    _check(got, want, dtype)
    assert torch.equal(got[..., :-2 * pairs], x[..., :-2 * pairs])


def test_rope_odd_pairs_and_strided_table(rng):
    """R/2 not a power of two (padded lanes masked); a table whose complex entries are not adjacent."""
    x = _randn((2, 3, 2, 12), rng)
    _check(*run_both("rope", x, _freqs(3, 12, rng)), torch.float32)
    _check(*run_both("rope", x, _freqs(3, 24, rng)[:, ::2], True), torch.float32)


# ------------------------------------------------------------------------------------------ mHC


def _hc_inputs(B, S, hc, D, dtype, g):
    x = _randn((B, S, hc, D), g, dtype, 2.0)
    fn = _randn(((2 + hc) * hc, hc * D), g) / math.sqrt(hc * D)
    scale = (torch.rand(3, generator=g) * 2 + 0.1).to(DEVICE)
    base = _randn((2 + hc) * hc, g, scale=0.5)
    return x, fn, scale, base


def _check_coeffs(got, want):
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,hc,D", [(1, 1, 4, 16), (2, 3, 4, 40), (1, 2, 3, 5), (2, 1, 1, 9), (1, 20, 4, 64)])
@pytest.mark.parametrize("iters", [1, 20])
def test_hc_coefficients(B, S, hc, D, dtype, iters, rng):
    args = (*_hc_inputs(B, S, hc, D, dtype, rng), iters, 1e-6, 1e-6)
    _check_coeffs(*run_both("hc_coefficients", *args))


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_hc_coefficients_split_k(splits, rng, monkeypatch):
    """K split over programs (partials + finish kernel), uneven splits and a ragged last chunk."""
    monkeypatch.setitem(mhc.TILES, "hc_coefficients_fp32", {**mhc.TILES["hc_coefficients_fp32"], "BLOCK_K": 16})
    x, fn, scale, base = _hc_inputs(2, 9, 4, 27, torch.float32, rng)  # K = 108: 7 chunks of 16
    assert mhc._hc_plan(18, 108, splits, False)[3] == min(splits, 7)
    got = mhc.hc_coefficients(x, fn, scale, base, 5, 1e-6, 1e-6, splits=splits)
    with flashrt.use_backend("reference"):
        want = ops.hc_coefficients(x, fn, scale, base, 5, 1e-6, 1e-6)
    _check_coeffs(got, want)


def test_hc_coefficients_plan_per_shape_and_split(rng, monkeypatch):
    """The launch plan is kept per (shape, split): a forced split between automatic ones at the same
    shape, and another shape, each get their own plan and match the reference."""
    monkeypatch.setitem(mhc.TILES, "hc_coefficients_fp32", {**mhc.TILES["hc_coefficients_fp32"], "BLOCK_K": 16})
    for S, splits in ((9, None), (9, 3), (9, None), (4, 3), (9, 3)):
        x, fn, scale, base = _hc_inputs(2, S, 4, 27, torch.float32, rng)
        got = mhc.hc_coefficients(x, fn, scale, base, 5, 1e-6, 1e-6, splits=splits)
        with flashrt.use_backend("reference"):
            want = ops.hc_coefficients(x, fn, scale, base, 5, 1e-6, 1e-6)
        _check_coeffs(got, want)
        plan = mhc.PLANS.lookup(("hc_coefficients", 2 * S, 108, 4, splits, False))[1]
        assert plan["n_splits"] == mhc._hc_plan(2 * S, 108, splits, False)[3], (S, splits, plan)
    assert len(mhc.PLANS) == 3


@pytest.mark.parametrize("fma_block_k", [None, 32])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_hc_coefficients_fma_tokens(splits, fma_block_k, rng, monkeypatch):
    """Up to FMA_T tokens the GEMV runs as fp32 multiply-adds in token tiles of the next power of
    two of T (split over K or not), in K blocks of FMA_BLOCK_K where set: the reference's values;
    past FMA_T the dot path again, in its own K blocks."""
    from flashrt import profiles

    fma_t = int(torch.randint(1, 6, (), generator=rng))
    monkeypatch.setitem(mhc.TILES, "hc_coefficients",
                        {**mhc.TILES["hc_coefficients"], "FMA_T": fma_t, "FMA_BLOCK_K": fma_block_k})
    monkeypatch.setitem(mhc.TILES, "hc_coefficients_fp32", {**mhc.TILES["hc_coefficients_fp32"], "BLOCK_K": 16})
    profiles._TILES_CACHE.clear()
    D = int(torch.randint(5, 40, (), generator=rng))
    for T in sorted({1, fma_t, int(torch.randint(1, fma_t + 1, (), generator=rng)), fma_t + 1}):
        plan = mhc._coefficients_plan(T, 4 * D, 4, splits, False)["kernel"]
        assert plan["FMA"] == (T <= fma_t), (T, fma_t)
        if T <= fma_t:
            assert plan["BLOCK_T"] == 1 << (T - 1).bit_length()
        assert plan["BLOCK_K"] == (fma_block_k or 16 if T <= fma_t else 16), (T, fma_t, plan["BLOCK_K"])
        x, fn, scale, base = _hc_inputs(T, 1, 4, D, torch.float32, rng)
        got = mhc.hc_coefficients(x, fn, scale, base, 7, 1e-6, 1e-6, splits=splits)
        with flashrt.use_backend("reference"):
            want = ops.hc_coefficients(x, fn, scale, base, 7, 1e-6, 1e-6)
        _check_coeffs(got, want)
    profiles._TILES_CACHE.clear()


@pytest.mark.parametrize("fma_t", [0, 8])
def test_hc_coefficients_value_major_finish(fma_t, rng):
    """``hc_finish.value_major``: the partials stored with each value's splits side by side and summed
    in one load by the last split program, where a token tile's splits fit ``SPLIT_ELEMS`` values
    (else the split-by-split finish): the reference's values and the other finish's to fp32
    rounding, on both GEMV paths, uneven and ragged splits; the ticket counters put back."""
    D = int(torch.randint(20, 60, (), generator=rng))
    T = int(torch.randint(1, 6, (), generator=rng))
    splits = int(torch.randint(2, 9, (), generator=rng))
    x, fn, scale, base = _hc_inputs(T, 1, 4, D, torch.float32, rng)
    with flashrt.use_backend("reference"):
        want = ops.hc_coefficients(x, fn, scale, base, 20, 1e-6, 1e-6)
    got = {}
    for vm in (False, True):
        tiles = dict(hc_coefficients=dict(FMA_T=fma_t, FMA_BLOCK_K=16), hc_coefficients_fp32=dict(BLOCK_K=16),
                     hc_finish=dict(value_major=vm))
        with pinned_tiles(mhc=tiles):
            plan = mhc._coefficients_plan(T, 4 * D, 4, splits, False)
            assert bool(plan["value_major"]) == vm and plan["n_splits"] > 1
            if vm:
                assert plan["value_major"]["SPLITS"] == 1 << (plan["n_splits"] - 1).bit_length()
            got[vm] = mhc.hc_coefficients(x, fn, scale, base, 20, 1e-6, 1e-6, splits=splits)
        _check_coeffs(got[vm], want)
    for a, b in zip(got[True], got[False]):
        assert rel_err(a, b) < 1e-6
    assert_counters_zero(got[True][0])
    with pinned_tiles(mhc=dict(hc_coefficients_fp32=dict(BLOCK_K=16), hc_finish=dict(value_major=True, SPLIT_ELEMS=16))):
        assert not mhc._coefficients_plan(T, 4 * D, 4, splits, False)["value_major"]  # over the one-load budget


@pytest.mark.parametrize("T", [1, 17, 40, 64, 65, 300, 4096])
def test_hc_plan_token_tiles(T):
    """bf16 token tiles: BLOCK_T_SMALL up to SMALL_T tokens, 128 from BIG_T on, else the power of
    two covering T within [16, BLOCK_T_MAX]; the K splits fill PROGRAMS and cover K exactly."""
    t = mhc._tiles()["hc_coefficients"]
    block_t, block_k, warps, n_splits, k_per = mhc._hc_plan(T, 4 * 5120, None, True)
    if T <= t["SMALL_T"]:
        want = min(max(16, 1 << (T - 1).bit_length()), t["BLOCK_T_SMALL"])
    elif T >= t["BIG_T"]:
        want = 128
    else:
        want = min(max(16, 1 << (T - 1).bit_length()), t["BLOCK_T_MAX"])
    assert block_t == want and warps == (8 if want >= 128 else 4)
    tiles = -(-T // block_t)
    assert n_splits * tiles <= max(t["PROGRAMS"], tiles)
    assert k_per % block_k == 0 and (n_splits - 1) * k_per < 4 * 5120 <= n_splits * k_per


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hc", [1, 3, 4])
def test_hc_collapse_expand(hc, dtype, rng):
    B, S, D = 2, 3, 40
    x = _randn((B, S, hc, D), rng, dtype)
    pre = torch.rand(B, S, hc, generator=rng).to(DEVICE)
    _check(*run_both("hc_collapse", x, pre), dtype)
    y = _randn((B, S, D), rng, dtype)
    comb = torch.rand(B, S, hc, hc, generator=rng).to(DEVICE)
    _check(*run_both("hc_expand", y, x, pre, comb), dtype)


def test_empty():
    x = torch.zeros(1, 0, 4, 8, device=DEVICE)
    _check(*run_both("rms_norm", x, torch.ones(8, device=DEVICE), 1e-6), torch.float32)
    got, want = run_both("rope", x, torch.zeros(0, 4, dtype=torch.complex64, device=DEVICE))
    assert got.shape == want.shape == x.shape
    fn, scale, base = torch.zeros(24, 32, device=DEVICE), torch.ones(3, device=DEVICE), torch.zeros(24, device=DEVICE)
    for a, b in zip(*run_both("hc_coefficients", x, fn, scale, base, 3, 1e-6, 1e-6)):
        assert a.shape == b.shape
    pre = torch.zeros(1, 0, 4, device=DEVICE)
    _check(*run_both("hc_collapse", x, pre), torch.float32)
    _check(*run_both("hc_expand", x[:, :, 0], x, pre, torch.zeros(1, 0, 4, 4, device=DEVICE)), torch.float32)


def test_supports_and_dispatch(rng, monkeypatch):
    x64 = torch.randn(2, 8, dtype=torch.float64, device=DEVICE)
    assert norm_rope.FAMILY.serves("rms_norm", x64, torch.ones(8, device=DEVICE), 1e-6) is not None
    big = torch.randn(1, 1, 9, 4, device=DEVICE)
    assert mhc.FAMILY.serves("hc_collapse", big, torch.ones(1, 1, 9, device=DEVICE)) == "x[2] = 9: served in [0, 8]"
    with flashrt.use_backend("cuda"), pytest.raises(flashrt.BackendError):
        ops.rms_norm(x64, torch.ones(8, dtype=torch.float64, device=DEVICE), 1e-6)
    calls = []
    monkeypatch.setattr(norm_rope, "_rms_norm_kernel", CountingKernel(norm_rope._rms_norm_kernel, calls))
    assert dispatch.backends()["cuda"].ops["hc_coefficients"] is mhc.hc_coefficients
    with flashrt.use_backend("cuda"):
        ops.rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
    assert len(calls) == 1


# ------------------------------------------------------------------------------ realistic, GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 5120), (64, 1, 5120), (1, 4096, 5120), (4096, 512), (1, 64, 1024)])
def test_gpu_rms_norm_realistic(shape, rng):
    x = _randn(shape, rng, torch.bfloat16, 3.0)
    _check(*run_both("rms_norm", x, _randn(shape[-1], rng), 1e-6), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("B,S", [(1, 8192), (64, 1)])
def test_gpu_rope_realistic(B, S, rng):
    q = _randn((B, S, 64, 512), rng, torch.bfloat16)[..., -64:]  # 64 heads x 512, rope on the last 64
    f = rope_table(64, 16384, 10000.0).to(DEVICE)[:S]
    _check(*run_both("rope", q, f), torch.bfloat16)
    _check(*run_both("rope", q, f, True), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8, 40, 64, 4096])  # 40: 16-token tiles, the last one ragged
def test_gpu_hc_realistic(T, dtype, rng):
    x, fn, scale, base = _hc_inputs(1, T, 4, 5120, dtype, rng)
    _check_coeffs(*run_both("hc_coefficients", x, fn, scale, base, 20, 1e-6, 1e-6))
    pre, post, comb = ops.hc_coefficients(x, fn, scale, base, 20, 1e-6, 1e-6)
    _check(*run_both("hc_collapse", x, pre), dtype)
    _check(*run_both("hc_collapse_norm", x, pre, _randn(5120, rng), 1e-6), dtype)
    _check(*run_both("hc_expand", x[:, :, 0], x, post, comb), dtype)
