"""Quantize / dequantize (``fp8``, ``fp4_b16``, ``fp4_b32``) and a fused quantize-and-store.

Bit-exact with :mod:`flashrt.formats`. A quantize program handles ``BLOCK_R`` rows x ``BLOCK_C``
scale blocks (a ``[BLOCK_R * BLOCK_C, block]`` tile, ``ELEMS`` elements): block amax, scale,
elements, packing, stores. Rounding never goes through Triton's float8 conversion (the
interpreter's is not round-to-nearest-even, and sm_80 has none):

- power-of-two scales come from the fp32 bit pattern of ``max(amax, floor) / elem_max``
  (exponent + (mantissa != 0), as ``formats.pow2_ceil``), the division correctly rounded
  (``div_rn``); elements are ``x * 2**-k`` (exact, the same value as ``x / 2**k``);
- the ``fp4_b16`` scale and its elements use ``div_rn``; E4M3 rounding is done on the bits
  (:func:`_e4m3_rne`), E2M1 by comparisons with the midpoints (ties to even), sign from bit 31.

``quantize_store`` writes row ``i`` of ``x`` into cache row ``slot_mapping[i]`` of a paged cache
(``-1`` skipped), without materialising the QTensor. Weight formats (``fp8_w``, ``fp4_w``) are
declined: weights are quantized offline.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from flashrt import formats
from flashrt.formats import QTensor
from flashrt import profiles
from flashrt.kernels_cuda import _warmup

TILES = {
    "quantize": {"ELEMS": 4096, "num_warps": 4},  # BLOCK_G = ELEMS // block scale blocks a program
    "dequantize": {"ELEMS": 4096, "num_warps": 4},
}


def _tiles() -> dict:
    """TILES with the active hardware profile's overrides (``tiles.quant`` in its YAML)."""
    return profiles.tiles("quant", TILES)
_FMT = {"fp8": 0, "fp4_b16": 1, "fp4_b32": 2}  # kernel code; block size from formats.spec
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # kernels run in Triton's CPU interpreter
_INTERPRETED = tl.constexpr(INTERPRETED)


@triton.jit
def _to_out(y, out_ptr):
    """fp32 ``y`` as ``out_ptr``'s element type, nearest even (the interpreter's bf16 cast truncates)."""
    if _INTERPRETED and out_ptr.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return y.to(out_ptr.dtype.element_ty)


