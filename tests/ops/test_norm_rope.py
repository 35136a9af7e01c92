"""rms_norm, rope and rope_table against independent float64 computations (not backends/reference)."""
import math

import numpy as np
import pytest
import torch

import flashrt
from flashrt import formats, ops

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    # output is rounded to dtype once (bf16: 8 bits of mantissa -> rel 2**-8 for one rounding)
    return {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}[dtype]


def _close(got, want64, dtype, scale=1.0):
    t = _tol(dtype)
    g = got.to(torch.float64).numpy()
    err = np.abs(g - want64)
    bound = t["atol"] * scale + t["rtol"] * np.abs(want64)
    assert np.all(err <= bound), f"max err {err.max():.3g}, worst excess {(err - bound).max():.3g}"


# ------------------------------------------------------------------------------------ rms_norm


def _rms_norm64(x, w, eps):
    x = x.to(torch.float64).numpy()
    w = w.to(torch.float64).numpy()
    out = np.empty_like(x)
    flat, fout = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
    for r in range(flat.shape[0]):
        ms = sum(v * v for v in flat[r]) / flat.shape[1]
        fout[r] = flat[r] / math.sqrt(ms + eps) * w
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 64), (1, 4, 33)])
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rms_norm(dtype, shape, eps, rng):
    g = rng
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    y = ops.rms_norm(x, w, eps)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, _rms_norm64(x, w, eps), dtype)
    # x is not mutated
    assert not x.isnan().any()


def test_rms_norm_mixed_weight_dtype():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.rand(16, dtype=torch.float32) + 0.5
    y = ops.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    _close(y, _rms_norm64(x, w, 1e-6), torch.bfloat16)


