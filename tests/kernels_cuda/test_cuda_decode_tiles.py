"""Decode-size launch knobs of the GEMM families against the reference, on fresh random inputs:

- ``moe_experts`` with K split over programs in the up and down kernels (``experts`` rule knobs
  ``split_k`` / ``split_min_blocks``): the last program of each output tile sums the fp32 partials
  and runs the SwiGLU + fp8 quantization (up) or the rounding and in-kernel combine (down); the
  shared-expert (direct) path and the separate combine launch too; the ticket counters left at zero;
- narrower column tiles where the programs do not fill the SMs (``min_block_n``), linear and moe;
- the grids launched (column tiles, row tiles, splits) follow the knobs, and without them the
  plans are today's (:func:`flashrt.kernels_cuda.launch.split_k`'s split, the rule's BLOCK_N).
"""
import pytest
import torch

from flashrt import formats
from kernel_check import (DEVICE, CountingKernel, assert_counters_zero, pinned_tiles, rel_err,  # noqa: F401
                          requires_kernels, run_both)

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
moe = pytest.importorskip("flashrt.kernels_cuda.moe")
from flashrt.kernels_cuda import launch  # noqa: E402

RULE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)


def _routed(rng, fmt, xdt, n, D, I, E, k):
    x = (torch.randn(n, D, generator=rng) * 3.0).to(DEVICE, xdt)
    idx = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(n)]).to(torch.int32).to(DEVICE)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    w = [formats.quantize(torch.randn(*s, generator=rng) * 0.25, fmt).to(DEVICE) for s in ((E, I, D), (E, I, D), (E, D, I))]
    return x, rw, idx, *w, 10.0


@pytest.fixture
def grids(monkeypatch):
    """{kernel name: [grid of each launch]} of the up, down and linear kernels."""
    out = {}
    for mod, name in ((moe, "_moe_up_kernel"), (moe, "_moe_down_kernel"), (lin, "_linear_kernel")):
        out[name] = []
        monkeypatch.setattr(mod, name, CountingKernel(getattr(mod, name), out[name]))
    return out


@pytest.mark.parametrize("fmt,xdt,n,D,I,E,k,split,in_kernel", [
    ("fp4_w", torch.bfloat16, 1, 96, 64, 8, 2, 3, True),
    ("fp8_w", torch.bfloat16, 5, 128, 96, 5, 3, 2, True),
    ("fp4_w", torch.float32, 6, 64, 32, 3, 2, 2, False),
    ("fp8_w", torch.bfloat16, 3, 96, 64, 1, 1, 3, True)])  # one expert, one slot: the direct path
def test_moe_split_k_matches_the_reference(rng, grids, fmt, xdt, n, D, I, E, k, split, in_kernel):
    args = _routed(rng, fmt, xdt, n, D, I, E, k)
    tiles = dict(combine=dict(in_kernel=in_kernel), experts=[[None, dict(RULE, split_k=split)]])
    with pinned_tiles(moe=tiles):
        got, want = run_both("moe_experts", *args)
    assert_counters_zero(got)
    (up,), (down,) = grids["_moe_up_kernel"], grids["_moe_down_kernel"]
    assert up[0] == launch.cdiv(I, 64) and down[0] == launch.cdiv(D, 64)
    assert up[2] == min(split, launch.cdiv(D, 32)) and down[2] == min(split, launch.cdiv(I, 32))
    assert rel_err(got, want) < 2e-3


def test_moe_split_k_equals_no_split_up_to_the_partial_sums(rng):
    """The split's only change is the fp32 sum order: the unsplit result within an fp32 rounding."""
    args = _routed(rng, "fp4_w", torch.float32, 4, 128, 64, 4, 2)
    outs = []
    for split in (None, 4):
        with pinned_tiles(moe=dict(experts=[[None, dict(RULE, split_k=split)]])):
            outs.append(run_both("moe_experts", *args)[0])
    assert rel_err(outs[1], outs[0]) < 1e-4


