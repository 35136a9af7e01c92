"""An independent codec for the quantized formats of docs/ops.md, used by the test_formats* files.

Element rounding goes through ``ml_dtypes`` (float32 -> E4M3 / E2M1, nearest even); the scale
rules are decided exactly in float64 by comparing the block amax against ``elem_max * 2**k`` or
``6 * (E4M3 midpoint)``, all exact float64 numbers, so no division is rounded on that path.
Nothing here calls into ``flashrt``.
"""
import ml_dtypes
import numpy as np
import torch

BLOCK = {"fp8": 32, "fp4_b16": 16, "fp4_b32": 32, "fp8_w": 32, "fp4_w": 32}
FLOOR = {"fp8": 1e-4, "fp8_w": 1e-4, "fp4_b16": 6 * 2.0**-9, "fp4_b32": 6 * 2.0**-126, "fp4_w": 6 * 2.0**-126}
PACKED = {"fp4_b16", "fp4_b32", "fp4_w"}

# all finite non-negative E4M3 values, index = byte (0x7F is NaN)
E4M3_POS = np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
E2M1_ALL = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
assert list(E2M1_ALL[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6] and E4M3_POS[-1] == 448


def to_np(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float32).cpu().numpy()


def pow2_scale_exp(amax: np.ndarray, elem_max: float, floor: float) -> np.ndarray:
    """Smallest integer k with ``2**k >= max(amax, floor) / elem_max`` (exact)."""
    m = np.maximum(amax.astype(np.float64), floor)
    k = np.ceil(np.log2(m / elem_max)).astype(np.int64)
    k = np.where(np.ldexp(elem_max, k - 1) >= m, k - 1, k)  # log2 guess one too high
    k = np.where(np.ldexp(elem_max, k) < m, k + 1, k)  # ... or one too low
    assert np.all(np.ldexp(elem_max, k) >= m) and np.all(np.ldexp(elem_max, k - 1) < m)
    return k


def e4m3_scale_byte(amax: np.ndarray) -> np.ndarray:
    """E4M3 byte nearest (ties even) to ``max(amax, 6 * 2**-9) / 6`` clamped to 448 (exact)."""
    m = np.maximum(amax.astype(np.float64), 6 * 2.0**-9)
    mids6 = 6 * (E4M3_POS[:-1] + E4M3_POS[1:]) / 2  # exact in float64
    lo = np.searchsorted(mids6, m, side="left")  # midpoints strictly below m
    tie = (lo < len(mids6)) & (mids6[np.minimum(lo, len(mids6) - 1)] == m)
    return np.where(tie & (lo % 2 == 1), lo + 1, lo).astype(np.uint8)


def block_scales(amax: np.ndarray, fmt: str):
    """(stored byte, fp64 scale value) per block for block maxima ``amax``."""
    if fmt == "fp4_b16":
        b = e4m3_scale_byte(amax)
        return b, E4M3_POS[b]
    k = pow2_scale_exp(amax, 6.0 if fmt in PACKED else 448.0, FLOOR[fmt])
    assert np.all((k >= -127) & (k <= 127))
    return (k + 127).astype(np.uint8), np.ldexp(1.0, k)


def element_codes(x: np.ndarray, scale: np.ndarray, fmt: str) -> np.ndarray:
    """uint8 codes of fp32 ``x / scale`` (IEEE fp32 division), clamped, nearest even."""
    q = x.astype(np.float32) / scale.astype(np.float32)
    if fmt in PACKED:
        return np.clip(q, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def pack(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def element_values(codes: np.ndarray, fmt: str) -> np.ndarray:
    if fmt in PACKED:
        return E2M1_ALL[codes]
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def ref_quantize(x: np.ndarray, fmt: str):
    """(data bytes, scale bytes, codes, full per-element fp64 scale, dequantized fp64) of ``x``."""
    x = np.asarray(x, dtype=np.float32)
    blk = BLOCK[fmt]
    if fmt == "fp8_w":
        *lead, rows, cols = x.shape
        tr, tc = -(-rows // blk), -(-cols // blk)
        pad = np.zeros((*lead, tr * blk, tc * blk), np.float32)
        pad[..., :rows, :cols] = np.abs(x)
        amax = pad.reshape(*lead, tr, blk, tc, blk).max(axis=(-1, -3))
        sbyte, sval = block_scales(amax, fmt)
        full = np.repeat(np.repeat(sval, blk, -2), blk, -1)[..., :rows, :cols]
    else:
        n = x.shape[-1]
        amax = np.abs(x).reshape(*x.shape[:-1], n // blk, blk).max(axis=-1)
        sbyte, sval = block_scales(amax, fmt)
        full = np.repeat(sval, blk, -1)
    codes = element_codes(x, full, fmt)
    data = pack(codes) if fmt in PACKED else codes
    return data, sbyte, codes, full, element_values(codes, fmt) * full


def q_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a uint8 / float8 tensor as numpy uint8."""
    return t.contiguous().view(torch.uint8).cpu().numpy()


def rand_input(shape, dtype, rng: torch.Generator, spread: int = 40) -> torch.Tensor:
    """randn with per-row magnitudes 2**[-spread, spread), per-element 2**[-12, 3), some +-0."""
    shape = tuple(shape)
    x = torch.randn(shape, generator=rng, dtype=torch.float64)
    row = torch.randint(-spread, spread, shape[:-1] + (1,), generator=rng).to(torch.float64)
    elem = torch.randint(-12, 3, shape, generator=rng).to(torch.float64)
    x = x * torch.exp2(row + elem)
    u = torch.rand(shape, generator=rng)
    x = torch.where(u < 0.04, torch.zeros_like(x), x)
    x = torch.where(u > 0.98, torch.full_like(x, -0.0), x)
    return x.to(dtype)
