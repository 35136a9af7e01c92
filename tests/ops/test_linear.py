"""linear against an independent float64 computation (fp8 activation quantization, weight
dequantization from the stored bytes with ml_dtypes / explicit nibble decoding)."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from flashrt import QTensor, ops

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _pow2_at_least(v: float) -> float:
    m, e = math.frexp(v)  # v = m * 2**e, m in [0.5, 1)
    return v if m == 0.5 else math.ldexp(1.0, e)


def fp8_act_quant64(x: np.ndarray) -> np.ndarray:
    """fp8 (E4M3, per 32 along the last dim, UE8M0 scale) quantize-dequantize, in float64."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    flat, fo = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
    for r in range(flat.shape[0]):
        for b0 in range(0, flat.shape[1], 32):
            blk = flat[r, b0 : b0 + 32]
            scale = _pow2_at_least(max(float(np.abs(blk).max()), 1e-4) / 448.0)
            q = np.clip(blk / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            fo[r, b0 : b0 + 32] = q * scale
    return out


def _e8m0(scale: torch.Tensor) -> np.ndarray:
    return np.exp2(scale.view(torch.uint8).numpy().astype(np.float64) - 127.0)


def dequant_w64(w: QTensor) -> np.ndarray:
    """Independent dequantization of an fp8_w / fp4_w QTensor [..., out, in] from its bytes."""
    out_dim, in_dim = w.shape[-2:]
    scale = _e8m0(w.scale)
    if w.fmt == "fp8_w":
        el = w.data.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        res = np.empty(el.shape)
        for o in range(out_dim):
            for i0 in range(0, in_dim, 32):
                res[..., o, i0 : i0 + 32] = el[..., o, i0 : i0 + 32] * scale[..., o // 32, i0 // 32, None]
        return res
    assert w.fmt == "fp4_w"
    b = w.data.numpy().astype(np.int64)
    codes = np.empty(b.shape[:-1] + (in_dim,), dtype=np.int64)
    codes[..., 0::2] = b & 0xF
    codes[..., 1::2] = b >> 4
    el = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
    return el * np.repeat(scale, 32, axis=-1)


def _elem_scale(w: QTensor) -> np.ndarray:
    s = _e8m0(w.scale)
    out_dim, in_dim = w.shape[-2:]
    if w.fmt == "fp8_w":
        return np.repeat(np.repeat(s, 32, axis=-2), 32, axis=-1)[..., :out_dim, :in_dim]
    return np.repeat(s, 32, axis=-1)


def _check_w_error(w64, w, wq):
    """Rounding to nearest: E4M3 half-ulp 2**-4 relative (subnormal step 2**-9), E2M1 steps."""
    w = w.double().numpy()
    s = _elem_scale(wq)
    if wq.fmt == "fp8_w":
        bound = 2.0**-4 * np.abs(w) + 2.0**-10 * s
    else:
        bound = 0.25 * np.abs(w) + 0.25 * s
    assert np.all(np.abs(w64 - w) <= bound * (1 + 1e-9))


def _check(got, x, w64, xq64):
    """got (x.dtype) vs xq64 @ w64.T; bound: fp32 accumulation + one rounding to x.dtype."""
    want = xq64 @ w64.T
    mag = np.abs(xq64) @ np.abs(w64).T
    g = got.to(torch.float64).numpy()
    rel = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x.dtype]
    bound = rel * np.abs(want) + 1e-6 * (1 + math.sqrt(w64.shape[-1])) * mag + 1e-30
    err = np.abs(g - want)
    assert np.all(err <= bound), f"max err {err.max():.3g}, worst excess {(err - bound).max():.3g}"


def _x(shape, dtype, g, scale=1.0):
    x = torch.randn(shape, generator=g) * scale
    return x.to(dtype)


XSHAPES = [(5,), (3, 64), (2, 3, 64), (1, 1, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("xshape,out", [((7,), 3), ((3, 13), 1), ((2, 5, 24), 17), ((4, 64), 33)])
def test_linear_plain(dtype, wdtype, xshape, out, rng):
    g = rng
    x = _x(xshape, dtype, g)
    w = _x((out, xshape[-1]), wdtype, g)
    y = ops.linear(x, w)
    assert y.dtype == dtype and y.shape == (*xshape[:-1], out)
    xf = x.to(torch.float64).numpy().reshape(-1, xshape[-1])
    _check(y.reshape(-1, out), x, w.to(torch.float64).numpy(), xf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8_w", "fp4_w"])
@pytest.mark.parametrize("xshape,out", [((32,), 5), ((3, 64), 33), ((2, 3, 96), 7), ((1, 4, 128), 64), ((9, 32), 1)])
def test_linear_quantized(dtype, fmt, xshape, out, rng):
    g = rng
    x = _x(xshape, dtype, g, scale=2.0)
    # spread magnitudes across blocks so that scales differ (and some blocks are tiny)
    x = x * torch.logspace(-3, 2, xshape[-1]).to(dtype)[torch.randperm(xshape[-1], generator=g)]
    w = torch.randn(out, xshape[-1], generator=g) * 0.05
    wq = ops.quantize(w, fmt)
    assert isinstance(wq, QTensor) and wq.fmt == fmt
    y = ops.linear(x, wq)
    assert y.dtype == dtype and y.shape == (*xshape[:-1], out)
    w64 = dequant_w64(wq)
    # the dequantized weight is within half a step of the original (sanity check of the bytes)
    _check_w_error(w64, w, wq)
    xq = fp8_act_quant64(x.to(torch.float64).numpy().reshape(-1, xshape[-1]))
    _check(y.reshape(-1, out), x, w64, xq)
    # the activation quantization matters: the unquantized product differs measurably
    if x.dtype == torch.float32 and xshape[-1] >= 64:
        assert not np.allclose(y.reshape(-1, out).double().numpy(), x.double().numpy().reshape(-1, xshape[-1]) @ w64.T, rtol=1e-6, atol=0)


def test_linear_quantized_zero_and_extreme_blocks(rng):
    g = rng
    x = torch.randn(4, 96, generator=g)
    x[0, :32] = 0  # zero block: scale floor 1e-4 / 448
    x[1, 32:64] *= 1e-6  # below the floor
    x[2, 64:] *= 1e4  # large block
    x[3, 5] = 448.0 * 8  # an exact power-of-two scale boundary: amax / 448 = 8
    w = torch.randn(40, 96, generator=g)
    for fmt in ("fp8_w", "fp4_w"):
        wq = ops.quantize(w, fmt)
        y = ops.linear(x, wq)
        _check(y, x, dequant_w64(wq), fp8_act_quant64(x.double().numpy()))


def test_linear_fp8_w_tile_scales_independent(rng):
    # tiles of very different magnitude along out and in: every tile has its own scale
    g = rng
    w = torch.randn(70, 64, generator=g)
    w[:32, :32] *= 100
    w[32:64, 32:] *= 1e-3
    w[64:] *= 7
    wq = ops.quantize(w, "fp8_w")
    assert tuple(wq.scale.shape) == (3, 2)
    x = torch.randn(5, 64, generator=g)
    y = ops.linear(x, wq)
    w64 = dequant_w64(wq)
    _check_w_error(w64, w, wq)
    _check(y, x, w64, fp8_act_quant64(x.double().numpy()))


def test_linear_does_not_mutate(rng):
    g = rng
    x = torch.randn(3, 64, generator=g)
    w = torch.randn(8, 64, generator=g)
    wq = ops.quantize(w, "fp4_w")
    xc, dc, sc = x.clone(), wq.data.clone(), wq.scale.clone()
    ops.linear(x, wq)
    ops.linear(x, w)
    assert torch.equal(x, xc) and torch.equal(wq.data, dc) and torch.equal(wq.scale.view(torch.uint8), sc.view(torch.uint8))


def test_linear_errors(rng):
    g = rng
    x = torch.randn(3, 64, generator=g)
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, torch.randn(5, 63))  # in mismatch
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, torch.randn(5, 64, 1))  # rank
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, torch.ones(5, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, ops.quantize(torch.randn(5, 96), "fp8_w"))  # quantized in mismatch
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, ops.quantize(torch.randn(5, 96), "fp4_w"))
    # quantized weight needs in % 32 == 0 (fp8 activations)
    with pytest.raises(ValueError, match="x"):
        ops.linear(torch.randn(3, 48), ops.quantize(torch.randn(5, 48), "fp8_w"))
    # wrong format: activation / KV formats are not weight formats
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, ops.quantize(torch.randn(5, 64), "fp8"))
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, ops.quantize(torch.randn(5, 64), "fp4_b32"))
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, ops.quantize(torch.randn(5, 64), "fp4_b16"))
    # a corrupted QTensor layout
    wq = ops.quantize(torch.randn(5, 64), "fp4_w")
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, QTensor(wq.data, wq.scale[:, :1], "fp4_w", wq.shape))
    with pytest.raises(ValueError, match="x"):
        ops.linear(torch.randint(0, 3, (3, 64)), torch.randn(5, 64))
    with pytest.raises(ValueError, match="x"):
        ops.linear(torch.tensor(1.0), torch.randn(5, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_is_each_group_times_its_rows(dtype, rng):
    B, S, G, k, out = 2, 3, 4, 24, 5
    x = _x((B, S, G, k), dtype, rng)
    w = _x((G * out, k), torch.bfloat16, rng)
    y = ops.grouped_linear(x, w)
    assert y.dtype == dtype and y.shape == (B, S, G * out)
    for g in range(G):
        xf = x[:, :, g].to(torch.float64).numpy().reshape(-1, k)
        _check(y[..., g * out:(g + 1) * out].reshape(-1, out), x[:, :, g], w[g * out:(g + 1) * out].to(torch.float64).numpy(), xf)
    with pytest.raises(ValueError, match="weight"):
        ops.grouped_linear(x, w[:-1])  # rows not a multiple of G
    with pytest.raises(ValueError, match="weight"):
        ops.grouped_linear(x, w[:, :-1])
    with pytest.raises(ValueError, match="x"):
        ops.grouped_linear(x[0, 0, 0], w)


@pytest.mark.parametrize("wkind", ["bf16", "fp8_w", "fp4_w"])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float64)])
def test_linear_out_dtype_rounds_the_sums_once(wkind, dtype, out_dtype, rng):
    """``out_dtype``: the result of the same sums rounded once to it: bit for bit ``linear`` of x
    in the wider dtype (x exact there) for a wider output, and that fp32 result rounded for a
    narrower one; checked against float64 as the default output is."""
    x = _x((3, 64), dtype, rng)
    w = torch.randn(33, 64, generator=rng) * 0.05
    w = w.to(torch.bfloat16) if wkind == "bf16" else ops.quantize(w, wkind)
    y = ops.linear(x, w, out_dtype)
    assert y.dtype == out_dtype and y.shape == (3, 33)
    wide = ops.linear(x.to(torch.float64) if out_dtype == torch.float64 else x.float(), w)
    assert torch.equal(y, wide.to(out_dtype))
    w64 = w.to(torch.float64).numpy() if wkind == "bf16" else dequant_w64(w)
    xf = x.to(torch.float64).numpy()
    if out_dtype != torch.float64:  # (the bound's rounding is that of the output dtype)
        _check(y, y, w64, xf if wkind == "bf16" else fp8_act_quant64(xf))


def test_linear_out_dtype_errors(rng):
    x, w = torch.randn(3, 64, generator=rng), torch.randn(5, 64, generator=rng)
    for bad in (torch.int32, "float32"):
        with pytest.raises(ValueError, match=r"^out_dtype: expected"):
            ops.linear(x.bfloat16(), w, bad)
