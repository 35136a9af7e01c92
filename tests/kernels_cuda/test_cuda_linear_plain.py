"""``linear`` with plain bf16 / fp16 weights on the CUDA backend (kernels_cuda/linear_plain.py)
against a float64 computation and the reference backend: bf16 / fp16 x in the weight's dtype, fp32 x
with a bf16 weight (the three-part split: fp32 accuracy), split K, odd sizes, batched x, and the
calls it declines."""
import pytest
import torch

from flashrt import ops
from kernel_check import DEVICE, GPU, launches, requires_kernels, rel_err, run_both  # noqa: F401 (launches: a fixture)

pytestmark = requires_kernels
lp = pytest.importorskip("flashrt.kernels_cuda.linear_plain")
lin = pytest.importorskip("flashrt.kernels_cuda.linear")


def _exact(x, w):
    return (x.double() @ w.double().T)


@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (5, 70, 100), (40, 129, 200), (3, 33, 32)])
@pytest.mark.parametrize("xdt,wdt", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                     (torch.float32, torch.bfloat16)])
def test_plain_linear_matches_float64_and_the_reference(rng, monkeypatch, split, m, n, k, xdt, wdt):
    monkeypatch.setitem(lp.TILES, "split_k", split)
    x = torch.randn(m, k, generator=rng).to(xdt).to(DEVICE)
    w = (torch.randn(n, k, generator=rng) * k ** -0.5).to(wdt).to(DEVICE)
    assert lin.FAMILY.serves("linear", x, w) is None
    got, want = run_both("linear", x, w)
    assert got.dtype == want.dtype == xdt and got.shape == (m, n)
    exact = _exact(x, w)
    if xdt == torch.float32:  # fp32 accuracy: the split is exact, products exact, sums in fp32
        assert rel_err(got, exact) < 2e-6 and rel_err(got, want) < 2e-6
    else:  # one rounding of an fp32 sum to the output dtype
        tol = 4e-3 if xdt == torch.bfloat16 else 5e-4
        assert rel_err(got, exact) < tol
        assert (got.float() - want.float()).abs().max() <= 2 * exact.abs().max() * 2.0 ** -7


def test_the_split_keeps_what_one_bf16_part_loses(rng):
    """fp32 inputs with more than bf16's 8 significant bits: one bf16 dot would be ~1e-3 off."""
    x = torch.randn(4, 256, generator=rng).to(DEVICE) * (1 + 2.0 ** -12)
    w = torch.randn(96, 256, generator=rng).to(torch.bfloat16).to(DEVICE)
    got = lp.plain_linear(x, w)
    one_part = (x.to(torch.bfloat16).double() @ w.double().T)
    exact = _exact(x, w)
    assert rel_err(got, exact) < 2e-6 < rel_err(one_part, exact)


def test_batched_x_and_empty(rng):
    x = torch.randn(2, 3, 64, generator=rng).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(48, 64, generator=rng).to(torch.bfloat16).to(DEVICE)
    got, want = run_both("linear", x, w)
    assert got.shape == (2, 3, 48) and rel_err(got, want) < 4e-3
    empty = lp.plain_linear(x[:, :0], w)
    assert empty.shape == (2, 0, 48)


