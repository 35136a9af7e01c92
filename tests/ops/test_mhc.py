"""mHC ops (hc_coefficients, hc_collapse, hc_collapse_norm, hc_expand) against float64 loops (not backends/reference)."""
import math

import numpy as np
import pytest
import torch

from flashrt import ops

DTYPES = [torch.float32, torch.bfloat16]


def _sig(z):
    return 1.0 / (1.0 + math.exp(-z))


def _coeffs64(x, fn, scale, base, iters, eps, norm_eps):
    x = x.to(torch.float64).numpy()
    fn, scale, base = (t.to(torch.float64).numpy() for t in (fn, scale, base))
    B, S, hc, D = x.shape
    pre = np.zeros((B, S, hc))
    post = np.zeros((B, S, hc))
    comb = np.zeros((B, S, hc, hc))
    for b in range(B):
        for s in range(S):
            v = x[b, s].reshape(-1)
            r = 1.0 / math.sqrt(sum(t * t for t in v) / v.size + norm_eps)
            m = [sum(v[i] * fn[j, i] for i in range(v.size)) * r for j in range((2 + hc) * hc)]
            for k in range(hc):
                pre[b, s, k] = _sig(m[k] * scale[0] + base[k]) + eps
                post[b, s, k] = 2 * _sig(m[hc + k] * scale[1] + base[hc + k])
            c = [[m[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k] for k in range(hc)] for j in range(hc)]
            for j in range(hc):  # softmax over each row (last index), then + eps
                mx = max(c[j])
                e = [math.exp(t - mx) for t in c[j]]
                c[j] = [t / sum(e) + eps for t in e]

            def cols():
                for k in range(hc):
                    cs = sum(c[j][k] for j in range(hc)) + eps
                    for j in range(hc):
                        c[j][k] /= cs

            def rows():
                for j in range(hc):
                    rs = sum(c[j]) + eps
                    c[j] = [t / rs for t in c[j]]

            cols()
            for _ in range(iters - 1):
                rows()
                cols()
            comb[b, s] = np.array(c)
    return pre, post, comb


def _inputs(B, S, hc, D, dtype, g):
    x = (torch.randn(B, S, hc, D, generator=g) * 2).to(dtype)
    fn = torch.randn((2 + hc) * hc, hc * D, generator=g) / math.sqrt(hc * D)
    scale = torch.rand(3, generator=g) * 2 + 0.1
    base = torch.randn((2 + hc) * hc, generator=g) * 0.5
    return x, fn, scale, base


