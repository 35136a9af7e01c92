"""moe_route and moe_experts against independent float64 loops (not backends/reference).

Dtype flow of moe_experts (core/ops.py: "each projection is a linear"): W1 x and W3 x come out in
``x.dtype``; ``h = weight * silu(min(W1 x, L)) * clamp(W3 x, -L, L)`` is cast to ``x.dtype``
(and fp8-quantized for a quantized W2); W2 h comes out in ``x.dtype``; the sum over experts is
fp32. Every quantized projection sees its input fp8-quantized per 32 (UE8M0).
"""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from flashrt import QTensor, ops
from test_linear import dequant_w64 as dequant_qw64, fp8_act_quant64

# ------------------------------------------------------------------------------------- helpers


def dequant_w64(w) -> np.ndarray:
    """float64 [..., out, in] of a plain tensor or an fp8_w / fp4_w QTensor (from the bytes)."""
    return dequant_qw64(w) if isinstance(w, QTensor) else w.double().numpy()


def _bf16(v):
    return np.asarray(v, dtype=np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _silu(a):
    return a / (1.0 + np.exp(-a))


def experts64(x, weights, indices, w1, w3, w2, L, weight_on_output=False):
    """Loop over tokens and slots. Returns (out, mag, worst, omag): mag bounds the accumulated
    fp32 rounding, worst[n] is the largest single |w2 * h| term feeding token n's outputs,
    omag[n] = sum over slots of |W2 h| (what one x.dtype rounding per expert output scales with)."""
    rnd = _bf16 if x.dtype == torch.bfloat16 else (lambda v: v)
    xs = x.double().numpy()
    W = [dequant_w64(w) for w in (w1, w3, w2)]
    q = [isinstance(w, QTensor) for w in (w1, w3, w2)]
    N, D = xs.shape
    out, mag, worst, omag = (np.zeros((N, D)) for _ in range(4))
    for n in range(N):
        for slot in range(indices.shape[1]):
            e, wt = int(indices[n, slot]), float(weights[n, slot])
            x1 = fp8_act_quant64(xs[n]) if q[0] else xs[n]
            x3 = fp8_act_quant64(xs[n]) if q[1] else xs[n]
            a, b = rnd(W[0][e] @ x1), rnd(W[1][e] @ x3)
            A = np.abs(W[0][e]) @ np.abs(x1) + 1.0
            Bm = np.abs(W[1][e]) @ np.abs(x3)
            if L > 0:
                a, b = np.minimum(a, L), np.clip(b, -L, L)
            h = _silu(a) * b
            h = rnd(h if weight_on_output else wt * h)
            if q[2]:
                h = fp8_act_quant64(h)
            o = W[2][e] @ h
            if weight_on_output:
                o = wt * o
            out[n] += rnd(o)
            omag[n] += np.abs(o)
            mag[n] += np.abs(W[2][e]) @ (abs(wt) * A * Bm)
            worst[n] = np.maximum(worst[n], (np.abs(W[2][e]) * np.abs(wt * _silu(a) * b)).max(-1))
    return out, mag, worst, omag


def _experts_inputs(N, D, I, E, k, g, dup=False):
    x = torch.randn(N, D, generator=g)
    w1 = torch.randn(E, I, D, generator=g) / math.sqrt(D)
    w3 = torch.randn(E, I, D, generator=g) / math.sqrt(D)
    w2 = torch.randn(E, D, I, generator=g) / math.sqrt(I)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)] or [torch.zeros(0, k)])
    idx = idx.to(torch.int32).reshape(N, k)
    if dup and k > 1 and N > 0:
        idx[0, 1] = idx[0, 0]  # the same expert twice for one token: both slots count
    weights = torch.rand(N, k, generator=g) + 0.1
    return x, weights, idx, w1, w3, w2


# ------------------------------------------------------------------------------------ moe_route