def test_declined_calls_go_to_the_reference(rng):
    x32 = torch.randn(3, 64, generator=rng).to(DEVICE)
    for w in (torch.randn(8, 64, generator=rng).to(DEVICE),  # fp32 weight
              torch.randn(8, 64, generator=rng).half().to(DEVICE)):  # fp32 x, fp16 weight
        assert lin.FAMILY.serves("linear", x32, w) is not None
    x16 = x32.half()
    assert lin.FAMILY.serves("linear", x16, torch.randn(8, 64, generator=rng).bfloat16().to(DEVICE))  # mixed
    out = ops.linear(x32, torch.randn(8, 64, generator=rng).to(DEVICE))  # automatic choice: served anyway
    assert out.shape == (3, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("m,n,k", [(1, 129280, 1024), (8, 512, 1024), (64, 4096, 1024), (2048, 512, 4096)])
def test_plain_linear_realistic(rng, m, n, k):
    """The model's plain linears: the head (fp32), compressor (fp32), indexer weights / groups (bf16)."""
    for xdt in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k, generator=rng).to(xdt).to(DEVICE)
        w = (torch.randn(n, k, generator=rng) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
        got, want = run_both("linear", x, w)
        exact = _exact(x, w)
        if xdt == torch.float32:  # exact products, the tensor cores' fp32 accumulation (docs/performance.md)
            assert rel_err(got, exact) < 1e-5  # bf16 rounding of x would give ~2e-3
        else:
            assert rel_err(got, want) < 4e-3


@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize("m,G,k,out,xdt", [(1, 2, 128, 32, torch.bfloat16), (5, 4, 64, 48, torch.bfloat16),
                                           (3, 2, 96, 64, torch.float32), (17, 8, 64, 16, torch.bfloat16)])
def test_grouped_linear_is_one_launch(rng, monkeypatch, launches, split, m, G, k, out, xdt):
    """``grouped_linear``: group g of x times its rows of the weight, all groups in one launch
    (column tiles inside one group), against float64 per group and the reference."""
    monkeypatch.setitem(lp.TILES, "split_k", split)
    x = torch.randn(m, 1, G, k, generator=rng).to(xdt).to(DEVICE)
    w = (torch.randn(G * out, k, generator=rng) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
    got, want = run_both("grouped_linear", x, w)
    assert launches[0] == "_plain_linear_kernel" and launches.count("_plain_linear_kernel") == 1
    assert got.dtype == want.dtype == xdt and got.shape == (m, 1, G * out)
    exact = torch.cat([_exact(x[:, 0, g], w[g * out:(g + 1) * out]) for g in range(G)], -1)
    assert rel_err(got[:, 0], exact) < (2e-6 if xdt == torch.float32 else 4e-3)


def test_grouped_linear_whose_groups_no_tile_fits_runs_a_launch_per_group(rng, launches):
    x = torch.randn(3, 2, 64, generator=rng).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(2 * 40, 64, generator=rng) * 0.125).to(torch.bfloat16).to(DEVICE)  # 40 columns a group
    got, want = run_both("grouped_linear", x, w)
    assert launches.count("_plain_linear_kernel") == 2 and got.shape == (3, 80)
    assert rel_err(got, want) < 4e-3


@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize("m,n,k", [(1, 128, 64), (5, 70, 100)])
def test_fp32_sums_of_bf16_rows_equal_the_cast_path(rng, monkeypatch, launches, split, m, n, k):
    """``linear(x, w, torch.float32)`` on bf16 rows (the compressor's ``wkv`` / ``wgate``): one
    launch, no cast before it, equal to the fp32-input path it replaces (``linear(x.float(), w)``,
    the same exact products) and within fp32 accuracy of the reference and float64."""
    monkeypatch.setitem(lp.TILES, "split_k", split)
    x = torch.randn(m, k, generator=rng).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=rng) * k ** -0.5).to(torch.bfloat16).to(DEVICE)
    assert lin.FAMILY.serves("linear", x, w, torch.float32) is None
    got, want = run_both("linear", x, w, torch.float32)
    assert launches == ["_plain_linear_kernel"]
    unfused, _ = run_both("linear", x.float(), w)
    assert got.dtype == want.dtype == torch.float32 and got.shape == (m, n)
    assert rel_err(got, unfused) < 2e-6 and rel_err(got, want) < 2e-6 and rel_err(got, _exact(x, w)) < 2e-6


def test_quantized_weight_with_another_output_dtype(rng):
    """fp8_w with ``out_dtype`` fp32 from bf16 x: the fp32-x result of the same activations."""
    x = torch.randn(3, 64, generator=rng).to(torch.bfloat16).to(DEVICE)
    w = ops.quantize((torch.randn(32, 64, generator=rng) * 0.1).to(DEVICE), "fp8_w")
    got, want = run_both("linear", x, w, torch.float32)
    fp32, _ = run_both("linear", x.float(), w)
    assert got.dtype == torch.float32 and torch.equal(got, fp32) and rel_err(got, want) < 2e-6
