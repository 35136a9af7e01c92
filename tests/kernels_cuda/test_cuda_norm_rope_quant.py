"""``norm_rope_quantize`` on the CUDA backend (kernels_cuda/norm_rope_quant.py): one launch for the
norm, the rope of the tail and the block quantization, against the reference (the three ops in
sequence) and against the three CUDA kernels it replaces; rows it does not serve in one program
(a length not a power of two, the switch off) run those three kernels."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import DEVICE, launches, pinned_tiles, rel_err, requires_kernels  # noqa: F401 (launches: a fixture)

pytestmark = requires_kernels
nrq = pytest.importorskip("flashrt.kernels_cuda.norm_rope_quant")


def _case(rng, B, S, D, P, dtype, norm):
    x = (torch.randn(B, S, D, generator=rng) * 3.0).to(DEVICE, dtype)
    w = (torch.randn(D, generator=rng) + 1.0).to(DEVICE, torch.bfloat16) if norm else None
    f = torch.polar(torch.ones(B, S, P), torch.rand(B, S, P, generator=rng) * 6.3).to(DEVICE)
    return x, w, float(torch.rand(1, generator=rng)) * 1e-3, f


def _close(got, want):
    """Same format and layout; the values agree to a quantization step on all but a rare element
    (a sum order may move a rounded input across a boundary)."""
    assert got.fmt == want.fmt and got.shape == want.shape and got.data.shape == want.data.shape
    a, b = formats.dequantize(got, torch.float32), formats.dequantize(want, torch.float32)
    assert (a - b).abs().max() <= 0.5 * b.abs().max()
    assert (got.data.view(torch.uint8) != want.data.view(torch.uint8)).float().mean() < 0.01


@pytest.mark.parametrize("fmt", ["fp8", "fp4_b16", "fp4_b32"])
@pytest.mark.parametrize("B,S,D,P,dtype,norm", [(1, 1, 64, 8, torch.bfloat16, True), (3, 5, 128, 32, torch.bfloat16, False),
                                                (2, 3, 256, 16, torch.float32, True), (1, 7, 512, 32, torch.bfloat16, True)])
def test_one_launch_against_the_reference_and_the_three_kernels(rng, launches, fmt, B, S, D, P, dtype, norm):
    x, w, eps, f = _case(rng, B, S, D, P, dtype, norm)
    with pinned_tiles(norm_rope_quant={}):
        got = nrq.norm_rope_quantize(x, w, eps, f, fmt)
    assert launches == ["_norm_rope_quant_kernel"]
    with flashrt.use_backend("reference"):
        want = ops.norm_rope_quantize(x, w, eps, f, fmt)
    _close(got, want)
    launches.clear()
    with pinned_tiles(norm_rope_quant={"norm_rope_quantize": {"in_kernel": False}}):
        three = nrq.norm_rope_quantize(x, w, eps, f, fmt)
    assert launches == (["_rms_norm_kernel"] if norm else []) + ["_rope_kernel", "_quantize_kernel"]
    _close(got, three)


@pytest.mark.parametrize("fmt", ["fp8", "fp4_b16", "fp4_b32"])
@pytest.mark.parametrize("B,S,H,D,P,out", [(1, 1, 4, 32, 8, torch.bfloat16), (2, 3, 8, 128, 32, torch.bfloat16),
                                           (1, 2, 2, 64, 16, torch.float32)])
def test_fake_quant_of_heads_in_one_launch_bit_identical_to_the_three_kernels(rng, launches, fmt, B, S, H, D, P, out):
    """The indexer's queries: ``[B, S, H, D]`` heads sharing a row's table entry, rope then a fake
    quantization; the unfused path (rope, quantize, dequantize kernels) gives the same bits (no
    sum in between), and the reference the same values."""
    x = (torch.randn(B, S, H, D, generator=rng) * 3.0).to(DEVICE, torch.bfloat16)
    f = torch.polar(torch.ones(B, S, P), torch.rand(B, S, P, generator=rng) * 6.3).to(DEVICE)
    with pinned_tiles(norm_rope_quant={}):
        got = nrq.norm_rope_quantize(x, None, 0.0, f, fmt, out)
    assert launches == ["_norm_rope_quant_kernel"]
    launches.clear()
    with pinned_tiles(norm_rope_quant={"norm_rope_quantize": {"in_kernel": False}}):
        three = nrq.norm_rope_quantize(x, None, 0.0, f, fmt, out)
    assert launches == ["_rope_kernel", "_quantize_kernel", "_dequantize_kernel"]
    assert got.dtype == out and got.shape == x.shape and torch.equal(got, three)
    with flashrt.use_backend("reference"):
        want = ops.norm_rope_quantize(x, None, 0.0, f, fmt, out)
    assert (got != want).float().mean() < 0.01 and rel_err(got, want) <= 0.5


def test_rows_it_does_not_hold_run_the_three_kernels(rng, launches):
    x, w, eps, f = _case(rng, 2, 2, 96, 8, torch.bfloat16, True)  # 96: not a power of two
    with pinned_tiles(norm_rope_quant={}):
        got = nrq.norm_rope_quantize(x, w, eps, f, "fp8")
    assert launches == ["_rms_norm_kernel", "_rope_kernel", "_quantize_kernel"]
    with flashrt.use_backend("reference"):
        _close(got, ops.norm_rope_quantize(x, w, eps, f, "fp8"))


def test_the_backend_serves_the_block_formats_and_declines_int8(rng):
    x, w, eps, f = _case(rng, 1, 2, 64, 8, torch.bfloat16, True)
    assert nrq.FAMILY.serves("norm_rope_quantize", x, w, eps, f, "fp8") is None
    assert nrq.FAMILY.serves("norm_rope_quantize", x, w, eps, f, "int8") is not None
    with flashrt.use_backend("cuda"):
        q = ops.norm_rope_quantize(x, None, 0.0, f, "fp4_b16")
    assert q.fmt == "fp4_b16" and q.shape == x.shape


@pytest.mark.gpu
@pytest.mark.parametrize("B,S", [(64, 1), (1, 4096)])
def test_gpu_kv_rows_realistic(rng, B, S):
    """The released KV rows: 512 wide with rope on the last 64 (window fp8 with kv_norm, compressed
    entry fp4_b16 without), and 128-wide index keys (fp4_b32 with k_norm), decode and prefill."""
    for D, norm, fmt in ((512, True, "fp8"), (512, False, "fp4_b16"), (128, True, "fp4_b32")):
        x, w, eps, f = _case(rng, B, S, D, 32, torch.bfloat16, norm)
        with flashrt.use_backend("cuda"):
            got = ops.norm_rope_quantize(x, w, eps, f, fmt)
        with flashrt.use_backend("reference"):
            want = ops.norm_rope_quantize(x, w, eps, f, fmt)
        _close(got, want)


@pytest.mark.parametrize("B,S,H,D,P,dtype,norm", [(1, 1, 4, 64, 8, torch.bfloat16, True),
                                                  (2, 3, 8, 128, 32, torch.bfloat16, True),
                                                  (3, 2, 2, 256, 16, torch.float32, False)])
def test_no_quantization_one_launch_bit_identical_to_norm_and_rope(rng, launches, B, S, H, D, P, dtype, norm):
    """``fmt`` None (the attention's query heads, a unit-weight norm per head): one launch whose
    rows equal the norm and rope kernels' in sequence bit for bit, and the reference's values."""
    x = (torch.randn(B, S, H, D, generator=rng) * 3.0).to(DEVICE, dtype)
    w = torch.ones(D, dtype=dtype, device=DEVICE) if norm else None
    f = torch.polar(torch.ones(B, S, P), torch.rand(B, S, P, generator=rng) * 6.3).to(DEVICE)
    with pinned_tiles(norm_rope_quant={}):
        got = nrq.norm_rope_quantize(x, w, 1e-6, f, None)
    assert launches == ["_norm_rope_quant_kernel"]
    assert got.dtype == dtype and got.shape == x.shape
    launches.clear()
    with pinned_tiles(norm_rope_quant={"norm_rope_quantize": {"in_kernel": False}}):
        two = nrq.norm_rope_quantize(x, w, 1e-6, f, None)
    assert launches == (["_rms_norm_kernel"] if norm else []) + ["_rope_kernel"]
    assert torch.equal(got, two)
    with flashrt.use_backend("reference"):
        want = ops.norm_rope_quantize(x, w, 1e-6, f, None)
    assert rel_err(got, want) < 1e-2

