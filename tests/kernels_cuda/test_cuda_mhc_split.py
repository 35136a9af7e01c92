"""``hc_coefficients`` with K split over programs (kernels_cuda/mhc_coefficients.py): few tokens take
``SPLIT_BLOCK_T``-token tiles over about ``PROGRAMS`` programs, many tokens the wide tiles; each token
tile's last split program sums the partials ``SUM_SPLITS`` at a time (one round or several) and runs
the Sinkhorn epilogue. Checked on fresh random inputs against a float64 computation and the
reference backend, with the grids launched, the ticket counters back at zero, and the in-kernel and
separate finish alike."""
import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_check import DEVICE, CountingKernel, assert_counters_zero, pinned_tiles, rel_err, requires_kernels  # noqa: E402

import flashrt  # noqa: E402
from flashrt import ops  # noqa: E402
from flashrt.kernels_cuda import mhc, mhc_coefficients as coef  # noqa: E402

pytestmark = requires_kernels
ITERS, EPS, NORM_EPS = 7, 1e-6, 1e-6


def _inputs(T, hc, D, g, dtype=torch.float32):
    x = (torch.randn(1, T, hc, D, generator=g) * 2.0).to(dtype).to(DEVICE)
    fn = (torch.randn((2 + hc) * hc, hc * D, generator=g) / math.sqrt(hc * D)).to(DEVICE)
    scale = (torch.rand(3, generator=g) * 2 + 0.1).to(DEVICE)
    base = (torch.randn((2 + hc) * hc, generator=g) * 0.5).to(DEVICE)
    return x, fn, scale, base


def _float64(x, fn, scale, base, iters, eps, norm_eps):
    """The mHC coefficients in float64 (independent of the backends; the kernels and the reference
    agree with it to 1e-5 relative, the bound of the other mHC kernel tests, on the GPU too)."""
    B, S, hc, _ = x.shape
    v = x.double().flatten(2)
    m = (v @ fn.double().T) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm_eps)
    s, b = scale.double(), base.double()
    pre = torch.sigmoid(m[..., :hc] * s[0] + b[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * s[1] + b[hc:2 * hc])
    c = torch.softmax((m[..., 2 * hc:] * s[2] + b[2 * hc:]).view(B, S, hc, hc), -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


def _check(got, args):
    exact = _float64(*args)
    with flashrt.use_backend("reference"):
        want = ops.hc_coefficients(*args)
    for g, w, e in zip(got, want, exact):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert rel_err(g, e) < 1e-5 and rel_err(g, w) < 1e-5


@pytest.fixture
def grids(monkeypatch):
    out = {"main": [], "finish": []}
    monkeypatch.setattr(coef, "_hc_coefficients_kernel", CountingKernel(coef._hc_coefficients_kernel, out["main"]))
    monkeypatch.setattr(coef, "_hc_finish_kernel", CountingKernel(coef._hc_finish_kernel, out["finish"]))
    return out


# (T, hc, D, hc_coefficients tiles, grid): few tokens with one or several rounds of SUM_SPLITS and a
# ragged last K chunk, several few-token tiles, the wide tiles split, and no split at all
CASES = [
    (1, 4, 64, dict(SPLIT_BLOCK_K=16, SUM_SPLITS=4), (1, 16)),
    (5, 4, 64, dict(SPLIT_BLOCK_K=16, SUM_SPLITS=16), (1, 16)),
    (37, 3, 40, dict(PROGRAMS=12, SPLIT_BLOCK_K=16, SUM_SPLITS=2), (3, 4)),
    (64, 4, 40, dict(PROGRAMS=6, SPLIT_BLOCK_K=16), (2, 3)),  # K = 160: 3 wide chunks of 64
    (64, 4, 24, dict(PROGRAMS=2), (2, 1)),
    (3, 2, 8, dict(SPLIT_BLOCK_K=16), (1, 1)),  # K = 16: one chunk, nothing to split
]


@pytest.mark.parametrize("in_kernel", [True, False])
@pytest.mark.parametrize("T,hc,D,tiles,grid", CASES)
def test_split_matches_float64_and_the_reference(rng, grids, T, hc, D, tiles, grid, in_kernel):
    args = (*_inputs(T, hc, D, rng), ITERS, EPS, NORM_EPS)
    with pinned_tiles(mhc={"hc_coefficients": tiles, "hc_finish": {"in_kernel": in_kernel}}):
        got = mhc.hc_coefficients(*args)
    assert [tuple(g) for g in grids["main"]] == [grid]
    split = grid[1] > 1
    assert len(grids["finish"]) == (split and not in_kernel)
    _check(got, args)
    assert_counters_zero(got[0])


def test_default_tiles_fill_the_sms_at_decode():
    """bf16 x on the GPU at small's decode shapes (K = 4 x 1024): one wave of at least 100 programs,
    SPLIT_BLOCK_T-token tiles, every split at least one K block."""
    with pinned_tiles():
        t = mhc.TILES["hc_coefficients"]
        for T in (1, 8, 16, 64):
            block_t, block_k, _, splits, k_per = mhc._hc_plan(T, 4096, None, True)
            programs = math.ceil(T / block_t) * splits
            assert 100 <= programs <= t["PROGRAMS"], (T, programs)
            assert block_t == t["SPLIT_BLOCK_T"] and (splits - 1) * k_per < 4096 <= splits * k_per
        block_t, _, warps, splits, _ = mhc._hc_plan(8192, 4096, None, True)
        assert (block_t, warps) == (128, 8) and math.ceil(8192 / 128) * splits <= t["PROGRAMS"]
        # the wide tiles split too, and their finishing rounds load as many partial rows as a small tile's
        for T, block_t in ((1, 16), (2048, 128)):
            plan = mhc._coefficients_plan(T, 4096, 4, None, True)
            assert plan["n_splits"] > 1 and plan["kernel"]["BLOCK_T"] == block_t
            assert plan["kernel"]["SUM_SPLITS"] * block_t == t["SUM_SPLITS"] * t["SPLIT_BLOCK_T"]


def test_split_is_deterministic_and_equals_no_split_up_to_the_sum_order(rng):
    args = (*_inputs(9, 4, 96, rng), 20, EPS, NORM_EPS)
    with pinned_tiles(mhc={"hc_coefficients_fp32": dict(BLOCK_K=16)}):
        a = mhc.hc_coefficients(*args, splits=24)
        b = mhc.hc_coefficients(*args, splits=24)
        one = mhc.hc_coefficients(*args, splits=1)
    for x, y, z in zip(a, b, one):
        assert torch.equal(x, y)
        assert rel_err(x, z) < 1e-6
    _check(a, args)


def test_bf16_x_split(rng):
    args = (*_inputs(3, 4, 128, rng, torch.bfloat16), ITERS, EPS, NORM_EPS)
    with pinned_tiles(mhc={"hc_coefficients": dict(SPLIT_BLOCK_K=16, SUM_SPLITS=8)}):
        got = mhc.hc_coefficients(*args)
    _check(got, args)