def test_rms_norm_errors():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.ones(8, dtype=torch.int32), 1e-6)
    with pytest.raises(ValueError, match="x"):
        ops.rms_norm(x.to(torch.int64), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="x"):
        ops.rms_norm(x.numpy(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, torch.ones(8), -1.0)


# ---------------------------------------------------------------------------------------- rope


def _rope64(x, freqs, inverse):
    """Real arithmetic on pairs (x[2i], x[2i+1]); freqs [S, R/2] or [B, S, R/2]."""
    xs = x.to(torch.float64).numpy()
    cos = freqs.real.to(torch.float64).numpy()
    sin = freqs.imag.to(torch.float64).numpy()
    if inverse:
        sin = -sin
    out = np.empty_like(xs)
    R = xs.shape[-1]
    for idx in np.ndindex(*xs.shape[:-1]):
        # idx = (s,), (b, s) or (b, s, h)
        if xs.ndim == 2:
            b, s = None, idx[0]
        else:
            b, s = idx[0], idx[1]
        fi = (b, s) if freqs.dim() == 3 else (s,)
        for i in range(R // 2):
            a, bb = xs[idx + (2 * i,)], xs[idx + (2 * i + 1,)]
            c, sn = cos[fi + (i,)], sin[fi + (i,)]
            out[idx + (2 * i,)] = a * c - bb * sn
            out[idx + (2 * i + 1,)] = a * sn + bb * c
    return out


def _rand_freqs(shape, g):
    ang = torch.rand(shape, generator=g, dtype=torch.float64) * 2 * math.pi
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64)


ROPE_CASES = [
    # x shape, freqs per sequence?
    ((5, 6), False),
    ((1, 8), False),
    ((2, 3, 10), False),
    ((3, 4, 2), True),
    ((2, 3, 3, 8), False),
    ((2, 5, 1, 6), True),
    ((1, 2, 4, 64), False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,per_seq", ROPE_CASES)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope(dtype, shape, per_seq, inverse, rng):
    g = rng
    x = torch.randn(shape, generator=g).to(dtype)
    S = shape[1] if len(shape) >= 3 else shape[0]
    R = shape[-1]
    fshape = (shape[0], S, R // 2) if per_seq else (S, R // 2)
    freqs = _rand_freqs(fshape, g)
    y = ops.rope(x, freqs, inverse=inverse)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, _rope64(x, freqs, inverse), dtype, scale=3.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,pairs,per_seq", [((5, 6), 1, False), ((2, 3, 10), 2, True), ((2, 3, 3, 16), 4, False),
                                                 ((1, 2, 4, 64), 3, True)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_table(dtype, shape, pairs, per_seq, inverse, rng):
    """A table of P < R/2 pairs rotates the last 2P channels and copies the others bit for bit."""
    x = torch.randn(shape, generator=rng).to(dtype)
    S = shape[1] if len(shape) >= 3 else shape[0]
    freqs = _rand_freqs((shape[0], S, pairs) if per_seq else (S, pairs), rng)
    y = ops.rope(x, freqs, inverse=inverse)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y[..., :-2 * pairs], x[..., :-2 * pairs])
    _close(y[..., -2 * pairs:], _rope64(x[..., -2 * pairs:], freqs, inverse), dtype, scale=3.0)


@pytest.mark.parametrize("shape,per_seq", ROPE_CASES)
def test_rope_inverse_undoes_forward(shape, per_seq, rng):
    g = rng
    x = torch.randn(shape, generator=g)
    S = shape[1] if len(shape) >= 3 else shape[0]
    fshape = (shape[0], S, shape[-1] // 2) if per_seq else (S, shape[-1] // 2)
    freqs = _rand_freqs(fshape, g)
    back = ops.rope(ops.rope(x, freqs), freqs, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)
    # rotation preserves the norm of each pair
    y = ops.rope(x, freqs)
    pn = lambda t: t.reshape(*t.shape[:-1], -1, 2).pow(2).sum(-1)
    torch.testing.assert_close(pn(y), pn(x), rtol=1e-5, atol=1e-5)


def test_rope_does_not_mutate_and_non_contiguous(rng):
    g = rng
    base = torch.randn(2, 4, 3, 11, generator=g)
    x = base[..., 1:9]  # non-contiguous view, odd row stride
    x_copy = x.clone()
    freqs = _rand_freqs((4, 4), g)
    y = ops.rope(x, freqs)
    assert torch.equal(x, x_copy)
    _close(y, _rope64(x, freqs, False), torch.float32, scale=3.0)
    xt = torch.randn(6, 2, 8, generator=g).transpose(0, 1)  # [B=2, S=6, R=8], non-contiguous
    freqs = _rand_freqs((6, 4), g)
    _close(ops.rope(xt, freqs), _rope64(xt, freqs, False), torch.float32, scale=3.0)


def test_rope_with_rope_table_positions(rng):
    # rotating position p by table[p] then taking the dot product of q at p and k at p' depends
    # only on p - p' (the defining property of rotary embeddings)
    t = flashrt.rope_table(16, 32, 10000.0)
    g = rng
    q = torch.randn(1, 16, generator=g).expand(32, 16).contiguous()
    k = torch.randn(1, 16, generator=g).expand(32, 16).contiguous()
    qr, kr = ops.rope(q, t), ops.rope(k, t)
    d = lambda a, b: float((qr[a] * kr[b]).sum())
    assert d(5, 2) == pytest.approx(d(20, 17), rel=1e-4, abs=1e-4)
    assert d(0, 0) == pytest.approx(float((q[0] * k[0]).sum()), rel=1e-5, abs=1e-5)


def test_rope_errors():
    f = _rand_freqs((4, 3), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="x"):
        ops.rope(torch.randn(6), f)  # 1-D
    with pytest.raises(ValueError, match="x"):
        ops.rope(torch.randn(1, 1, 4, 1, 6), f)  # 5-D
    with pytest.raises(ValueError, match="x"):
        ops.rope(torch.randn(4, 7), f)  # odd R
    with pytest.raises(ValueError, match="x"):
        ops.rope(torch.randint(0, 3, (4, 6)), f)  # int dtype
    with pytest.raises(ValueError, match="freqs_cis"):
        ops.rope(torch.randn(5, 6), f)  # S mismatch
    with pytest.raises(ValueError, match="freqs_cis"):
        ops.rope(torch.randn(4, 4), f)  # more table pairs than x has (fewer: the tail rotates)
    with pytest.raises(ValueError, match="freqs_cis"):
        ops.rope(torch.randn(4, 6), f.to(torch.complex128))
    with pytest.raises(ValueError, match="freqs_cis"):
        ops.rope(torch.randn(4, 6), f.real.contiguous())
    with pytest.raises(ValueError, match="freqs_cis"):
        ops.rope(torch.randn(2, 4, 6), f.unsqueeze(0).expand(3, 4, 3))  # per-sequence B mismatch
    with pytest.raises(ValueError, match="freqs_cis"):
        ops.rope(torch.randn(4, 6), f.unsqueeze(0).expand(4, 4, 3))  # per-sequence needs batch
    with pytest.raises(ValueError, match="freqs_cis"):
        ops.rope(torch.randn(2, 4, 2, 6), f.unsqueeze(0))  # B=1 given, 2 expected


# ---------------------------------------------------------------------------------- rope_table


def _table64(dim, max_len, base, yarn=None):
    half = dim // 2
    f = np.array([base ** (-2.0 * i / dim) for i in range(half)], dtype=np.float64)
    if yarn is not None:
        orig, factor, beta_fast, beta_slow = yarn
        corr = lambda r: dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))
        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        ramp = np.array([min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0) for i in range(half)])
        f = f / factor * ramp + f * (1 - ramp)
    ang = np.outer(np.arange(max_len, dtype=np.float64), f)
    return np.exp(1j * ang), ang


def _check_table(t, dim, max_len, base, yarn=None):
    assert t.dtype == torch.complex64 and tuple(t.shape) == (max_len, dim // 2)
    want, ang = _table64(dim, max_len, base, yarn)
    err = np.abs(t.numpy().astype(np.complex128) - want)
    # fp32 angles: the frequency (a pow in fp32) and the product p * f each carry a few ulp
    bound = 2e-6 + 1e-6 * ang
    assert np.all(err <= bound), f"max err {err.max():.3g} (excess {(err - bound).max():.3g})"


@pytest.mark.parametrize("dim,max_len,base", [(64, 300, 10000.0), (2, 5, 10000.0), (6, 17, 500.0), (128, 64, 160000.0)])
def test_rope_table_plain(dim, max_len, base):
    _check_table(flashrt.rope_table(dim, max_len, base), dim, max_len, base)


YARN = (65536, 16.0, 32.0, 1.0)


@pytest.mark.parametrize("yarn_arg", [
    YARN,
    dict(original_seq_len=65536, factor=16.0, beta_fast=32.0, beta_slow=1.0),
    "dataclass",
])
def test_rope_table_yarn(yarn_arg):
    if yarn_arg == "dataclass":
        from flashrt.rope import YaRN

        yarn_arg = YaRN(65536, 16.0)  # default betas 32 / 1
    dim, max_len, base = 64, 257, 160000.0
    t = flashrt.rope_table(dim, max_len, base, yarn_arg)
    _check_table(t, dim, max_len, base, YARN)
    # YaRN changes the table: some low frequencies are divided by the factor, high ones kept
    plain = flashrt.rope_table(dim, max_len, base)
    assert torch.allclose(t[:, :10], plain[:, :10])
    assert not torch.allclose(t[:, -3:], plain[:, -3:])


def test_rope_table_yarn_ramp_values():
    # dim 64, base 160000, orig 65536: corr(32) = 15.45 -> low 15, corr(1) = 24.71 -> high 25
    dim, base = 64, 160000.0
    t = flashrt.rope_table(dim, 2, base, YARN)
    f_got = torch.angle(t[1]).to(torch.float64).numpy()
    f = np.array([base ** (-2.0 * i / dim) for i in range(dim // 2)])
    ratio = f_got / f
    np.testing.assert_allclose(ratio[:16], 1.0, rtol=1e-5)
    np.testing.assert_allclose(ratio[25:], 1 / 16, rtol=1e-5)
    for i in range(16, 25):
        r = (i - 15) / 10
        assert ratio[i] == pytest.approx((1 - r) + r / 16, rel=1e-5)


def test_rope_table_long_positions():
    # precision at large positions stays within fp32 angle rounding
    dim, base = 64, 160000.0
    t = flashrt.rope_table(dim, 4096, base, YARN)
    _check_table(t, dim, 4096, base, YARN)


def test_rope_table_errors():
    with pytest.raises(ValueError, match="dim"):
        flashrt.rope_table(7, 10, 10000.0)
    with pytest.raises(ValueError, match="dim"):
        flashrt.rope_table(0, 10, 10000.0)
    with pytest.raises(ValueError, match="max_len"):
        flashrt.rope_table(8, 0, 10000.0)


@pytest.mark.parametrize("fmt", ["fp8", "fp4_b16", "fp4_b32", "int8"])
@pytest.mark.parametrize("norm", [True, False])
def test_norm_rope_quantize_against_float64_steps(fmt, norm, rng):
    """The norm and the rope in float64, each rounded to x.dtype as the op says, then quantized by
    :mod:`flashrt.formats`: the op's bytes, but for an element a float64 step rounds differently."""
    B, S, D, P = 2, 3, 64, 8
    x = (torch.randn(B, S, D, generator=rng) * 3).to(torch.bfloat16)
    w = torch.randn(D, generator=rng).to(torch.bfloat16) if norm else None
    f = torch.polar(torch.ones(B, S, P), torch.rand(B, S, P, generator=rng) * 6.3)
    q = ops.norm_rope_quantize(x, w, 1e-6, f, fmt)
    y = x.double()
    if norm:
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).to(torch.bfloat16).double()
    tail = torch.view_as_complex(y[..., -2 * P:].reshape(B, S, P, 2).contiguous()) * f.to(torch.complex128)
    y = torch.cat([y[..., :-2 * P], torch.view_as_real(tail).reshape(B, S, 2 * P)], -1).to(torch.bfloat16)
    want = formats.quantize(y, fmt)
    assert q.fmt == fmt and q.shape == x.shape
    assert (q.data.view(torch.uint8) != want.data.view(torch.uint8)).float().mean() < 0.02
    assert (q.scale.view(torch.uint8) != want.scale.view(torch.uint8)).float().mean() < 0.1


@pytest.mark.parametrize("fmt", ["fp8", "fp4_b16", "fp4_b32"])
@pytest.mark.parametrize("out", [None, torch.bfloat16, torch.float32])
def test_norm_rope_quantize_heads_and_fake_quant_against_float64(fmt, out, rng):
    """``[B, S, H, D]`` rows (every head of a (b, s) rotated by its table entry) and the fake
    quantization (``dequantize_to``): the rope in float64 rounded to x.dtype, quantized and decoded
    by :mod:`flashrt.formats`; the op's values equal those but for an element the rounding moves."""
    B, S, H, D, P = 2, 3, 4, 64, 8
    x = (torch.randn(B, S, H, D, generator=rng) * 3).to(torch.bfloat16)
    f = torch.polar(torch.ones(B, S, P), torch.rand(B, S, P, generator=rng) * 6.3)
    got = ops.norm_rope_quantize(x, None, 0.0, f, fmt, out)
    y = x.double()
    tail = torch.view_as_complex(y[..., -2 * P:].reshape(B, S, H, P, 2).contiguous()) * f.to(torch.complex128)[:, :, None]
    y = torch.cat([y[..., :-2 * P], torch.view_as_real(tail).reshape(B, S, H, 2 * P)], -1).to(torch.bfloat16)
    q = formats.quantize(y, fmt)
    if out is None:
        assert got.fmt == fmt and got.shape == x.shape
        assert (got.data.view(torch.uint8) != q.data.view(torch.uint8)).float().mean() < 0.02
        return
    want = formats.dequantize(q, out)
    assert got.dtype == out and got.shape == x.shape
    assert (got != want).float().mean() < 0.02
    assert (got.double() - want.double()).abs().max() <= 0.5 * want.double().abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
def test_norm_rope_without_quantization_against_float64(dtype, norm, rng):
    """``fmt`` None (the attention's query heads): the norm and the rope in float64, each rounded to
    x.dtype as the op says; the op returns those rows in x.dtype but for an element a float64 step
    rounds differently."""
    B, S, H, D, P = 2, 3, 4, 64, 8
    x = (torch.randn(B, S, H, D, generator=rng) * 3).to(dtype)
    w = (torch.randn(D, generator=rng) + 1).to(dtype) if norm else None
    f = torch.polar(torch.ones(B, S, P), torch.rand(B, S, P, generator=rng) * 6.3)
    got = ops.norm_rope_quantize(x, w, 1e-6, f, None)
    y = x.double()
    if norm:
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).to(dtype).double()
    tail = torch.view_as_complex(y[..., -2 * P:].reshape(B, S, H, P, 2).contiguous()) * f.to(torch.complex128)[:, :, None]
    want = torch.cat([y[..., :-2 * P], torch.view_as_real(tail).reshape(B, S, H, 2 * P)], -1).to(dtype)
    assert got.dtype == dtype and got.shape == x.shape
    ulp = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -23
    if dtype == torch.bfloat16:  # fp32 rows differ from float64 in their last bits
        assert (got != want).float().mean() < 0.02
    assert ((got.double() - want.double()).abs() <= 4 * ulp * want.double().abs().clamp_min(1e-3)).float().mean() > 0.98
    assert (got.double() - want.double()).abs().max() <= 4 * ulp * want.double().abs().max()


def test_norm_rope_quantize_errors(rng):
    x = torch.randn(1, 2, 64)
    f = torch.polar(torch.ones(1, 2, 8), torch.zeros(1, 2, 8))
    with pytest.raises(ValueError, match="fmt"):
        ops.norm_rope_quantize(x, None, 0.0, f, "fp8_w")
    with pytest.raises(ValueError, match="freqs_cis"):
        ops.norm_rope_quantize(x, None, 0.0, f[0], "fp8")
    with pytest.raises(ValueError, match="freqs_cis"):
        ops.norm_rope_quantize(x, None, 0.0, torch.polar(torch.ones(1, 2, 40), torch.zeros(1, 2, 40)), "fp8")
    with pytest.raises(ValueError, match="weight"):
        ops.norm_rope_quantize(x, torch.ones(63), 1e-6, f, "fp8")
    with pytest.raises(ValueError, match="eps"):
        ops.norm_rope_quantize(x, torch.ones(64), -1.0, f, "fp8")
    with pytest.raises(ValueError, match="x"):
        ops.norm_rope_quantize(x[0], None, 0.0, f, "fp8")
    with pytest.raises(ValueError, match="^x: expected .*B, S, H, D.*got"):
        ops.norm_rope_quantize(x.view(1, 2, 2, 2, 16), None, 0.0, f, "fp8")
    with pytest.raises(ValueError, match="^dequantize_to: expected"):
        ops.norm_rope_quantize(x, None, 0.0, f, "fp8", torch.int32)
    with pytest.raises(ValueError, match="^dequantize_to: expected None when fmt is None"):
        ops.norm_rope_quantize(x, None, 0.0, f, None, torch.float32)
