"""The reference's ops give a row the same bits whatever the other rows of the call.

A one-token decode step, a speculative verify chunk and a prefill run the same row through GEMMs
of different heights; an fp32 GEMM's blocking (and so its rounding) depends on the height, and a
one-ulp difference can grow through the quantized KV into a different greedy token. Each op is
run on a chunk of random rows and on every row alone (and on a few sub-chunks): equal bit for bit.
"""
import pytest
import torch

from flashrt import formats, refmath

HEIGHTS = (1, 2, 5, 7)


def assert_rows_invariant(fn, x, dim: int = 1):
    """``fn`` of x [B, S, ...] (or a tuple of such, cut together) row-wise along ``dim``: every
    slice [a, a + h) gives the bits of the whole."""
    def cut(a, b):
        return tuple(t.narrow(dim, a, b - a) for t in x) if isinstance(x, tuple) else x.narrow(dim, a, b - a)

    def first(r):
        return r if isinstance(r, torch.Tensor) else r[0]

    S = (x[0] if isinstance(x, tuple) else x).shape[dim]
    whole = first(fn(x))
    for h in HEIGHTS:
        for a in range(0, S - h + 1, max(1, S // 4)):
            got = first(fn(cut(a, a + h)))
            assert torch.equal(got, whole.narrow(dim, a, h)), f"rows [{a}, {a + h}) of {S} differ from the whole call"


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



# The transcendental pointwise functions (sigmoid, silu, softplus) run vectorized over a tensor's
# body and scalar over its tail on CPU; a row's bits must not depend on where it falls.
def test_engram_gate_rows_are_independent(rng):
    B, S, hc, d = 2, 37, 3, 48
    h, key = (torch.randn(B, S, hc, d, generator=rng) for _ in range(2))  # fp32 out: every bit shows
    value = torch.randn(B, S, d, generator=rng)
    weight = torch.rand(hc, d, generator=rng) + 0.5
    assert_rows_invariant(lambda t: refmath.engram_gate(*t, weight, 1e-6), (h, key, value))


@pytest.mark.parametrize("score", ["sigmoid", "sqrtsoftplus"])
def test_moe_route_of_few_experts_rows_are_independent(rng, score):
    x = (torch.randn(2, 37, 64, generator=rng) * 0.05).to(torch.bfloat16)
    gate = torch.randn(11, 64, generator=rng).to(torch.bfloat16)
    assert_rows_invariant(lambda t: refmath.moe_route(t, gate, None, 3, score, True, 1.5)[0], x)


def test_hc_coefficients_of_a_batch_rows_are_independent(rng):
    hc, dim = 4, 64
    x = torch.randn(2, 37, hc, dim, generator=rng).to(torch.bfloat16)
    fn = torch.randn(2 * hc + hc * hc, hc * dim, generator=rng) * 0.05
    scale, base = torch.rand(3, generator=rng) + 0.5, torch.randn(2 * hc + hc * hc, generator=rng) * 0.1
    for part in range(3):
        assert_rows_invariant(lambda t: refmath.hc_coefficients(t, fn, scale, base, 4, 1e-6, 1e-6)[part], x)


def test_swiglu_rows_are_independent(rng):
    gate, up = (torch.randn(37, 44, generator=rng).to(torch.bfloat16) * 3 for _ in range(2))
    weight = torch.rand(37, generator=rng)
    assert_rows_invariant(lambda t: refmath.swiglu(*t, 7.0), (gate, up, weight), dim=0)