def test_moe_narrow_columns_and_adaptive_split_fill_the_sms(rng, grids, monkeypatch):
    """With 132 SMs: BLOCK_N 128 halves to min_block_n 32 (few programs), then K splits keep >= 1
    K block each; the grids are those :mod:`flashrt.kernels_cuda.splitk` plans."""
    monkeypatch.setattr(lin, "num_sms", lambda: 132)
    n, D, I, E, k = 2, 128, 64, 4, 2
    args = _routed(rng, "fp4_w", torch.bfloat16, n, D, I, E, k)
    rule = dict(RULE, BLOCK_N=128, min_block_n=32, split_min_blocks=1)
    with pinned_tiles(moe=dict(experts=[[None, rule]])):
        got, want = run_both("moe_experts", *args)
    rows = min(n * k, launch.cdiv(n * k, 16) + E)  # the routing tables' row tiles
    (up,), (down,) = grids["_moe_up_kernel"], grids["_moe_down_kernel"]
    assert up == (I // 32, rows, min(launch.cdiv(264, rows * I // 32), D // 32))
    assert down == (D // 32, rows, min(launch.cdiv(264, rows * D // 32), I // 32))
    assert rel_err(got, want) < 2e-3
    assert_counters_zero(got)


def test_moe_default_knobs_keep_the_launches(rng, grids, monkeypatch):
    """No knob set: one K split, the rule's BLOCK_N, as before the knobs (132 SMs, few programs)."""
    monkeypatch.setattr(lin, "num_sms", lambda: 132)
    args = _routed(rng, "fp8_w", torch.bfloat16, 2, 128, 64, 4, 2)
    with pinned_tiles(moe=dict(experts=[[None, RULE]])):
        run_both("moe_experts", *args)
    (up,), (down,) = grids["_moe_up_kernel"], grids["_moe_down_kernel"]
    assert up[0] == 1 and down[0] == 2 and up[2] == down[2] == 1


@pytest.mark.parametrize("fmt", ["fp8_w", "fp4_w"])
def test_linear_narrow_columns_and_split_blocks(rng, grids, monkeypatch, fmt):
    monkeypatch.setattr(lin, "num_sms", lambda: 132)
    m, n, k = 3, 96, 256
    x = (torch.randn(m, k, generator=rng)).to(DEVICE, torch.bfloat16)
    w = formats.quantize(torch.randn(n, k, generator=rng) * k ** -0.5, fmt).to(DEVICE)
    rule = dict(RULE, BLOCK_N=128, min_block_n=32, split_min_blocks=2)
    with pinned_tiles(linear=dict(linear=[[None, rule]])):
        got, want = run_both("linear", x, w)
    (grid,) = grids["_linear_kernel"]
    assert grid == (3, 4)  # 96 / 32 column tiles; 8 K blocks of 32, >= 2 a split
    assert rel_err(got, want) < 1e-3
    assert_counters_zero(got)


@pytest.mark.parametrize("m,n,k", [(1, 512, 1024), (8, 8192, 512), (64, 1024, 2048), (16, 5120, 6144)])
def test_linear_default_knobs_keep_the_split_rule(monkeypatch, m, n, k):
    """The plans without knobs split as launch.split_k does (at decode shapes of the small model)."""
    monkeypatch.setattr(lin, "num_sms", lambda: 132)
    with pinned_tiles():
        plan = lin._linear_plan(m, n, k, torch.bfloat16, "fp8_w")
        t = lin.pick_tile(lin.PLANS.tiles()["linear"], m)
    tiles = launch.cdiv(m, t["BLOCK_M"]) * launch.cdiv(n, t["BLOCK_N"])
    split = launch.split_k(tiles, launch.cdiv(k, t["BLOCK_K"]), None, 132)
    assert plan["grid"][0] == tiles and plan["split"] == launch.cdiv(k, launch.cdiv(launch.cdiv(k, split), t["BLOCK_K"])
                                                                      * t["BLOCK_K"])
    assert plan["constexprs"]["BLOCK_N"] == t["BLOCK_N"] and "min_block_n" not in plan["constexprs"]


def test_split_per_sm_brings_the_programs_nearest_to_the_target(rng):
    """``launch.split_k`` with ``per_sm``: among the counts that keep ``min_blocks`` K blocks a
    split, the one whose programs come nearest to ``per_sm`` an SM (the smaller on a tie), also
    where the output tiles alone fill the SMs; without ``per_sm``, today's rule."""
    for _ in range(300):
        tiles, blocks, sms, per_sm, min_blocks = (int(torch.randint(lo, hi, (1,), generator=rng))
                                                  for lo, hi in ((1, 600), (1, 80), (1, 140), (1, 9), (1, 5)))
        most = max(1, blocks // min_blocks)
        want = min(range(1, most + 1), key=lambda s: (abs(s * tiles - per_sm * sms), s))
        assert launch.split_k(tiles, blocks, None, sms, min_blocks, per_sm) == want, (tiles, blocks, sms, per_sm)
        legacy = launch.split_k(tiles, blocks, None, sms, min_blocks)
        assert legacy == (1 if tiles >= sms else max(1, min(launch.cdiv(2 * sms, tiles), blocks // min_blocks)))
        assert launch.split_k(tiles, blocks, None, sms, None, per_sm) == 1  # no min_blocks: never split


@pytest.mark.parametrize("fmt", ["fp8_w", "fp4_w"])
def test_split_per_sm_splits_launches_that_fill_the_sms(rng, grids, monkeypatch, fmt):
    """A rule with ``split_per_sm`` splits K of a linear and of both expert launches whose output
    tiles already fill the (here 8) SMs, to the planned count; results as the reference's, counters
    back at zero."""
    monkeypatch.setattr(lin, "num_sms", lambda: 8)
    per_sm = int(torch.randint(2, 5, (1,), generator=rng))
    m, n, k = 2, 512, 512
    x = torch.randn(m, k, generator=rng).to(DEVICE, torch.bfloat16)
    w = formats.quantize(torch.randn(n, k, generator=rng) * k ** -0.5, fmt).to(DEVICE)
    rule = dict(RULE, split_min_blocks=2, split_per_sm=per_sm)
    with pinned_tiles(linear=dict(linear=[[None, rule]])):
        got, want = run_both("linear", x, w)
    (grid,) = grids["_linear_kernel"]
    assert grid == (n // 64, launch.split_k(n // 64, k // 32, None, 8, 2, per_sm)) and grid[1] > 1
    assert rel_err(got, want) < 1e-3
    assert_counters_zero(got)
    n_tok, D, I, E, top = 1, 256, 256, 4, 2  # one token: a row tile a pair, 4 column tiles a launch
    args = _routed(rng, fmt, torch.bfloat16, n_tok, D, I, E, top)
    with pinned_tiles(moe=dict(experts=[[None, rule]])):
        got, want = run_both("moe_experts", *args)
    (up,), (down,) = grids["_moe_up_kernel"], grids["_moe_down_kernel"]
    for g, cols, depth in ((up, I, D), (down, D, I)):
        assert g[2] == launch.split_k(g[0] * g[1], depth // 32, None, 8, 2, per_sm) and (g[0], g[1]) == (cols // 64, 2)
    assert up[2] > 1 and down[2] > 1
    assert rel_err(got, want) < 2e-3
    assert_counters_zero(got)


KNOBS = dict(min_block_n=32, split_min_blocks=2)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("n", [1, 8, 64])
def test_small_decode_with_knobs_gpu_and_graph(rng, n):
    """``small``'s routed experts (32 fp4_w, top-4, D 1024, I 512) and its fp8_w shared expert with
    the decode knobs on every rule: the reference's result, the counters back at zero, and a CUDA
    graph of the call replaying to the eager result."""
    import flashrt

    routed = _routed(rng, "fp4_w", torch.bfloat16, n, 1024, 512, 32, 4)
    shared = _routed(rng, "fp8_w", torch.bfloat16, n, 1024, 512, 1, 1)
    rules = [[limit, dict(t, **KNOBS)] for limit, t in moe.PLANS.tiles()["experts"]]
    with pinned_tiles(moe=dict(experts=rules)):
        for args in (routed, shared):
            got, want = run_both("moe_experts", *args)
            assert rel_err(got, want) < 5e-3
            assert_counters_zero(got)
            with flashrt.use_backend("cuda"):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = moe.moe_experts(*args)
                graph.replay()
            assert torch.equal(out, got)
