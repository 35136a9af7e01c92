"""CUDA kernels of compress.py (compress_pool) and engram.py (engram_lookup, engram_gate)."""
import pytest
import torch

pytest.importorskip("triton")

from kernel_check import CountingKernel, DEVICE, rel_err, requires_kernels, run_both  # noqa: E402

import flashrt  # noqa: E402
from flashrt import dispatch, formats, ops  # noqa: E402
from flashrt.kernels_cuda import compress, engram  # noqa: E402

pytestmark = requires_kernels
DTYPES = [torch.float32, torch.bfloat16]


def _randn(shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def _check(got, want, tol):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) < tol


# -------------------------------------------------------------------------------- compress_pool


@pytest.mark.parametrize("B,G,r,D", [(1, 3, 2, 16), (2, 2, 5, 40), (1, 2, 40, 8), (2, 1, 1, 24)])
def test_compress_pool(B, G, r, D, rng):
    kv, score = _randn((B, G, r, D), rng), _randn((B, G, r, D), rng, scale=4.0)
    _check(*run_both("compress_pool", kv, score), 1e-5)


def test_compress_pool_extreme_scores(rng):
    """Large score gaps and -inf scores (a channel with one finite score takes that kv row)."""
    kv, score = _randn((1, 2, 4, 16), rng), _randn((1, 2, 4, 16), rng, scale=80.0)
    score[0, 0, 1:, :5] = float("-inf")
    _check(*run_both("compress_pool", kv, score), 1e-5)


def test_compress_pool_non_contiguous(rng):
    kv = _randn((2, 3, 4, 32), rng).transpose(1, 2).contiguous().transpose(1, 2)
    _check(*run_both("compress_pool", kv, _randn((2, 3, 4, 32), rng)), 1e-5)


# -------------------------------------------------------------------------------- engram_lookup


def _table(rows, dh, g):
    q = formats.quantize(torch.randn(rows, dh, generator=g) * torch.exp2(torch.randint(-8, 8, (rows, 1),
                                                                                      generator=g).float()), "fp8")
    return formats.QTensor(q.data.to(DEVICE), q.scale.to(DEVICE), "fp8", q.shape)


@pytest.mark.parametrize("dh", [32, 64, 96])
def test_engram_lookup_bit_exact(dh, rng):
    table = _table(50, dh, rng)
    ids = torch.randint(0, 50, (2, 3, 4), generator=rng).to(DEVICE)
    got, want = run_both("engram_lookup", table, ids)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_engram_lookup_narrowed_table(rng):
    table = _table(60, 64, rng).narrow(0, 10, 40)
    ids = torch.tensor([[[0, 39, 5]]], device=DEVICE)
    got, want = run_both("engram_lookup", table, ids)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# ---------------------------------------------------------------------------------- engram_gate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,hc,D", [(1, 2, 4, 32), (2, 1, 3, 100), (1, 1, 2, 9000)])
def test_engram_gate(B, S, hc, D, dtype, rng):
    h, key = _randn((B, S, hc, D), rng, dtype), _randn((B, S, hc, D), rng, dtype)
    value, weight = _randn((B, S, D), rng, dtype), _randn((hc, D), rng)
    _check(*run_both("engram_gate", h, key, value, weight, 1e-6), 1e-5 if dtype == torch.float32 else 1e-2)


def test_engram_gate_small_and_negative_d(rng):
    """d near 0 (the 1e-6 floor) and both signs of d."""
    h = _randn((1, 4, 2, 64), rng)
    key = torch.stack([h[:, :, 0], -h[:, :, 1]], 2) * 1e-3
    key[0, 0] = 0.0
    _check(*run_both("engram_gate", h, key, _randn((1, 4, 64), rng), torch.ones(2, 64, device=DEVICE), 1e-6), 1e-5)


def test_empty(rng):
    empty = torch.zeros(1, 0, 2, 8, device=DEVICE)
    _check(*run_both("compress_pool", empty, empty), 1e-5)
    got, want = run_both("engram_lookup", _table(5, 32, rng), torch.zeros(1, 0, 3, dtype=torch.int64, device=DEVICE))
    assert got.shape == want.shape == (1, 0, 3, 32)
    x = torch.zeros(1, 0, 4, 8, device=DEVICE)
    _check(*run_both("engram_gate", x, x, x[:, :, 0], torch.ones(4, 8, device=DEVICE), 1e-6), 1e-5)


def test_supports_and_dispatch(rng, monkeypatch):
    h64 = torch.randn(1, 1, 2, 8, dtype=torch.float64, device=DEVICE)
    assert "h: dtype torch.float64 is not served" in engram.FAMILY.serves("engram_gate", h64, h64, h64[:, :, 0], h64[0, 0],
                                                                            1e-6)
    calls = []
    monkeypatch.setattr(engram, "_engram_lookup_kernel", CountingKernel(engram._engram_lookup_kernel, calls))
    monkeypatch.setattr(compress, "_compress_pool_kernel", CountingKernel(compress._compress_pool_kernel, calls))
    assert dispatch.backends()["cuda"].ops["engram_gate"] is engram.engram_gate
    with flashrt.use_backend("cuda"):
        ops.engram_lookup(_table(4, 32, rng), torch.zeros(1, 1, 1, dtype=torch.int64, device=DEVICE))
        ops.compress_pool(_randn((1, 1, 2, 8), rng), _randn((1, 1, 2, 8), rng))
    assert len(calls) == 2


# ------------------------------------------------------------------------------ realistic, GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("B,G,r,D", [(1, 2048, 2, 512), (8, 64, 4, 512), (1, 256, 128, 512)])
def test_gpu_compress_pool_realistic(B, G, r, D, rng):
    _check(*run_both("compress_pool", _randn((B, G, r, D), rng), _randn((B, G, r, D), rng, scale=4.0)), 1e-5)


@pytest.mark.gpu
def test_gpu_engram_realistic(rng):
    table = _table(1 << 18, 256, rng)
    ids = torch.randint(0, 1 << 18, (64, 1, 24), generator=rng).to(DEVICE)
    got, want = run_both("engram_lookup", table, ids)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    h, key = _randn((2, 512, 4, 5120), rng, torch.bfloat16), _randn((2, 512, 4, 5120), rng, torch.bfloat16)
    value, weight = _randn((2, 512, 5120), rng, torch.bfloat16), _randn((4, 5120), rng)
    _check(*run_both("engram_gate", h, key, value, weight, 1e-6), 1e-2)
