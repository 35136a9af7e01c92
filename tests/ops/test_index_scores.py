"""``flashrt.ops.index_scores`` against an independent float64 loop over (batch, position, entry).

``score[b,s,t] = sum_h relu(<q[b,s,h], k[b,t]>) * weights[b,s,h]`` for ``t < visible[b,s]``,
else ``-inf``. Quantized ``k`` is compared against the loop over ``flashrt.formats.dequantize(k)``.
"""
from __future__ import annotations

import math

import pytest
import torch

import flashrt
from flashrt import formats, ops
from flashrt.formats import QTensor
from kernel_check import assert_error


def expected_scores(q, k, weights, visible) -> torch.Tensor:
    """float64 [B, S, T], one (b, s, t) entry at a time."""
    kf = formats.dequantize(k) if isinstance(k, QTensor) else k
    qd, kd, wd = q.to(torch.float64), kf.to(torch.float64), weights.to(torch.float64)
    B, S, Hi, _ = q.shape
    T = kf.shape[1]
    out = torch.full((B, S, T), -math.inf, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            for t in range(int(visible[b, s])):
                total = 0.0
                for h in range(Hi):
                    total += max(float(torch.dot(qd[b, s, h], kd[b, t])), 0.0) * float(wd[b, s, h])
                out[b, s, t] = total
    return out


def random_visible(B, S, T, g) -> torch.Tensor:
    """int32 [B, S] in [0, T], with 0 and T present whenever there are at least 3 rows."""
    vis = torch.randint(0, T + 1, (B, S), generator=g)
    flat = vis.view(-1)
    if flat.numel() >= 3:
        flat[0], flat[-1] = 0, T
    return vis.to(torch.int32)


def check(out, want, B, S, T, rtol=1e-5, atol=1e-4):
    assert out.dtype == torch.float32 and out.shape == (B, S, T)
    hidden = torch.isinf(want)
    assert torch.equal(torch.isneginf(out), hidden)  # -inf exactly where t >= visible
    torch.testing.assert_close(out.double()[~hidden], want[~hidden], rtol=rtol, atol=atol)



SHAPES = [  # B, S, Hi, Di, T
    (1, 1, 1, 16, 1),
    (1, 3, 2, 32, 37),
    (2, 5, 5, 64, 37),
    (3, 2, 3, 96, 19),
    (2, 4, 4, 16, 5),
    (3, 1, 1, 32, 64),
]


@pytest.mark.parametrize("B,S,Hi,Di,T", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_k_matches_loop(B, S, Hi, Di, T, dtype, rng):
    g = rng
    q = torch.randn(B, S, Hi, Di, generator=g).to(dtype)
    k = torch.randn(B, T, Di, generator=g).to(dtype)
    weights = torch.randn(B, S, Hi, generator=g)  # negative weights too
    visible = random_visible(B, S, T, g)
    out = ops.index_scores(q, k, weights, visible)
    # bf16 inputs are exact in fp32, so the fp32 tolerance applies to both dtypes
    check(out, expected_scores(q, k, weights, visible), B, S, T)


@pytest.mark.parametrize("fmt,Di", [("fp4_b32", 32), ("fp4_b32", 64), ("fp4_b32", 96), ("fp8", 64), ("fp4_b16", 16)])
def test_quantized_k_matches_loop_over_dequantized(fmt, Di, rng):
    g = rng
    B, S, Hi, T = 2, 3, 4, 37
    q = torch.randn(B, S, Hi, Di, generator=g).to(torch.bfloat16)
    k = ops.quantize(torch.randn(B, T, Di, generator=g), fmt)
    assert isinstance(k, QTensor) and k.fmt == fmt
    weights = torch.rand(B, S, Hi, generator=g)
    visible = random_visible(B, S, T, g)
    out = ops.index_scores(q, k, weights, visible)
    want = expected_scores(q, k, weights, visible)
    check(out, want, B, S, T)
    # same as the plain op over the dequantized k
    torch.testing.assert_close(out, ops.index_scores(q, formats.dequantize(k), weights, visible), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("vis_value", ["zero", "full"])
def test_visible_extremes(vis_value, rng):
    g = rng
    B, S, Hi, Di, T = 2, 3, 2, 32, 37
    q = torch.randn(B, S, Hi, Di, generator=g)
    k = torch.randn(B, T, Di, generator=g)
    weights = torch.rand(B, S, Hi, generator=g)
    visible = torch.full((B, S), 0 if vis_value == "zero" else T, dtype=torch.int32)
    out = ops.index_scores(q, k, weights, visible)
    if vis_value == "zero":
        assert torch.isneginf(out).all()
    else:
        assert torch.isfinite(out).all()
        check(out, expected_scores(q, k, weights, visible), B, S, T)


@pytest.mark.parametrize("fmt", [None, "fp4_b32"])
def test_empty_cache(fmt):
    q = torch.randn(2, 3, 4, 32)
    k = torch.randn(2, 0, 32)
    if fmt is not None:
        k = ops.quantize(k, fmt)
    out = ops.index_scores(q, k, torch.rand(2, 3, 4), torch.zeros(2, 3, dtype=torch.int32))
    assert out.shape == (2, 3, 0) and out.dtype == torch.float32
    assert_error(lambda: ops.index_scores(q, k, torch.rand(2, 3, 4), torch.ones(2, 3, dtype=torch.int32)),
                 "visible", "[0, 1)")


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_weights_in_their_linear_dtype_times_a_scale(wdtype, rng):
    """``weights`` as the head-weight linear returns them (bf16) and ``weight_scale``: the scores of
    the fp32 weights ``weights.to(fp32) * weight_scale``, whatever the dtype they arrive in."""
    B, S, Hi, Di, T = 2, 3, 4, 32, 21
    g = rng
    q, k = torch.randn(B, S, Hi, Di, generator=g), torch.randn(B, T, Di, generator=g)
    weights = torch.randn(B, S, Hi, generator=g).to(wdtype)
    visible = random_visible(B, S, T, g)
    scale = 32 ** -0.5 * 4 ** -0.5 * 1.37
    out = ops.index_scores(q, k, weights, visible, scale)
    w32 = weights.to(torch.float32) * scale  # the fp32 product the contract names
    check(out, expected_scores(q, k, w32, visible), B, S, T)
    torch.testing.assert_close(out, ops.index_scores(q, k, w32, visible), rtol=0, atol=0)


def test_relu_and_weight_sign():
    """Negative dot products contribute nothing; weights scale linearly and may be negative."""
    Di, T = 16, 3
    q = torch.zeros(1, 1, 2, Di)
    q[0, 0, 0, 0] = 1.0
    q[0, 0, 1, 0] = -1.0
    k = torch.zeros(1, T, Di)
    k[0, :, 0] = torch.tensor([2.0, -3.0, 0.0])
    weights = torch.tensor([[[0.5, -2.0]]])
    out = ops.index_scores(q, k, weights, torch.tensor([[T]], dtype=torch.int32))
    # t=0: head0 dot 2 -> 1.0; head1 dot -2 -> 0.  t=1: head0 -3 -> 0; head1 3 -> -6.  t=2: 0
    assert out.tolist() == [[[1.0, -6.0, 0.0]]]


def test_rows_and_batches_independent_and_no_mutation(rng):
    g = rng
    B, S, Hi, Di, T = 3, 4, 3, 32, 11
    q = torch.randn(B, Hi, S, Di, generator=g).transpose(1, 2)  # non-contiguous view
    k = torch.randn(B, T, Di, generator=g)
    weights = torch.randn(B, S, Hi, generator=g)
    visible = random_visible(B, S, T, g)
    before = [t.clone() for t in (q, k, weights, visible)]
    out = ops.index_scores(q, k, weights, visible)
    for t, b in zip((q, k, weights, visible), before):
        assert torch.equal(t, b)
    for b in range(B):
        one = ops.index_scores(q[b : b + 1], k[b : b + 1], weights[b : b + 1], visible[b : b + 1])
        torch.testing.assert_close(one, out[b : b + 1], rtol=1e-6, atol=1e-6)
    check(out, expected_scores(q, k, weights, visible), B, S, T)


# ---------------------------------------------------------------------------------------------
# bad inputs


def _good():
    B, S, Hi, Di, T = 2, 3, 4, 32, 37
    return (torch.randn(B, S, Hi, Di), torch.randn(B, T, Di), torch.rand(B, S, Hi),
            torch.randint(0, T + 1, (B, S), dtype=torch.int32))


def test_good_inputs_pass():
    out = ops.index_scores(*_good())
    assert out.shape == (2, 3, 37) and out.dtype == torch.float32


def test_bad_q_and_k():
    q, k, w, v = _good()
    assert_error(lambda: ops.index_scores(q[0], k, w, v), "q", "4 dims", "(3, 4, 32)")
    assert_error(lambda: ops.index_scores(q.to(torch.int64), k, w, v), "q", "torch.int64")
    assert_error(lambda: ops.index_scores(q, k[..., :16], w, v), "k", "Di=32", "(2, 37, 16)")
    assert_error(lambda: ops.index_scores(q, ops.quantize(torch.randn(2, 37, 64), "fp4_b32"), w, v),
                 "k", "Di=32", "(2, 37, 64)")
    assert_error(lambda: ops.index_scores(q, k[:1], w, v), "k", "B=2", "(1, 37, 32)")
    assert_error(lambda: ops.index_scores(q, k[0], w, v), "k", "3 dims")
    assert_error(lambda: ops.index_scores(q, ops.quantize(k, "fp8_w"), w, v), "k", "fp8_w")


def test_bad_weights():
    q, k, w, v = _good()
    assert_error(lambda: ops.index_scores(q, k, w.to(torch.int32), v), "weights", "torch.float32", "torch.int32")
    assert_error(lambda: ops.index_scores(q, k, w, v, "0.5"), "weight_scale", "str")
    assert_error(lambda: ops.index_scores(q, k, w[..., :3], v), "weights", "Hi=4", "(2, 3, 3)")
    assert_error(lambda: ops.index_scores(q, k, w[:, :2], v), "weights", "S=3", "(2, 2, 4)")
    assert_error(lambda: ops.index_scores(q, k, w[0], v), "weights", "3 dims")


def test_bad_visible():
    q, k, w, v = _good()
    high = v.clone()
    high[1, 1] = 38  # T + 1
    assert_error(lambda: ops.index_scores(q, k, w, high), "visible", "[0, 38)", "38]")
    low = v.clone()
    low[0, 2] = -1
    assert_error(lambda: ops.index_scores(q, k, w, low), "visible", "[0, 38)", "[-1,")
    # the quantized k gives T from its logical shape
    assert_error(lambda: ops.index_scores(q, ops.quantize(k, "fp4_b32"), w, high), "visible", "38")
    assert_error(lambda: ops.index_scores(q, k, w, v.long()), "visible", "torch.int32", "torch.int64")
    assert_error(lambda: ops.index_scores(q, k, w, v[:, :2]), "visible", "S=3", "(2, 2)")
    assert_error(lambda: ops.index_scores(q, k, w, v[..., None]), "visible", "2 dims")
    with flashrt.value_checks(False):  # the range check can be switched off; in-range input still runs
        ops.index_scores(q, k, w, v)
