"""The ``gemv`` knob of a ``linear_plain.plain`` rule (kernels_cuda/gemv.py ``_plain_gemv_kernel``):
plain bf16 / fp16 weights as one activation row and BLOCK_N weight rows a program, fp32
multiply-adds. Against float64 and the reference on fresh random inputs: bf16 / fp16 / fp32 x,
several rows, ragged N and K, split K summed in the kernel or by a launch after it, the grouped
linear in one launch, and the MoE gate (fp32 sums) through it."""
import pytest
import torch

from kernel_check import DEVICE, GPU, assert_counters_zero, launches, pinned_tiles, rel_err, requires_kernels, \
    run_both  # noqa: F401 (launches: a fixture)

pytestmark = requires_kernels
lp = pytest.importorskip("flashrt.kernels_cuda.linear_plain")


def _rules(block_n=32, block_k=64, **knobs):
    return [[8, dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=2, gemv=True, **knobs)],
            [None, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)]]


def _exact(x, w):
    return x.double() @ w.double().T


@pytest.mark.parametrize("m,n,k,block_n,split,reduce", [(1, 72, 352, 32, None, True), (3, 72, 352, 64, 3, True),
                                                        (1, 130, 96, 128, 2, False), (5, 40, 160, 32, 2, True)])
@pytest.mark.parametrize("xdt,wdt", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                     (torch.float32, torch.bfloat16)])
def test_plain_gemv(rng, launches, m, n, k, block_n, split, reduce, xdt, wdt):
    x = torch.randn(m, k, generator=rng).to(xdt).to(DEVICE)
    w = (torch.randn(n, k, generator=rng) * k ** -0.5).to(wdt).to(DEVICE)
    with pinned_tiles(linear_plain=dict(plain=_rules(block_n), split_k=split, reduce_in_kernel=reduce)):
        plan = lp._plan(m, n, k, xdt, wdt, xdt, sms=lp.num_sms(x.device))
        assert plan["gemv"] and plan["grid"][0] == m * -(-n // block_n) and plan["split"] == (split or 1)
        got, want = run_both("linear", x, w)
        assert_counters_zero(got)
    assert "_plain_gemv_kernel" in launches and "_plain_linear_kernel" not in launches
    assert got.dtype == xdt and got.shape == (m, n)
    exact = _exact(x, w)
    if xdt == torch.float32:  # fp32 products and sums
        assert rel_err(got, exact) < 2e-6 and rel_err(got, want) < 2e-6
    else:  # one rounding of an fp32 sum to the output dtype
        assert rel_err(got, exact) < (4e-3 if xdt == torch.bfloat16 else 5e-4)


@pytest.mark.parametrize("m,rows,split", [(2, 2, None), (3, 4, 2), (5, 2, 3), (8, 4, None), (7, 4, None)])
def test_plain_gemv_several_rows_a_program(rng, launches, m, rows, split):
    """``gemv_rows``: a program's rows (a last row tile short of them where m is not a multiple)
    share one weight load; each row's output is its own, against float64 and the one-row GEMV."""
    n, k = 72, 352
    x = torch.randn(m, k, generator=rng).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=rng) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
    for_rows = dict(plain=_rules(32, gemv_rows=rows), split_k=split)
    with pinned_tiles(linear_plain=for_rows):
        plan = lp._plan(m, n, k, x.dtype, w.dtype, x.dtype, sms=lp.num_sms(x.device))
        assert plan["gemv"] and plan["constexprs"]["ROWS"] == rows
        assert plan["grid"][0] == -(-m // rows) * -(-n // 32)
        got, want = run_both("linear", x, w)
        assert_counters_zero(got)
    with pinned_tiles(linear_plain=dict(for_rows, plain=_rules(32))):
        one, _ = run_both("linear", x, w)
    assert "_plain_gemv_kernel" in launches and "_plain_linear_kernel" not in launches
    assert rel_err(got, _exact(x, w)) < 4e-3 and rel_err(got.float(), one.float()) < 1e-6


def test_the_warmup_launches_each_rows_variant_of_the_gemv_rules():
    """A GEMV rule with several rows a program launches variants of its own at 2 and 4 rows (up to its
    ``gemv_rows`` and row limit): the warm-up's plain linears take those row counts too."""
    from flashrt.kernels_cuda import gemv

    assert gemv.warmup_rows([[8, dict(gemv=True, gemv_rows=4)]]) == (2, 4)
    assert gemv.warmup_rows([[2, dict(gemv=True, gemv_rows=4)], [None, dict(gemv=True, gemv_rows=2)]]) == (2,)
    assert gemv.warmup_rows([[1, dict(gemv=True, gemv_rows=4)], [8, dict(gemv=False, gemv_rows=4)]]) == ()
    d = dict(dim=64, head_dim=32)
    with pinned_tiles(linear_plain=dict(plain=_rules(32, gemv_rows=4))):
        rows = {case.args[0].shape[0] for case in lp.warmup_cases(torch.device(DEVICE), d, torch.bfloat16)}
    with pinned_tiles(linear_plain=dict(plain=_rules(32))):
        one = {case.args[0].shape[0] for case in lp.warmup_cases(torch.device(DEVICE), d, torch.bfloat16)}
    assert rows == one | {2, 4} and not one & {2, 4}


@pytest.mark.parametrize("m,G,k,out", [(1, 2, 128, 32), (3, 4, 64, 64), (2, 8, 96, 32)])
def test_grouped_gemv_is_one_launch(rng, launches, m, G, k, out):
    """Group g of x times its rows of the weight, every group in one GEMV launch."""
    x = torch.randn(m, 1, G, k, generator=rng).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(G * out, k, generator=rng) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
    with pinned_tiles(linear_plain=dict(plain=_rules(32, gemv_rows=2))):
        got, want = run_both("grouped_linear", x, w)
    assert launches.count("_plain_gemv_kernel") == 1 and "_plain_linear_kernel" not in launches
    exact = torch.cat([_exact(x[:, 0, g], w[g * out:(g + 1) * out]) for g in range(G)], -1)
    assert got.shape == (m, 1, G * out) and rel_err(got[:, 0], exact) < 4e-3 and rel_err(got, want) < 4e-3


def test_the_gate_through_the_gemv(rng):
    """The MoE gate's fp32 logits come from the plain linear: the same picks and weights."""
    x = torch.randn(2, 96, generator=rng).to(torch.bfloat16).to(DEVICE)
    gate = (torch.randn(40, 96, generator=rng) * 96 ** -0.5).to(torch.bfloat16).to(DEVICE)
    bias = (torch.randn(40, generator=rng) * 0.1).to(DEVICE)
    with pinned_tiles(linear_plain=dict(plain=_rules(32))):
        (w_c, i_c), (w_r, i_r) = run_both("moe_route", x, gate, bias, 6, "sqrtsoftplus", True, 1.5)
    assert torch.equal(i_c, i_r) and rel_err(w_c, w_r) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("m,n,k,xdt", [(1, 129280, 1024, torch.float32), (1, 512, 5120, torch.bfloat16),
                                       (4, 4096, 1024, torch.bfloat16)])
def test_plain_gemv_realistic_gpu(rng, m, n, k, xdt):
    """The head and the indexer / compressor shapes at decode, K split over the SMs."""
    x = torch.randn(m, k, generator=rng).to(xdt).to(DEVICE)
    w = (torch.randn(n, k, generator=rng) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
    with pinned_tiles(linear_plain=dict(plain=[[8, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3,
                                                       split_min_blocks=1, gemv=True)]])):
        got, want = run_both("linear", x, w)
        assert_counters_zero(got)
    assert rel_err(got, _exact(x, w)) < (2e-6 if xdt == torch.float32 else 4e-3)