def _assert_coeffs(got, want):
    """(pre, post, comb) of the op against the float64 (pre, post, comb)."""
    assert len(got) == len(want) == 3
    for t, w, rtol in zip(got, want, (2e-5, 2e-5, 5e-5)):
        np.testing.assert_allclose(t.double().numpy(), w, rtol=rtol, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,hc,D", [(1, 1, 4, 16), (2, 3, 4, 7), (1, 2, 3, 5), (2, 1, 1, 9)])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_hc_coefficients(dtype, B, S, hc, D, iters, rng):
    g = rng
    x, fn, scale, base = _inputs(B, S, hc, D, dtype, g)
    eps, norm_eps = 1e-6, 1e-6
    pre, post, comb = ops.hc_coefficients(x, fn, scale, base, iters, eps, norm_eps)
    for t, shape in ((pre, (B, S, hc)), (post, (B, S, hc)), (comb, (B, S, hc, hc))):
        assert t.dtype == torch.float32 and tuple(t.shape) == shape
    _assert_coeffs((pre, post, comb), _coeffs64(x, fn, scale, base, iters, eps, norm_eps))


def test_hc_coefficients_large_eps_and_norm_eps(rng):
    # eps and norm_eps large enough to matter: catches a misplaced eps
    g = rng
    x, fn, scale, base = _inputs(2, 2, 4, 8, torch.float32, g)
    x = x * 0.1
    _assert_coeffs(ops.hc_coefficients(x, fn, scale, base, 3, 0.05, 0.5), _coeffs64(x, fn, scale, base, 3, 0.05, 0.5))


def test_hc_comb_doubly_stochastic_after_many_iters(rng):
    g = rng
    x, fn, scale, base = _inputs(3, 4, 4, 16, torch.float32, g)
    base = base * 2  # far from uniform before the Sinkhorn iterations
    dev = lambda c, dim: float((c.sum(dim) - 1).abs().max())
    combs = {it: ops.hc_coefficients(x, fn, scale, base, it, 1e-6, 1e-6)[2] for it in (1, 20, 200)}
    for c in combs.values():
        assert (c > 0).all()
        # every iteration ends with a column normalisation: columns sum to S / (S + eps)
        assert dev(c, -2) < 1e-3
    # one iteration only normalizes the columns; the rows are generally not yet stochastic
    assert dev(combs[1], -1) > 1e-2
    # Sinkhorn converges: the row error shrinks with the iterations and is small after many
    assert dev(combs[200], -1) <= dev(combs[20], -1) + 1e-6
    assert dev(combs[200], -1) < 1e-3
    assert dev(combs[200], -2) < 1e-5


def test_hc_pre_post_ranges(rng):
    g = rng
    x, fn, scale, base = _inputs(2, 3, 4, 8, torch.float32, g)
    pre, post, _ = ops.hc_coefficients(x, fn, scale, base, 2, 0.01, 1e-6)
    assert (pre > 0.01).all() and (pre < 1.01 + 1e-6).all()
    assert (post > 0).all() and (post < 2).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,hc,D", [(1, 1, 4, 16), (2, 3, 4, 7), (2, 1, 1, 5), (1, 2, 3, 33)])
def test_hc_collapse(dtype, B, S, hc, D, rng):
    g = rng
    x = torch.randn(B, S, hc, D, generator=g).to(dtype)
    pre = torch.rand(B, S, hc, generator=g) * 2 - 0.5
    y = ops.hc_collapse(x, pre)
    assert y.dtype == dtype and tuple(y.shape) == (B, S, D)
    xs, ps = x.double().numpy(), pre.double().numpy()
    want = np.zeros((B, S, D))
    mag = np.zeros((B, S, D))
    for b in range(B):
        for s in range(S):
            for k in range(hc):
                want[b, s] += ps[b, s, k] * xs[b, s, k]
                mag[b, s] += abs(ps[b, s, k] * xs[b, s, k])
    rel = 2.0**-8 if dtype == torch.bfloat16 else 0
    err = np.abs(y.double().numpy() - want)
    assert np.all(err <= rel * np.abs(want) + 1e-6 * mag + 1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,hc,D", [(1, 1, 4, 16), (2, 3, 4, 7), (1, 2, 3, 33)])
def test_hc_collapse_norm(dtype, B, S, hc, D, rng):
    """The collapse rounded to x.dtype, then the RMS norm: each step in float64 from the rounded value."""
    x = torch.randn(B, S, hc, D, generator=rng).to(dtype)
    pre = torch.rand(B, S, hc, generator=rng) * 2 - 0.5
    w = torch.randn(D, generator=rng).to(torch.bfloat16)
    eps = float(torch.rand(1, generator=rng)) * 1e-2
    y = ops.hc_collapse_norm(x, pre, w, eps)
    assert y.dtype == dtype and tuple(y.shape) == (B, S, D)
    collapsed = (pre.double().unsqueeze(-1) * x.double()).sum(2).to(dtype).double().numpy()  # as hc_collapse rounds
    want = np.zeros((B, S, D))
    for b in range(B):
        for s in range(S):
            row = collapsed[b, s]
            want[b, s] = row / math.sqrt(sum(v * v for v in row) / D + eps) * w.double().numpy()
    rel = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    # plus an absolute term for cancellation in the fp32 sum (pre has both signs)
    assert np.all(np.abs(y.double().numpy() - want) <= rel * np.abs(want) + 1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="weight"):
        ops.hc_collapse_norm(x, pre, w[:-1], eps)
    with pytest.raises(ValueError, match="eps"):
        ops.hc_collapse_norm(x, pre, w, -1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,hc,D", [(1, 1, 4, 16), (2, 3, 4, 7), (2, 1, 1, 5), (1, 2, 3, 33)])
def test_hc_expand(dtype, B, S, hc, D, rng):
    g = rng
    y = torch.randn(B, S, D, generator=g).to(dtype)
    res = torch.randn(B, S, hc, D, generator=g).to(dtype)
    post = torch.rand(B, S, hc, generator=g) * 2
    comb = torch.rand(B, S, hc, hc, generator=g)  # deliberately not symmetric
    out = ops.hc_expand(y, res, post, comb)
    assert out.dtype == dtype and tuple(out.shape) == (B, S, hc, D)
    ys, rs, ps, cs = (t.double().numpy() for t in (y, res, post, comb))
    want = np.zeros((B, S, hc, D))
    mag = np.zeros((B, S, hc, D))
    for b in range(B):
        for s in range(S):
            for k in range(hc):
                want[b, s, k] = ps[b, s, k] * ys[b, s]
                mag[b, s, k] = np.abs(ps[b, s, k] * ys[b, s])
                for j in range(hc):  # comb[j, k]: stream j of the residual feeds output stream k
                    want[b, s, k] += cs[b, s, j, k] * rs[b, s, j]
                    mag[b, s, k] += np.abs(cs[b, s, j, k] * rs[b, s, j])
    rel = 2.0**-8 if dtype == torch.bfloat16 else 0
    err = np.abs(out.double().numpy() - want)
    assert np.all(err <= rel * np.abs(want) + 1e-6 * mag + 1e-30)


def test_hc_expand_comb_orientation():
    # a permutation comb makes the orientation unambiguous: comb[j, k] = 1 sends stream j to k
    res = torch.arange(3, dtype=torch.float32).view(1, 1, 3, 1).expand(1, 1, 3, 2).contiguous()
    comb = torch.zeros(1, 1, 3, 3)
    comb[0, 0, 0, 1] = comb[0, 0, 1, 2] = comb[0, 0, 2, 0] = 1.0
    out = ops.hc_expand(torch.zeros(1, 1, 2), res, torch.zeros(1, 1, 3), comb)
    assert out[0, 0, :, 0].tolist() == [2.0, 0.0, 1.0]


def test_hc_roundtrip_identity(rng):
    # collapse with pre = e_0 and expand with comb = I, post = 0 give back x[0] and x
    g = rng
    x = torch.randn(2, 3, 4, 8, generator=g)
    pre = torch.zeros(2, 3, 4)
    pre[..., 0] = 1
    torch.testing.assert_close(ops.hc_collapse(x, pre), x[:, :, 0], rtol=0, atol=0)
    eye = torch.eye(4).expand(2, 3, 4, 4).contiguous()
    torch.testing.assert_close(ops.hc_expand(x[:, :, 0], x, torch.zeros(2, 3, 4), eye), x, rtol=0, atol=0)


def test_hc_errors(rng):
    g = rng
    x, fn, scale, base = _inputs(1, 2, 4, 8, torch.float32, g)
    args = dict(iters=3, eps=1e-6, norm_eps=1e-6)
    with pytest.raises(ValueError, match="x"):
        ops.hc_coefficients(x[0], fn, scale, base, **args)
    with pytest.raises(ValueError, match="x"):
        ops.hc_coefficients(x.to(torch.int32), fn, scale, base, **args)
    with pytest.raises(ValueError, match="fn"):
        ops.hc_coefficients(x, fn[:-1], scale, base, **args)
    with pytest.raises(ValueError, match="fn"):
        ops.hc_coefficients(x, fn[:, :-1], scale, base, **args)
    with pytest.raises(ValueError, match="fn"):
        ops.hc_coefficients(x, fn.to(torch.bfloat16), scale, base, **args)
    with pytest.raises(ValueError, match="scale"):
        ops.hc_coefficients(x, fn, scale[:2], base, **args)
    with pytest.raises(ValueError, match="base"):
        ops.hc_coefficients(x, fn, scale, base[:-1], **args)
    with pytest.raises(ValueError, match="iters"):
        ops.hc_coefficients(x, fn, scale, base, 0, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="iters"):
        ops.hc_coefficients(x, fn, scale, base, 2.0, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="^eps"):
        ops.hc_coefficients(x, fn, scale, base, 3, -1e-6, 1e-6)
    with pytest.raises(ValueError, match="norm_eps"):
        ops.hc_coefficients(x, fn, scale, base, 3, 1e-6, -1e-6)

    pre = torch.rand(1, 2, 4)
    with pytest.raises(ValueError, match="pre"):
        ops.hc_collapse(x, pre[..., :3])
    with pytest.raises(ValueError, match="pre"):
        ops.hc_collapse(x, pre.to(torch.bfloat16))
    with pytest.raises(ValueError, match="x"):
        ops.hc_collapse(x[:, :, 0], pre)

    y = torch.randn(1, 2, 8)
    post, comb = torch.rand(1, 2, 4), torch.rand(1, 2, 4, 4)
    with pytest.raises(ValueError, match="y"):
        ops.hc_expand(y[0], x, post, comb)
    with pytest.raises(ValueError, match="residual"):
        ops.hc_expand(y, x[..., :7], post, comb)
    with pytest.raises(ValueError, match="residual"):
        ops.hc_expand(y, x[:, :1], post, comb)
    with pytest.raises(ValueError, match="post"):
        ops.hc_expand(y, x, post[..., :3], comb)
    with pytest.raises(ValueError, match="post"):
        ops.hc_expand(y, x, post.double(), comb)
    with pytest.raises(ValueError, match="comb"):
        ops.hc_expand(y, x, post, comb[..., :3])
    with pytest.raises(ValueError, match="comb"):
        ops.hc_expand(y, x, post, comb.to(torch.bfloat16))