@triton.jit
def _e4m3_rne(v):
    """E4M3 byte (int32) of fp32 ``v`` with ``|v| <= 448``: nearest, ties to even, sign kept."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a_bits = bits & 0x7FFFFFFF
    lsb = (a_bits >> 20) & 1
    normal = ((a_bits + 0x7FFFF + lsb) >> 20) - (120 << 3)  # rebias 127 -> 7, 3 mantissa bits
    q = tl.minimum(a_bits.to(tl.float32, bitcast=True), 0.015625) * 512.0  # subnormal units of 2**-9
    n = q.to(tl.int32)
    frac = q - n.to(tl.float32)
    sub = n + ((frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))).to(tl.int32)
    return tl.where(a_bits < 0x3C800000, sub, normal) | sign  # 0x3C800000 = 2**-6


@triton.jit
def _e4m3_value(b):
    """fp32 value of E4M3 bytes ``b`` (int32; NaN for 0x7F / 0xFF), decoded on the bits (any arch)."""
    exp = (b >> 3) & 0xF
    man = b & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2**-9
    val = tl.where((b & 0x80) != 0, -mag, mag)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), val)


@triton.jit
def _e8m0_value(e):
    """fp32 value 2**(e - 127) of UE8M0 bytes ``e`` (int32; 0 -> 2**-127, 255 -> NaN)."""
    bits = tl.where(e == 0, 0x00400000, tl.where(e == 255, 0x7FC00000, e << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_code(v):
    """E2M1 codes (int32, sign in bit 3) of fp32 ``v``: clamp to 6, nearest, ties to even."""
    a = tl.minimum(tl.abs(v), 6.0)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _e2m1_value(code):
    """fp32 value of E2M1 codes (int32 in 0..15); code 8 is -0.0."""
    mag = (code & 7).to(tl.float32)
    val = tl.where(mag < 4.0, mag * 0.5, tl.where(mag < 6.0, mag - 2.0, mag * 2.0 - 8.0))
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def _block_scale(amax, FMT: tl.constexpr):
    """(stored byte int32, scale fp32, 1 / scale fp32) for fp32 block maxima."""
    if FMT == 1:  # fp4_b16: e4m3(max(amax, 6 * 2**-9) / 6), clamped to 448
        v = tl.math.div_rn(tl.maximum(amax, 0.01171875), tl.full(amax.shape, 6.0, tl.float32))
        byte = _e4m3_rne(tl.minimum(v, 448.0))
        scale = _e4m3_value(byte)
        return byte, scale, scale
    if FMT == 0:  # fp8: 2**ceil(log2(max(amax, 1e-4) / 448))
        v = tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
    else:  # fp4_b32: 2**ceil(log2(max(amax, 6 * 2**-126) / 6))
        v = tl.math.div_rn(tl.maximum(amax, 7.052966104933725e-38), tl.full(amax.shape, 6.0, tl.float32))
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 1), 254)  # the floors keep e >= 1
    recip_bits = tl.where(e >= 254, 0x00200000, (254 - e) << 23)  # 2**(127 - e), 2**-127 subnormal
    return e, _e8m0_value(e), recip_bits.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(x_ptr, data_ptr, scale_ptr, slot_ptr, n_rows, groups_per_row,
                     x_row_stride, data_row_stride, scale_row_stride,
                     FMT: tl.constexpr, BLK: tl.constexpr, HAS_SLOTS: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    i = tl.arange(0, BLOCK_R * BLOCK_C)  # BLOCK_R rows x BLOCK_C scale blocks, flattened
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + i // BLOCK_C
    col = tl.program_id(1) * BLOCK_C + i % BLOCK_C
    gmask = (row < n_rows) & (col < groups_per_row)
    dst = row
    if HAS_SLOTS:
        dst = tl.load(slot_ptr + row, mask=gmask, other=-1).to(tl.int64)
        gmask = gmask & (dst >= 0)
    e = tl.arange(0, BLK)
    x = tl.load(x_ptr + row[:, None] * x_row_stride + col[:, None] * BLK + e[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float32)
    byte, scale, recip = _block_scale(tl.max(tl.abs(x), axis=1), FMT)
    tl.store(scale_ptr + dst * scale_row_stride + col, byte.to(tl.uint8), mask=gmask)
    if FMT == 0:
        v = tl.minimum(tl.maximum(x * recip[:, None], -448.0), 448.0)
        tl.store(data_ptr + dst[:, None] * data_row_stride + col[:, None] * BLK + e[None, :],
                 _e4m3_rne(v).to(tl.uint8), mask=gmask[:, None])
    else:
        if FMT == 1:
            v = tl.math.div_rn(x, scale[:, None])
        else:
            v = x * recip[:, None]
        lo, hi = tl.split(tl.reshape(_e2m1_code(v), (BLOCK_R * BLOCK_C, BLK // 2, 2)))
        h = tl.arange(0, BLK // 2)
        tl.store(data_ptr + dst[:, None] * data_row_stride + col[:, None] * (BLK // 2) + h[None, :],
                 (lo | (hi << 4)).to(tl.uint8), mask=gmask[:, None])


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, out_ptr, n_groups,
                       FMT: tl.constexpr, BLK: tl.constexpr, BLOCK_G: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = g < n_groups
    sbyte = tl.load(scale_ptr + g, mask=gmask, other=0).to(tl.int32)
    if FMT == 1:
        scale = _e4m3_value(sbyte)
    else:
        scale = _e8m0_value(sbyte)
    e = tl.arange(0, BLK)
    if FMT == 0:
        b = tl.load(data_ptr + g[:, None] * BLK + e[None, :], mask=gmask[:, None], other=0).to(tl.int32)
        v = _e4m3_value(b)
    else:
        h = tl.arange(0, BLK // 2)
        b = tl.load(data_ptr + g[:, None] * (BLK // 2) + h[None, :], mask=gmask[:, None], other=0).to(tl.int32)
        v = tl.reshape(tl.join(_e2m1_value(b & 15), _e2m1_value(b >> 4)), (BLOCK_G, BLK))
    out = v * scale[:, None]
    tl.store(out_ptr + g[:, None] * BLK + e[None, :], _to_out(out, out_ptr), mask=gmask[:, None])


def _launch_quantize(x2, fmt, data, scale, slots, data_row_stride, scale_row_stride):
    """Quantize rows of ``x2 [M, N]`` (unit last stride) into byte tensors ``data``/``scale``."""
    assert x2.dim() == 2 and x2.stride(-1) == 1 and data.dtype == scale.dtype == torch.uint8
    blk = formats.spec(fmt).block
    rows, groups_per_row = x2.shape[0], x2.shape[1] // blk
    if rows * groups_per_row == 0:
        return
    t = _tiles()["quantize"]
    block_g = t["ELEMS"] // blk
    block_c = min(triton.next_power_of_2(groups_per_row), block_g)
    block_r = block_g // block_c
    grid = (triton.cdiv(rows, block_r), triton.cdiv(groups_per_row, block_c))
    _quantize_kernel[grid](
        x2, data, scale, slots if slots is not None else data, rows, groups_per_row,
        x2.stride(0), data_row_stride, scale_row_stride, FMT=_FMT[fmt], BLK=blk, HAS_SLOTS=slots is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=t["num_warps"])


def quantize(x: torch.Tensor, fmt: str) -> QTensor:
    s = formats.spec(fmt)
    assert fmt in _FMT and x.dim() >= 1 and x.shape[-1] % s.block == 0
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    row_bytes = n // 2 if s.packed else n
    data = torch.empty(x2.shape[0], row_bytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(x2.shape[0], n // s.block, dtype=torch.uint8, device=x.device)
    _launch_quantize(x2, fmt, data, scale, None, row_bytes, n // s.block)
    data_shape, scale_shape = formats.expected_layout(fmt, x.shape)
    return QTensor(data.view(s.data_dtype).view(data_shape), scale.view(s.scale_dtype).view(scale_shape),
                   fmt, x.shape)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    s = formats.spec(q.fmt)
    assert q.fmt in _FMT
    data = q.data.contiguous().view(torch.uint8)
    scale = q.scale.contiguous().view(torch.uint8)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    n_groups = scale.numel()
    if n_groups:
        t = _tiles()["dequantize"]
        block_g = t["ELEMS"] // s.block
        _dequantize_kernel[(triton.cdiv(n_groups, block_g),)](data, scale, out, n_groups, FMT=_FMT[q.fmt],
                                                               BLK=s.block, BLOCK_G=block_g, num_warps=t["num_warps"])
    return out


def _cache_rows(cache: torch.Tensor, name: str, row_len: int) -> torch.Tensor:
    """A uint8 ``[num_slots, row_len]`` view of a cache tensor (no copy), unit last stride."""
    if cache.element_size() != 1 or cache.shape[-1] != row_len or cache.stride(-1) != 1:
        raise ValueError(f"{name}: expected a 1-byte tensor [..., {row_len}] with unit last stride, "
                         f"got {cache.dtype} {tuple(cache.shape)} strides {cache.stride()}")
    u8 = cache.view(torch.uint8)
    return u8 if u8.dim() == 2 else u8.view(-1, row_len)


def quantize_store(x: torch.Tensor, fmt: str, cache_data: torch.Tensor, cache_scale: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Quantize ``x [N, D]`` into ``fmt`` and write row ``i`` to cache row ``slot_mapping[i]``.

    ``cache_data [..., D]`` (``fp8``) or ``[..., D/2]`` (fp4), ``cache_scale [..., D/block]``:
    any 1-byte dtype, leading dims flattened into slots (a view, never a copy);
    ``slot_mapping [N]`` int32 or int64, ``-1`` skips the row. Bytes are those of
    ``formats.quantize(x, fmt)``.
    """
    if fmt not in _FMT:
        raise ValueError(f"fmt: expected one of {sorted(_FMT)}, got {fmt!r}")
    s = formats.spec(fmt)
    if x.dim() != 2 or x.shape[-1] % s.block or x.dtype not in _IN_DTYPES:
        raise ValueError(f"x: expected float [N, D] with D % {s.block} == 0, got {x.dtype} {tuple(x.shape)}")
    if slot_mapping.shape != x.shape[:1] or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping: expected int32/int64 [{x.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    d = x.shape[1]
    data = _cache_rows(cache_data, "cache_data", d // 2 if s.packed else d)
    scale = _cache_rows(cache_scale, "cache_scale", d // s.block)
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    _launch_quantize(x2, fmt, data, scale, slot_mapping.contiguous(), data.stride(0), scale.stride(0))


def supports_quantize(x, fmt) -> bool:
    return fmt in _FMT and x.dtype in _IN_DTYPES


def supports_dequantize(q, dtype=torch.float32) -> bool:
    return q.fmt in _FMT


def warmup_cases(device, d: dict, dtype):
    """The quantizations the model makes: window KV (fp8), the indexer's fake-quant of q (fp4_b32 and
    back), and the compressed entries (index keys fp4_b32, main KV fp4_b16)."""
    hd, iq = d["head_dim"], (d["index_n_heads"], d["index_head_dim"])
    for n in _warmup.TOKENS:
        yield _warmup.Launch("quantize fp8", quantize, (_warmup.rand((1, n, hd), dtype, device), "fp8"))
        yield _warmup.Launch("quantize fp4_b32", quantize, (_warmup.rand((1, n, *iq), dtype, device), "fp4_b32"))
        yield _warmup.Launch("dequantize fp4_b32", dequantize, (_warmup.qzeros("fp4_b32", (1, n, *iq), device), dtype))
        for m in sorted({n, max(1, n // 2)}):
            k = _warmup.rand((1, m, d["index_head_dim"]), dtype, device)
            yield _warmup.Launch("quantize fp4_b32", quantize, (k, "fp4_b32"))
            yield _warmup.Launch("quantize fp4_b16", quantize, (_warmup.rand((1, m, hd), dtype, device), "fp4_b16"))


def warmup(profile) -> dict:
    """Compile this module's kernels for the shipped models' shapes (``flashrt jit warmup``)."""
    return _warmup.run(warmup_cases, profile)


OPS = {"quantize": quantize, "dequantize": dequantize}
SUPPORTS = {"quantize": supports_quantize, "dequantize": supports_dequantize}
