"""Quantize / dequantize (``fp8``, ``fp4_b16``, ``fp4_b32``) and a fused quantize-and-store.

Bit-exact with :mod:`flashrt.formats`. A quantize program handles ``BLOCK_R`` rows x ``BLOCK_C``
scale blocks (a ``[BLOCK_R * BLOCK_C, block]`` tile, ``ELEMS`` elements): block amax, scale,
elements, packing, stores. Rounding is done by the codecs of :mod:`.codecs`:

- power-of-two scales come from the fp32 bit pattern of ``max(amax, floor) / elem_max``
  (exponent + (mantissa != 0), as ``formats.pow2_ceil``), the division correctly rounded
  (``div_rn``); elements are ``x * 2**-k`` (exact, the same value as ``x / 2**k``);
- the ``fp4_b16`` scale uses ``div_rn``, its elements are coded by comparisons with the E2M1
  midpoints times the scale (:mod:`.codecs_e2m1`: the codes of the correctly rounded quotient, sign
  from ``x``; bf16 pairs through PTX with the ``pairs`` tile on sm_90); E4M3 elements through the hardware
  conversion on sm_89+ and on the bits elsewhere (``codecs.e4m3_encode``), E2M1 on the fp32 bits
  (``codecs.e2m1_code``), nearest with ties to even, sign from bit 31.

``quantize_store`` writes row ``i`` of ``x`` into cache row ``slot_mapping[i]`` of a paged cache
(``-1`` skipped), without materialising the QTensor. Weight formats (``fp8_w``, ``fp4_w``) are
declined by ``quantize`` (weights are quantized offline); ``dequantize`` also serves ``fp8_w`` (32 x 32
tiles, one program per 32 rows x ``BLOCK_C`` columns), for the bf16 GEMM path of large prefill
chunks. The element codecs live in :mod:`.codecs`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt import formats
from flashrt.families import KernelFamily, Support
from flashrt.tile_checks import POW2
from flashrt.formats import MAIN_KV_FORMAT, QTensor
from flashrt.kernels_cuda.codecs import (CODES, block_scale, ptx_sm90, e2m1_block_codes, e2m1_to_f32,
                                         e4m3_to_f32, e8m0_to_f32, store_blocks, to_out)
from flashrt.kernels_cuda.codecs_e2m1 import e2m1_bytes_bf16x2
from flashrt.kernels_cuda.codecs_words import e2m1_words_nibbles
from flashrt.kernels_cuda.launch import PlanCache, cdiv, dense, last_dense, next_pow2, zeros_stored
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

TILES = {
    # BLOCK_G = ELEMS // block scale blocks a program; pairs: fp4_b16 from bf16 coded two elements a
    # call on sm_90 (codecs_e2m1.e2m1_bytes_bf16x2; the same bytes)
    "quantize": {"ELEMS": 4096, "num_warps": 4, "pairs": False},
    "dequantize": {"ELEMS": 4096, "num_warps": 4},
    "dequantize_w": {"BLOCK_C": 128, "num_warps": 4},  # fp8_w: 32 rows x BLOCK_C columns a program
}


PLANS = PlanCache("quant", TILES)  # the active tiles and the launch plans made with them
_tiles = PLANS.tiles


_FMT = {f: CODES[f] for f in ("fp8", "fp4_b16", "fp4_b32")}  # kernel code; block size from formats.spec
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DEQUANT_FMTS = tuple(_FMT) + ("fp8_w",)  # dequantize also serves the fp8 weights (the bf16 GEMM path)


@triton.jit
def _quantize_kernel(x_ptr, data_ptr, scale_ptr, slot_ptr, n_rows, groups_per_row,
                     x_row_stride, data_row_stride, scale_row_stride,
                     FMT: tl.constexpr, BLK: tl.constexpr, HAS_SLOTS: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PAIRS: tl.constexpr = False):
    """PAIRS: bf16 ``x`` coded two elements a call (``fp4_b16``, sm_90: :func:`.codecs_e2m1.e2m1_bytes_bf16x2`)."""
    wait_inputs()
    if FMT == 1:
        i = tl.arange(0, BLOCK_R * BLOCK_C)  # BLOCK_R rows x BLOCK_C scale blocks, flattened
    else:
        # E2M1 blocks as [blocks, BLK / 8, 8]: a thread's 16-byte load is 8 elements of a block, and
        # the layout puts a block's parts in one thread (in-thread amax, nibble pairs and stores); the
        # block indices are made in that layout too, so nothing changes layout through shared memory
        i = tl.arange(0, BLOCK_R * BLOCK_C)[:, None, None]
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + i // BLOCK_C
    col = tl.program_id(1) * BLOCK_C + i % BLOCK_C
    gmask = (row < n_rows) & (col < groups_per_row)
    dst = row
    if HAS_SLOTS:
        dst = tl.load(slot_ptr + row, mask=gmask, other=-1).to(tl.int64)
        gmask = gmask & (dst >= 0)
    if FMT == 1:
        e = tl.arange(0, BLK)
        x = tl.load(x_ptr + row[:, None] * x_row_stride + col[:, None] * BLK + e[None, :],
                    mask=gmask[:, None], other=0.0).to(tl.float32)
        byte, scale, recip = block_scale(tl.max(tl.abs(x), axis=1), FMT)
        tl.store(scale_ptr + dst * scale_row_stride + col, byte.to(tl.uint8), mask=gmask)
        store_blocks(data_ptr, dst * data_row_stride + col * BLK, x, scale, recip, gmask, FMT, BLK,
                     BLOCK_R * BLOCK_C)
    else:
        p = tl.arange(0, BLK // 8)[None, :, None]
        e8 = tl.arange(0, 8)[None, None, :]
        xin = tl.load(x_ptr + row * x_row_stride + col * BLK + p * 8 + e8, mask=gmask, other=0.0)
        x = xin.to(tl.float32)
        byte, scale, recip = block_scale(tl.max(tl.max(tl.abs(x), axis=2, keep_dims=True), axis=1, keep_dims=True),
                                         FMT)
        tl.store(scale_ptr + dst * scale_row_stride + col, byte.to(tl.uint8), mask=gmask)
        shape: tl.constexpr = (BLOCK_R * BLOCK_C, BLK // 8, 4, 2)
        if PAIRS:
            packed, _ = tl.split(tl.reshape(e2m1_bytes_bf16x2(xin, scale), shape))
        else:
            lo, hi = tl.split(tl.reshape(e2m1_block_codes(x, scale, recip, FMT), shape))
            packed = lo | (hi << 4)
        e4 = tl.arange(0, 4)[None, None, :]
        tl.store(data_ptr + dst * data_row_stride + col * (BLK // 2) + p * 4 + e4, packed.to(tl.uint8), mask=gmask)


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, out_ptr, n_groups,
                       FMT: tl.constexpr, BLK: tl.constexpr, BLOCK_G: tl.constexpr, WORDS: tl.constexpr = False):
    wait_inputs()
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = g < n_groups
    sbyte = tl.load(scale_ptr + g, mask=gmask, other=0).to(tl.int32)
    if FMT == 2:
        scale = e4m3_to_f32(sbyte)
    else:
        scale = e8m0_to_f32(sbyte)
    e = tl.arange(0, BLK)
    if FMT == 1:
        b = tl.load(data_ptr + g[:, None] * BLK + e[None, :], mask=gmask[:, None], other=0).to(tl.int32)
        v = e4m3_to_f32(b)
    else:
        h = tl.arange(0, BLK // 2)
        b = tl.load(data_ptr + g[:, None] * (BLK // 2) + h[None, :], mask=gmask[:, None], other=0).to(tl.int32)
        if WORDS:
            b = e2m1_words_nibbles(b, BLOCK_G, BLK // 2)
        v = tl.reshape(tl.join(e2m1_to_f32(b & 15), e2m1_to_f32(b >> 4)), (BLOCK_G, BLK))
    out = v * scale[:, None]
    tl.store(out_ptr + g[:, None] * BLK + e[None, :], to_out(out, out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _dequantize_w_kernel(data_ptr, scale_ptr, out_ptr, rows, cols, s_rows, s_cols, BLOCK_C: tl.constexpr):
    """``fp8_w``: one program per 32 rows (one row of 32 x 32 scale tiles) x ``BLOCK_C`` columns of
    matrix ``program_id(2)`` (the leading dims flattened); each element's E4M3 value times its
    tile's UE8M0 power of two, in fp32, rounded once to the output dtype."""
    wait_inputs()
    mat = tl.program_id(2).to(tl.int64)
    r = tl.program_id(0) * 32 + tl.arange(0, 32)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (r < rows)[:, None] & (c < cols)[None, :]
    at = mat * rows * cols + r.to(tl.int64)[:, None] * cols + c[None, :]
    b = tl.load(data_ptr + at, mask=m, other=0).to(tl.int32)
    sb = tl.load(scale_ptr + mat * s_rows * s_cols + (r // 32)[:, None] * s_cols + (c // 32)[None, :], mask=m,
                 other=0).to(tl.int32)
    tl.store(out_ptr + at, to_out(e4m3_to_f32(b) * e8m0_to_f32(sb), out_ptr.dtype.element_ty), mask=m)


def _dequantize_w(q: QTensor, out: torch.Tensor) -> None:
    """:func:`dequantize` of an ``fp8_w`` QTensor ``[..., rows, cols]`` into ``out``."""
    rows, cols = q.shape[-2:]
    mats = out.numel() // max(1, rows * cols)
    data, scale = dense(q.data).view(torch.uint8), dense(q.scale).view(torch.uint8)
    block_c = min(_tiles()["dequantize_w"]["BLOCK_C"], next_pow2(cols))
    _dequantize_w_kernel[(cdiv(rows, 32), cdiv(cols, block_c), mats)](
        data, scale, out, rows, cols, scale.shape[-2], scale.shape[-1], BLOCK_C=block_c,
        num_warps=_tiles()["dequantize_w"]["num_warps"], **pdl.options(data.device))


def pairs_apply(fmt: str, dtype: torch.dtype) -> bool:
    """Whether TILES ``quantize.pairs`` codes this call two elements a PTX call: ``fp4_b16`` from bf16,
    on sm_90+ (``set.bf16x2``; under the interpreter only while its PTX is emulated, :func:`.codecs.ptx_sm90`)."""
    return (bool(_tiles()["quantize"].get("pairs")) and fmt == "fp4_b16" and dtype == torch.bfloat16
            and ptx_sm90())


def rows_plan(rows: int, n: int, fmt: str, has_slots: bool, tile: tuple | None = None,
              dtype: torch.dtype | None = None) -> tuple:
    """(grid, constexprs) quantizing ``rows`` rows of ``n`` (``dtype``) into ``fmt``; ``tile`` = (BLOCK_R,
    BLOCK_C, num_warps) or None for TILES ``quantize`` (``ELEMS`` per program, ``pairs``)."""
    blk = formats.spec(fmt).block
    groups_per_row = n // blk
    pairs = {}
    if tile is None:
        t = _tiles()["quantize"]
        block_g = t["ELEMS"] // blk
        block_c = min(next_pow2(groups_per_row), block_g)
        tile = (block_g // block_c, block_c, t["num_warps"])
        pairs = dict(PAIRS=True) if pairs_apply(fmt, dtype) else {}
    block_r, block_c, warps = tile
    grid = (cdiv(rows, block_r), cdiv(groups_per_row, block_c))
    return grid, dict(FMT=_FMT[fmt], BLK=blk, HAS_SLOTS=has_slots, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
                      **pairs)


def launch_rows(plan: tuple, x2, data, scale, slots, data_row_stride: int, scale_row_stride: int) -> None:
    """Run a :func:`rows_plan` on ``x2 [M, N]`` (unit last stride) into uint8 ``data`` / ``scale`` rows."""
    grid, c = plan
    _quantize_kernel[grid](x2, data, scale, slots if slots is not None else data, x2.shape[0], x2.shape[1] // c["BLK"],
                           x2.stride(0), data_row_stride, scale_row_stride, **c, **pdl.options(x2.device))


def _launch_quantize(x2, fmt, data, scale, slots, data_row_stride, scale_row_stride):
    """Quantize rows of ``x2 [M, N]`` (unit last stride) into byte tensors ``data``/``scale``."""
    rows, n = x2.shape
    if rows * n == 0:
        return
    key = (rows, n, fmt, slots is not None, x2.dtype)
    plan = PLANS.lookup(key)[1]
    if plan is None:
        assert x2.dim() == 2 and x2.stride(-1) == 1 and data.dtype == scale.dtype == torch.uint8
        plan = PLANS.store(key, rows_plan(rows, n, fmt, slots is not None, dtype=x2.dtype))
    launch_rows(plan, x2, data, scale, slots, data_row_stride, scale_row_stride)


def quantize(x: torch.Tensor, fmt: str) -> QTensor:
    s = formats.spec(fmt)
    assert fmt in _FMT and x.dim() >= 1 and x.shape[-1] % s.block == 0
    n = x.shape[-1]
    x2 = last_dense(x.reshape(-1, n))
    row_bytes = n // 2 if s.packed else n
    data = torch.empty(x2.shape[0], row_bytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(x2.shape[0], n // s.block, dtype=torch.uint8, device=x.device)
    _launch_quantize(x2, fmt, data, scale, None, row_bytes, n // s.block)
    data_shape, scale_shape = formats.expected_layout(fmt, x.shape)
    return QTensor(data.view(s.data_dtype).view(data_shape), scale.view(s.scale_dtype).view(scale_shape),
                   fmt, x.shape)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    s = formats.spec(q.fmt)
    assert q.fmt in _DEQUANT_FMTS
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if q.fmt == "fp8_w":
        if out.numel():
            _dequantize_w(q, out)
        return out
    data, scale = dense(q.data).view(torch.uint8), dense(q.scale).view(torch.uint8)
    n_groups = scale.numel()
    if n_groups:
        key = ("dequantize", n_groups, q.fmt, q.e2m1_words)
        plan = PLANS.lookup(key)[1]
        if plan is None:
            t = _tiles()["dequantize"]
            block_g = t["ELEMS"] // s.block
            words = dict(WORDS=True) if q.e2m1_words else {}  # the packed bytes in the E2M1 word layout
            plan = PLANS.store(key, ((cdiv(n_groups, block_g),), dict(
                FMT=_FMT[q.fmt], BLK=s.block, BLOCK_G=block_g, num_warps=t["num_warps"], **words)))
        _dequantize_kernel[plan[0]](data, scale, out, n_groups, **plan[1], **pdl.options(data.device))
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
    _launch_quantize(last_dense(x), fmt, data, scale, dense(slot_mapping), data.stride(0), scale.stride(0))


def warmup_cases(device, d: dict, dtype):
    """The quantizations the model makes: window KV (fp8), the indexer's fake-quant of q (fp4_b32 and
    back), and the compressed entries (index keys fp4_b32, main KV fp4_b16)."""
    hd, iq = d["head_dim"], (d["index_n_heads"], d["index_head_dim"])
    for n in _warmup.TOKENS:
        yield _warmup.Launch("quantize fp8", quantize, (_warmup.rand((1, n, hd), dtype, device), "fp8"))
        yield _warmup.Launch("quantize fp4_b32", quantize, (_warmup.rand((1, n, *iq), dtype, device), "fp4_b32"))
        stored = zeros_stored("fp4_b32", (1, n, *iq), None, device)
        yield _warmup.Launch("dequantize fp4_b32", dequantize, (stored, dtype))
        for m in sorted({n, max(1, n // 2)}):
            k = _warmup.rand((1, m, d["index_head_dim"]), dtype, device)
            yield _warmup.Launch("quantize fp4_b32", quantize, (k, "fp4_b32"))
            main = _warmup.rand((1, m, hd), dtype, device)
            yield _warmup.Launch(f"quantize {MAIN_KV_FORMAT}", quantize, (main, MAIN_KV_FORMAT))


FAMILY = KernelFamily(
    "quant", ops={"quantize": quantize, "dequantize": dequantize},
    # the KV formats (fp8, fp4_b16, fp4_b32), and fp8_w to dequantize; the other weight formats and
    # int8 are the reference's
    supports={"quantize": Support(inputs={"x": _IN_DTYPES, "fmt": tuple(_FMT)}),
              "dequantize": Support(inputs={"q": _DEQUANT_FMTS})},
    tiles=TILES, tile_checks={"*.ELEMS": POW2, "dequantize_w.BLOCK_C": POW2},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="quantize / dequantize of the KV formats (and dequantize of fp8_w weights)")
