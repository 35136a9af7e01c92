"""The reference's matmul ops give a row the same bits whatever the other rows of the call.

A one-token decode step, a speculative verify chunk and a prefill run the same row through GEMMs
of different heights; an fp32 GEMM's blocking (and so its rounding) depends on the height, and a
one-ulp difference can grow through the quantized KV into a different greedy token. Each op is
run on a chunk of random rows and on every row alone (and on a few sub-chunks): equal bit for bit.
"""
import pytest
import torch

from flashrt import refmath

HEIGHTS = (1, 2, 5, 7)


def assert_rows_invariant(fn, x: torch.Tensor):
    """``fn`` of x [1, S, ...] row-wise: every slice [a, a + h) gives the bits of the whole."""
    whole = fn(x)
    S = x.shape[1]
    for h in HEIGHTS:
        for a in range(0, S - h + 1, max(1, S // 4)):
            part = fn(x[:, a:a + h])
            got = part if isinstance(part, torch.Tensor) else part[0]
            want = whole if isinstance(whole, torch.Tensor) else whole[0]
            assert torch.equal(got, want[:, a:a + h]), f"rows [{a}, {a + h}) of {S} differ from the whole call"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_are_independent(rng, dtype):
    x = torch.randn(1, 37, 512, generator=rng).to(dtype)
    w = torch.randn(96, 512, generator=rng).to(dtype)
    assert_rows_invariant(lambda t: refmath.linear(t, w), x)


def test_hc_coefficients_rows_are_independent(rng):
    hc, dim = 4, 128
    x = torch.randn(1, 37, hc, dim, generator=rng).to(torch.bfloat16)
    fn = torch.randn(2 * hc + hc * hc, hc * dim, generator=rng) * 0.05
    scale, base = torch.rand(3, generator=rng) + 0.5, torch.randn(2 * hc + hc * hc, generator=rng) * 0.1
    assert_rows_invariant(lambda t: refmath.hc_coefficients(t, fn, scale, base, 4, 1e-6, 1e-6)[2], x)


def test_moe_route_rows_are_independent(rng):
    x = torch.randn(1, 37, 512, generator=rng).to(torch.bfloat16)
    gate = torch.randn(64, 512, generator=rng).to(torch.bfloat16)
    assert_rows_invariant(lambda t: refmath.moe_route(t, gate, None, 6, "sqrtsoftplus", True, 1.5)[0], x)

