"""Launch knobs of the plain-weight ``linear`` (kernels_cuda/linear_plain.py) rules, as the quantized
``linear``'s: ``min_block_n`` (narrower column tiles while they fit in the SMs) and
``split_min_blocks`` (K split when the output tiles do not fill them), picked by the rule the row
count selects. On fresh random inputs against float64 and the reference backend: plain and grouped
launches, bf16 / fp16 / fp32 x, fp32 output (the MoE gate), the grids launched, the ticket counters
back at zero, and the default knobs keeping today's plans."""
import pytest
import torch

import flashrt
from flashrt import ops
from kernel_check import DEVICE, CountingKernel, assert_counters_zero, pinned_tiles, rel_err, requires_kernels

pytestmark = requires_kernels
lp = pytest.importorskip("flashrt.kernels_cuda.linear_plain")
from flashrt.kernels_cuda.launch import cdiv, split_k  # noqa: E402

TILE = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=2)
WIDE = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)


def _rules(small=None, mid=None, big=None):
    """Three rules (<= 4 rows, <= 32 rows, any) with these knobs merged in."""
    return {"plain": [[4, {**TILE, **(small or {})}], [32, {**WIDE, **(mid or {})}], [None, {**WIDE, **(big or {})}]]}


@pytest.fixture
def grids(monkeypatch):
    seen = []
    monkeypatch.setattr(lp, "_plain_linear_kernel", CountingKernel(lp._plain_linear_kernel, seen))
    return seen


def _sms(monkeypatch, n):
    monkeypatch.setattr(lp, "num_sms", lambda device: n)


def _inputs(rng, m, n, k, xdt, wdt=torch.bfloat16):
    x = torch.randn(m, k, generator=rng).to(xdt).to(DEVICE)
    w = (torch.randn(n, k, generator=rng) * k ** -0.5).to(wdt).to(DEVICE)
    return x, w


def _check(got, x, w, xdt):
    exact = x.double() @ w.double().T
    with flashrt.use_backend("reference"):
        want = ops.linear(x, w)
    tol = 2e-6 if xdt == torch.float32 else 4e-3 if xdt == torch.bfloat16 else 5e-4
    assert rel_err(got, exact) < tol and rel_err(got.float(), want.float()) < 2 * tol


# (rows, n, k, knobs of the rule the rows select, SMs, grid): narrow + split, split only, narrow
# only, and knobs set on another rule (the launch as without them)
CASES = [
    (3, 96, 200, dict(small=dict(min_block_n=32, split_min_blocks=1)), 8, (3, 1, 4)),
    (3, 96, 200, dict(small=dict(split_min_blocks=1)), 8, (1, 1, 7)),
    (3, 96, 200, dict(small=dict(min_block_n=32, split_min_blocks=None)), 8, (3, 1, 1)),
    (20, 100, 160, dict(mid=dict(min_block_n=32, split_min_blocks=2)), 16, (4, 1, 2)),
    (20, 100, 160, dict(small=dict(min_block_n=32, split_min_blocks=1)), 16, (2, 1, 1)),
]


@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k,knobs,sms,grid", CASES)
def test_knobs_narrow_and_split_and_match(rng, grids, monkeypatch, m, n, k, knobs, sms, grid, xdt):
    _sms(monkeypatch, sms)
    x, w = _inputs(rng, m, n, k, xdt, torch.float16 if xdt == torch.float16 else torch.bfloat16)
    with pinned_tiles(linear_plain=_rules(**knobs)):
        got = lp.plain_linear(x, w)
    assert [tuple(g) for g in grids] == [grid]
    assert got.dtype == xdt and got.shape == (m, n)
    _check(got, x, w, xdt)
    assert_counters_zero(got)


def test_fp32_output_of_a_bf16_x_split(rng, grids, monkeypatch):
    """The MoE gate's call: bf16 x, fp32 sums kept (no rounding to bf16)."""
    _sms(monkeypatch, 8)
    x, w = _inputs(rng, 2, 32, 256, torch.bfloat16)
    with pinned_tiles(linear_plain=_rules(small=dict(min_block_n=32, split_min_blocks=1))):
        got = lp.plain_linear(x, w, out_dtype=torch.float32)
    assert grids[0][2] > 1 and got.dtype == torch.float32
    assert rel_err(got, x.double() @ w.double().T) < 1e-5  # fp32 sums (tensor cores: truncating adds)


@pytest.mark.parametrize("m", [1, 6, 25])
def test_grouped_narrow_tiles_stay_inside_a_group(rng, grids, monkeypatch, m):
    """G = 4 groups of 64 columns: tiles narrowed to 32 (never straddling two groups), K split."""
    _sms(monkeypatch, 40)
    G, k, per = 4, 96, 64
    x = torch.randn(m, G, k, generator=rng).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(G * per, k, generator=rng) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
    knob = dict(min_block_n=32, split_min_blocks=1)
    with pinned_tiles(linear_plain=_rules(small=knob, mid=knob, big=knob)):
        got = lp.grouped_linear(x, w)
    assert len(grids) == 1 and grids[0][0] == G * per // 32
    exact = torch.einsum("mgk,gnk->mgn", x.double(), w.double().view(G, per, k)).reshape(m, G * per)
    assert rel_err(got, exact) < 4e-3
    assert_counters_zero(got)


@pytest.mark.parametrize("m,n,k", [(1, 2048, 1024), (8, 32, 1024), (64, 2048, 2048), (64, 129280, 1024), (300, 512, 512)])
def test_default_knobs_keep_the_plans(monkeypatch, m, n, k):
    """Without knobs in the profile: the rule's BLOCK_N and launch.split_k's split (min 4 blocks)."""
    with pinned_tiles():
        p = lp._plan(m, n, k, torch.bfloat16, torch.bfloat16, torch.bfloat16, sms=132)
        t = next(tile for limit, tile in lp.TILES["plain"] if limit is None or m <= limit)
    assert p["constexprs"]["BLOCK_N"] == t["BLOCK_N"] and p["constexprs"]["BLOCK_M"] == t["BLOCK_M"]
    tiles = cdiv(m, t["BLOCK_M"]) * cdiv(n, t["BLOCK_N"])
    blocks = cdiv(k, t["BLOCK_K"])
    want = split_k(tiles, blocks, None, 132)
    assert p["split"] == cdiv(k, cdiv(blocks, want) * t["BLOCK_K"])
    assert not {"min_block_n", "split_min_blocks"} & set(p["constexprs"])