def _scores64(x, weight, score_func):
    xs, ws = x.double().numpy(), weight.double().numpy()
    N, E = xs.shape[0], ws.shape[0]
    s = np.empty((N, E))
    for n in range(N):
        z = [sum(xs[n, d] * ws[e, d] for d in range(xs.shape[1])) for e in range(E)]
        if score_func == "softmax":
            m = max(z)
            ex = [math.exp(v - m) for v in z]
            s[n] = [v / sum(ex) for v in ex]
        elif score_func == "sigmoid":
            s[n] = [1 / (1 + math.exp(-v)) for v in z]
        else:
            s[n] = [math.sqrt(math.log1p(math.exp(v))) for v in z]
    return s


def _check_route(w_op, i_op, s64, key64, topk, norm_topk, route_scale):
    N, E = s64.shape
    assert w_op.dtype == torch.float32 and i_op.dtype == torch.int32
    assert tuple(w_op.shape) == tuple(i_op.shape) == (N, topk)
    for n in range(N):
        got = [int(v) for v in i_op[n]]
        assert len(set(got)) == topk and all(0 <= e < E for e in got)
        order = sorted(range(E), key=lambda e: (-key64[n, e], e))  # ties to the lower expert
        want = order[:topk]
        if set(got) != set(want):  # only a near-tie at the boundary may differ (fp32 vs fp64)
            kth = key64[n, order[topk - 1]]
            for e in set(got) ^ set(want):
                assert abs(key64[n, e] - kth) < 1e-5, (n, got, want)
        ws = s64[n, got]
        if norm_topk and topk > 1:
            ws = ws / (ws.sum() + 1e-20)
        np.testing.assert_allclose(w_op[n].double().numpy(), ws * route_scale, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("norm_topk", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_route(score_func, with_bias, norm_topk, dtype, rng):
    g = rng
    for N, D, E, topk, route_scale in ((5, 16, 8, 3, 2.5), (1, 7, 5, 1, 1.0), (9, 33, 12, 12, 0.7)):
        x = torch.randn(N, D, generator=g).to(dtype)
        weight = (torch.randn(E, D, generator=g) / math.sqrt(D)).to(dtype)
        bias = torch.randn(E, generator=g) * 0.3 if with_bias else None
        w_op, i_op = ops.moe_route(x, weight, bias, topk, score_func, norm_topk, route_scale)
        s64 = _scores64(x, weight, score_func)
        key64 = s64 + (bias.double().numpy() if with_bias else 0)
        _check_route(w_op, i_op, s64, key64, topk, norm_topk, route_scale)


def test_moe_route_bias_picks_but_does_not_scale():
    # expert 3 has the lowest score but a large bias: it is picked, with its unbiased score
    x = torch.tensor([[1.0, 0.0]])
    weight = torch.tensor([[2.0, 0], [1.0, 0], [0.5, 0], [-3.0, 0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    w, i = ops.moe_route(x, weight, bias, 2, "sigmoid", False, 1.0)
    assert sorted(i[0].tolist()) == [0, 3]
    got = dict(zip(i[0].tolist(), w[0].tolist()))
    assert got[3] == pytest.approx(1 / (1 + math.exp(3.0)), rel=1e-6)
    assert got[0] == pytest.approx(1 / (1 + math.exp(-2.0)), rel=1e-6)
    # normalisation uses the unbiased scores too
    w, i = ops.moe_route(x, weight, bias, 2, "sigmoid", True, 3.0)
    s0, s3 = 1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(3.0))
    got = dict(zip(i[0].tolist(), w[0].tolist()))
    assert got[3] == pytest.approx(3 * s3 / (s0 + s3), rel=1e-6)


def test_moe_route_ties_to_lower_expert():
    x = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    weight = torch.tensor([[0.1, 0.0], [1.0, 0.5], [0.0, 0.2], [1.0, 0.5], [0.3, 0.3], [1.0, 0.5]])
    for score_func in ("softmax", "sigmoid", "sqrtsoftplus"):
        _, i = ops.moe_route(x, weight, None, 2, score_func, True, 1.0)
        assert sorted(i[0].tolist()) == [1, 3]  # 1, 3 and 5 tie; the two lowest win
        assert sorted(i[1].tolist()) == [1, 3]
    # a tie created by the bias
    w, i = ops.moe_route(x[:1], weight, torch.tensor([0.0, -1.0, 0.0, 0.0, 0.0, 0.0]), 1, "sigmoid", False, 1.0)
    assert i.tolist() == [[3]]


def test_moe_route_topk1_not_normalised(rng):
    g = rng
    x, weight = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g)
    w, i = ops.moe_route(x, weight, None, 1, "sigmoid", True, 2.0)
    s = _scores64(x, weight, "sigmoid")
    np.testing.assert_allclose(w[:, 0].double().numpy(), 2.0 * s[np.arange(4), i[:, 0].numpy()], rtol=1e-5)
    assert (w < 2.0).all()  # would be exactly 2.0 if normalised


def test_moe_route_softmax_over_all_experts(rng):
    # softmax is over all E experts, not over the picked ones
    g = rng
    x, weight = torch.randn(3, 8, generator=g), torch.randn(6, 8, generator=g) * 0.01
    w, _ = ops.moe_route(x, weight, None, 2, "softmax", False, 1.0)
    assert (w.sum(-1) < 0.5).all()  # ~ 2/6; 1.0 if normalised over the picked experts


def test_moe_route_errors():
    x, weight, bias = torch.randn(3, 8), torch.randn(4, 8), torch.zeros(4)
    with pytest.raises(ValueError, match="topk"):
        ops.moe_route(x, weight, bias, 5, "softmax", True, 1.0)  # > E
    with pytest.raises(ValueError, match="topk"):
        ops.moe_route(x, weight, bias, 0, "softmax", True, 1.0)
    with pytest.raises(ValueError, match="topk"):
        ops.moe_route(x, weight, bias, 2.0, "softmax", True, 1.0)
    with pytest.raises(ValueError, match="score_func"):
        ops.moe_route(x, weight, bias, 2, "relu", True, 1.0)
    with pytest.raises(ValueError, match="weight"):
        ops.moe_route(x, weight[:, :7], bias, 2, "softmax", True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        ops.moe_route(x, weight, bias[:3], 2, "softmax", True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        ops.moe_route(x, weight, bias.to(torch.bfloat16), 2, "softmax", True, 1.0)
    with pytest.raises(ValueError, match="x"):
        ops.moe_route(x.unsqueeze(0), weight, bias, 2, "softmax", True, 1.0)
    with pytest.raises(ValueError, match="route_scale"):
        ops.moe_route(x, weight, bias, 2, "softmax", True, "1.0")


# ---------------------------------------------------------------------------------- moe_experts


@pytest.mark.parametrize("N,D,I,E,k", [(1, 8, 4, 2, 1), (5, 7, 5, 3, 2), (6, 16, 12, 4, 4), (0, 8, 4, 2, 1)])
@pytest.mark.parametrize("L", [0.0, 0.7])
def test_moe_experts_plain_fp32(N, D, I, E, k, L, rng):
    g = rng
    x, weights, idx, w1, w3, w2 = _experts_inputs(N, D, I, E, k, g, dup=True)
    x = x * 2  # W1 x spans well beyond L, so that both clamps act
    out = ops.moe_experts(x, weights, idx, w1, w3, w2, L)
    assert out.dtype == torch.float32 and tuple(out.shape) == (N, D)
    want, mag, _, _ = experts64(x, weights, idx, w1, w3, w2, L)
    err = np.abs(out.double().numpy() - want)
    assert np.all(err <= 1e-5 * mag + 1e-7), err.max()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_add_then_cast(out_dtype, rng):
    """``add`` joins the fp32 sum, then the result is cast to ``out_dtype``: against float64."""
    N, D, I, E, k = 7, 16, 12, 4, 2
    x, weights, idx, w1, w3, w2 = _experts_inputs(N, D, I, E, k, rng, dup=True)
    add = torch.randn(N, D, generator=rng)
    out = ops.moe_experts(x, weights, idx, w1, w3, w2, 0.7, add=add, out_dtype=out_dtype)
    assert out.dtype == out_dtype and tuple(out.shape) == (N, D)
    want, mag, _, _ = experts64(x, weights, idx, w1, w3, w2, 0.7)
    want = want + add.double().numpy()
    rel = 2.0**-8 if out_dtype == torch.bfloat16 else 0.0
    err = np.abs(out.double().numpy() - want)
    assert np.all(err <= rel * np.abs(want) + 1e-5 * (mag + np.abs(want)) + 1e-7), err.max()
    with pytest.raises(ValueError, match="add"):
        ops.moe_experts(x, weights, idx, w1, w3, w2, 0.7, add=add[:, :-1])
    with pytest.raises(ValueError, match="add"):
        ops.moe_experts(x, weights, idx, w1, w3, w2, 0.7, add=add.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        ops.moe_experts(x, weights, idx, w1, w3, w2, 0.7, out_dtype=torch.int32)


def test_moe_experts_clamp_semantics():
    # one expert, identity-like weights: gate = x0, up = x1; check min (not clamp) on the gate
    w1 = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    w3 = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]])
    w2 = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    x = torch.tensor([[-5.0, 3.0], [5.0, -3.0], [0.5, 0.25]])
    out = ops.moe_experts(x, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32), w1, w3, w2, 1.0)
    silu = lambda a: a / (1 + math.exp(-a))
    # gate -5 is not raised to -1 (min, not clamp); up 3 -> 1; gate 5 -> 1, up -3 -> -1
    assert out[:, 0].tolist() == pytest.approx([silu(-5.0) * 1.0, silu(1.0) * -1.0, silu(0.5) * 0.25], rel=1e-6)
    assert out[:, 1].tolist() == [0.0, 0.0, 0.0]


def test_moe_experts_plain_bf16(rng):
    g = rng
    N, D, I, E, k = 12, 24, 20, 4, 2
    x, weights, idx, w1, w3, w2 = _experts_inputs(N, D, I, E, k, g)
    x = x.to(torch.bfloat16)
    w1, w3, w2 = (w.to(torch.bfloat16) for w in (w1, w3, w2))
    out = ops.moe_experts(x, weights, idx, w1, w3, w2, 0.0)
    assert out.dtype == torch.float32
    want, mag, worst, omag = experts64(x, weights, idx, w1, w3, w2, 0.0)
    err = np.abs(out.double().numpy() - want)
    # bf16 roundings of W1 x / W3 x / h / W2 h may land on the other side of a rounding boundary
    # (fp32 vs fp64 intermediates): allow one bf16 ulp per expert output and a few of the
    # largest term
    assert np.all(err <= 2.0**-8 * omag + 1e-5 * mag + 4 * 2.0**-8 * worst), err.max()


def _quantized_case(N, D, I, E, k, fmt, g):
    x, weights, idx, w1, w3, w2 = _experts_inputs(N, D, I, E, k, g)
    weights = weights * 1.37  # not powers of two: scaling W2's input != scaling its output
    return x, weights, idx, *(ops.quantize(w, fmt) for w in (w1, w3, w2))


def _assert_quantized_close(out, want, mag, worst, omag, dtype):
    """The emulation performs the same roundings (x.dtype casts, fp8 activations) on the same
    values, so nearly every output agrees to fp32 accumulation accuracy (``tight``, no x.dtype
    slack: this checks the dtype flow). A rounding flip (an fp32 vs fp64 intermediate on the
    other side of a bf16 / fp8 rounding boundary, rare) may move a token by one fp8 ulp
    (2**-3 relative) of a term and one x.dtype ulp of an expert output."""
    err = np.abs(out.double().numpy() - want)
    tight = 1e-5 * mag + 1e-7
    rel = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    assert np.all(err <= tight + rel * omag + 2 * 2.0**-3 * worst), err.max()
    if out.shape[0] >= 4:  # a flip moves one whole token; systematic errors move most outputs
        assert np.mean(err <= tight) >= 0.6, np.mean(err <= tight)
    return tight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,D,I,E,k,L", [(9, 64, 32, 4, 2, 0.0), (4, 32, 96, 3, 3, 1.5), (1, 96, 64, 2, 1, 0.0)])
def test_moe_experts_fp4(dtype, N, D, I, E, k, L, rng):
    g = rng
    x, weights, idx, w1, w3, w2 = _quantized_case(N, D, I, E, k, "fp4_w", g)
    x = x.to(dtype)
    out = ops.moe_experts(x, weights, idx, w1, w3, w2, L)
    assert out.dtype == torch.float32 and tuple(out.shape) == (N, D)
    want, mag, worst, omag = experts64(x, weights, idx, w1, w3, w2, L)
    tight = _assert_quantized_close(out, want, mag, worst, omag, dtype)
    # the test discriminates: scaling W2's output instead of its input is measurably different
    if N >= 4:
        alt, _, _, _ = experts64(x, weights, idx, w1, w3, w2, L, weight_on_output=True)
        assert np.mean(np.abs(out.double().numpy() - alt) <= tight) < 0.5


def test_moe_experts_fp8_w_and_mixed(rng):
    g = rng
    N, D, I, E, k = 6, 64, 32, 3, 2
    x, weights, idx, w1, w3, w2 = _experts_inputs(N, D, I, E, k, g)
    cases = [
        (ops.quantize(w1, "fp8_w"), ops.quantize(w3, "fp8_w"), ops.quantize(w2, "fp8_w")),
        (ops.quantize(w1, "fp4_w"), w3, ops.quantize(w2, "fp8_w")),  # formats may differ per weight
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for q1, q3, q2 in cases:
            xd = x.to(dtype)
            out = ops.moe_experts(xd, weights, idx, q1, q3, q2, 0.0)
            want, mag, worst, omag = experts64(xd, weights, idx, q1, q3, q2, 0.0)
            _assert_quantized_close(out, want, mag, worst, omag, dtype)


def test_moe_experts_matches_per_expert_linear_sum(rng):
    # an op-level identity: routing each token to one expert with weight 1 equals the SwiGLU
    # built from ops.linear (the contract says each projection is a linear)
    g = rng
    N, D, I, E = 5, 32, 32, 3
    x, _, _, w1, w3, w2 = _experts_inputs(N, D, I, E, 1, g)
    q1, q3, q2 = (ops.quantize(w, "fp4_w") for w in (w1, w3, w2))
    idx = torch.tensor([[0], [2], [1], [2], [0]], dtype=torch.int32)
    out = ops.moe_experts(x, torch.ones(N, 1), idx, q1, q3, q2, 0.0)
    for n in range(N):
        e = int(idx[n, 0])
        sub = lambda q: QTensor(q.data[e], q.scale[e], q.fmt, q.shape[1:])
        h = torch.nn.functional.silu(ops.linear(x[n : n + 1], sub(q1))) * ops.linear(x[n : n + 1], sub(q3))
        torch.testing.assert_close(out[n : n + 1], ops.linear(h, sub(q2)), rtol=1e-5, atol=1e-6)


def test_moe_experts_errors(rng):
    g = rng
    N, D, I, E, k = 3, 32, 32, 4, 2
    x, weights, idx, w1, w3, w2 = _experts_inputs(N, D, I, E, k, g)
    with pytest.raises(ValueError, match="indices"):
        ops.moe_experts(x, weights, idx + E, w1, w3, w2, 0.0)
    with pytest.raises(ValueError, match="indices"):
        ops.moe_experts(x, weights, idx - 10, w1, w3, w2, 0.0)
    with pytest.raises(ValueError, match="indices"):
        ops.moe_experts(x, weights, idx.long(), w1, w3, w2, 0.0)
    with pytest.raises(ValueError, match="indices"):
        ops.moe_experts(x, weights, idx[:, :1], w1, w3, w2, 0.0)
    with pytest.raises(ValueError, match="weights"):
        ops.moe_experts(x, weights[:2], idx, w1, w3, w2, 0.0)
    with pytest.raises(ValueError, match="weights"):
        ops.moe_experts(x, weights.to(torch.bfloat16), idx, w1, w3, w2, 0.0)
    with pytest.raises(ValueError, match="w1"):
        ops.moe_experts(x, weights, idx, w1[:, :, :16], w3, w2, 0.0)
    with pytest.raises(ValueError, match="w3"):
        ops.moe_experts(x, weights, idx, w1, w3[:3], w2, 0.0)
    with pytest.raises(ValueError, match="w2"):
        ops.moe_experts(x, weights, idx, w1, w3, w2[:, :, :16], 0.0)
    with pytest.raises(ValueError, match="w1"):
        ops.moe_experts(x, weights, idx, ops.quantize(w1, "fp8"), w3, w2, 0.0)  # not a weight format
    with pytest.raises(ValueError, match="swiglu_limit"):
        ops.moe_experts(x, weights, idx, w1, w3, w2, -1.0)
    with pytest.raises(ValueError, match="x"):
        ops.moe_experts(x.unsqueeze(0), weights, idx, w1, w3, w2, 0.0)


@pytest.mark.parametrize("which", ["w1", "w2"])
def test_moe_experts_quantized_needs_in_multiple_of_32(which, rng):
    # a quantized projection sees fp8 activations (blocks of 32 along its input dim), as in linear
    g = rng
    if which == "w1":
        N, D, I = 2, 48, 32
    else:
        N, D, I = 2, 32, 40
    x, weights, idx, w1, w3, w2 = _experts_inputs(N, D, I, 2, 1, g)
    args = dict(w1=w1, w3=w3, w2=w2)
    args[which] = ops.quantize(args[which], "fp8_w")  # fp8_w stores any in (tiles are padded)
    with pytest.raises(ValueError, match=which):
        ops.moe_experts(x, weights, idx, args["w1"], args["w3"], args["w2"], 0.0)


def test_model_keeps_one_copy_of_the_expert_weights(tmp_path):
    """The stacked expert weights the MoE layers use are the weights dict's storage (no second
    copy), and a model built that way saves and reloads the same weights."""
    from flashrt.formats import QTensor as Q
    from flashrt.graphs import checkpoint
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    cfg = shipped_config("tiny")
    fresh = init_weights(cfg, seed=11)
    model = Model(cfg, init_weights(cfg, seed=11))
    moe = model.blocks[0].ffn
    for e in range(cfg.n_routed_experts):
        view = model.weights[f"layers.0.ffn.experts.{e}.w1.weight"]
        data = view.data if isinstance(view, Q) else view
        stacked = moe.w1.data if isinstance(moe.w1, Q) else moe.w1
        assert data.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
        ref = fresh[f"layers.0.ffn.experts.{e}.w1.weight"]
        assert torch.equal(data.view(torch.uint8), (ref.data if isinstance(ref, Q) else ref).view(torch.uint8))
    model.save(tmp_path / "ckpt")
    _, loaded = checkpoint.load(tmp_path / "ckpt")
    for name, ref in fresh.items():
        got = loaded[name]
        a, b = (got.data, ref.data) if isinstance(ref, Q) else (got, ref)
        assert torch.equal(a.view(torch.uint8).flatten(), b.view(torch.uint8).flatten()), name
