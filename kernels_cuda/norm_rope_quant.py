"""``norm_rope_quantize``: RMS norm, rotary embedding of the tail and block quantization of a row in
one program (docs/ops.md).

A program owns ``BLOCK_R`` rows of ``D`` channels (``D`` a power of two, kept in registers): the
norm (``rms_norm``'s math, rounded to x.dtype), the rope of the last ``2P`` channels (``rope``'s
complex product with the row's table entry, rounded to x.dtype; the first ``D - 2P`` copied),
then the block scales and elements of ``fmt`` as ``_quantize_kernel`` makes them (bit-exact with
:mod:`flashrt.formats` from the same rounded values). Replaces three launches (two without the
norm) on the KV path of every layer. Rows of ``[B, S, H, D]`` (the indexer's query heads) read
their (b, s) table entry. With ``dequantize_to`` (a fake quantization) the program writes the
values the blocks stand for, as ``_dequantize_kernel`` decodes them, instead of the bytes: one
launch for the indexer's rope, quantize and dequantize. With no ``fmt`` the program stores the
normed, roped rows in x.dtype (the attention's query heads: norm and rope in one launch). Rows whose ``D`` is not a power of two, or
longer than ``MAX_D``, run the kernels in sequence.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from flashrt import formats, profiles
from flashrt.dtypes import STORAGE
from flashrt.families import KernelFamily, Support
from flashrt.formats import QTensor
from flashrt.tile_checks import POW2, Tile
from flashrt.kernels_cuda import norm_rope, quant
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.codecs import CODES, block_scale, fake_blocks, store_blocks, to_out
from flashrt.kernels_cuda.launch import TL_DTYPES, PlanCache, cdiv, next_pow2
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

TILES = {"norm_rope_quantize": {"ROW_ELEMS": 2048, "MAX_D": 4096, "num_warps": 4, "in_kernel": True}}

PLANS = PlanCache("norm_rope_quant", TILES)
_tiles = PLANS.tiles

_FMT = {f: CODES[f] for f in ("fp8", "fp4_b16", "fp4_b32")}
_FMT[None] = 0  # plain float (codecs.CODES): no quantization: the normed, roped rows in x.dtype
_PLAIN = SimpleNamespace(block=1, packed=False)  # what the launch reads of a format when there is none
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _norm_rope_quant_kernel(x_ptr, w_ptr, f_ptr, data_ptr, scale_ptr, out_ptr, n_rows, S, H, x_row_stride, sfb, sfs,
                            eps, HEAD: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, XDT: tl.constexpr,
                            FMT: tl.constexpr, BLK: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr,
                            FAKE: tl.constexpr, OUT: tl.constexpr):
    wait_inputs()
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # flattened (b, s, h)
    rmask = row < n_rows
    c = tl.arange(0, D)
    x = tl.load(x_ptr + row[:, None] * x_row_stride + c[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    if NORM:
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(w_ptr + c).to(tl.float32)
        x = to_out(x * r[:, None] * w[None, :], XDT).to(tl.float32)
    ct = c - HEAD  # table channel of the rotated tail (negative: a copied head channel)
    bs = row // H  # the heads of a (b, s) share its table entry
    b, s = bs // S, bs % S
    f = tl.load(f_ptr + (b * sfb + s * sfs)[:, None] + ct[None, :], mask=rmask[:, None] & (ct >= 0)[None, :],
                other=0.0)
    fr, fi = tl.split(tl.reshape(f, (BLOCK_R, D // 2, 2)))
    xr, xi = tl.split(tl.reshape(x, (BLOCK_R, D // 2, 2)))
    rot = tl.reshape(tl.join(xr * fr - xi * fi, xr * fi + xi * fr), (BLOCK_R, D))
    y = to_out(tl.where((c < HEAD)[None, :], x, rot), XDT).to(tl.float32)
    if FMT == 0:  # no quantization: the rows in x.dtype
        tl.store(out_ptr + row[:, None] * D + c[None, :], to_out(y, XDT), mask=rmask[:, None])
    else:
        # block quantization, as _quantize_kernel: G = D / BLK scales a row
        yb = tl.reshape(y, (BLOCK_R * G, BLK))
        byte, scale, recip = block_scale(tl.max(tl.abs(yb), axis=1), FMT)
        if FAKE:  # the values the blocks stand for, as _dequantize_kernel decodes them
            v = tl.reshape(fake_blocks(yb, scale, recip, FMT), (BLOCK_R, D))
            tl.store(out_ptr + row[:, None] * D + c[None, :], to_out(v, OUT), mask=rmask[:, None])
        else:
            grow = tl.reshape(tl.broadcast_to(row[:, None], (BLOCK_R, G)), (BLOCK_R * G,))
            gcol = tl.reshape(tl.broadcast_to(tl.arange(0, G)[None, :], (BLOCK_R, G)), (BLOCK_R * G,))
            gmask = grow < n_rows
            tl.store(scale_ptr + grow * G + gcol, byte.to(tl.uint8), mask=gmask)
            block_bytes = BLK if FMT == 1 else BLK // 2
            store_blocks(data_ptr, (grow * G + gcol) * block_bytes, yb, scale, recip, gmask, FMT, BLK, BLOCK_R * G)


def _fused(x, fmt, dequantize_to) -> bool:
    """The one-program path serves this row length, format and output (else the kernels run in sequence)."""
    t = _tiles()["norm_rope_quantize"]
    D = x.shape[-1]
    return t["in_kernel"] and fmt in _FMT and D == next_pow2(D) and D <= t["MAX_D"] \
        and D >= (formats.spec(fmt) if fmt is not None else _PLAIN).block and dequantize_to in (None, *_DTYPES)


def norm_rope_quantize(x, weight, eps, freqs_cis, fmt, dequantize_to=None):
    if not _fused(x, fmt, dequantize_to):
        y = norm_rope.rms_norm(x, weight, eps) if weight is not None else x
        if fmt is None:
            return norm_rope.rope(y, freqs_cis, False)
        q = quant.quantize(norm_rope.rope(y, freqs_cis, False), fmt)
        return q if dequantize_to is None else quant.dequantize(q, dequantize_to)
    B, S, D = x.shape[0], x.shape[1], x.shape[-1]
    H = x.shape[2] if x.dim() == 4 else 1
    n = B * S * H
    s = formats.spec(fmt) if fmt is not None else _PLAIN
    x2 = x.reshape(n, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    f = torch.view_as_real(freqs_cis.contiguous())  # [B, S, P, 2] fp32: (re, im) pairs adjacent
    if fmt is None or dequantize_to is not None:
        out = data = scale = torch.empty(x.shape, dtype=dequantize_to or x.dtype, device=x.device)
    else:
        out = data = torch.empty(n, D // 2 if s.packed else D, dtype=torch.uint8, device=x.device)
        scale = torch.empty(n, D // s.block, dtype=torch.uint8, device=x.device)
    if n:
        t = _tiles()["norm_rope_quantize"]
        block_r = max(1, min(t["ROW_ELEMS"] // D, next_pow2(n)))
        w = weight.contiguous() if weight is not None else x2
        _norm_rope_quant_kernel[(cdiv(n, block_r),)](
            x2, w, f, data, scale, out, n, S, H, x2.stride(0), f.stride(0), f.stride(1), float(eps),
            HEAD=D - 2 * freqs_cis.shape[-1], D=D, NORM=weight is not None, XDT=TL_DTYPES[x.dtype],
            FMT=_FMT[fmt], BLK=s.block, G=D // s.block, BLOCK_R=block_r, FAKE=dequantize_to is not None,
            OUT=TL_DTYPES[dequantize_to or x.dtype], num_warps=t["num_warps"], **pdl.options(x2.device))
    if fmt is None or dequantize_to is not None:
        return out
    data_shape, scale_shape = formats.expected_layout(fmt, x.shape)
    return QTensor(data.view(s.data_dtype).view(data_shape), scale.view(s.scale_dtype).view(scale_shape), fmt, x.shape)


def warmup_cases(device, d: dict, dtype):
    """The window ring's new rows (head_dim, its format), a compressed entry (main KV format, no
    norm) and its index key (index_head_dim, fp4_b32), one decode row each; the indexer's query
    heads of a decode row (no norm, fp4_b32 fake quantization)."""
    P = d["rope_head_dim"] // 2
    f = torch.polar(torch.ones(1, 1, P, device=device), torch.zeros(1, 1, P, device=device))
    window = STORAGE.get(profiles.active_profile().kv_window_dtype)
    for D, norm, fmt in ((d["head_dim"], True, window),
                         (d["head_dim"], False, formats.MAIN_KV_FORMAT), (d["index_head_dim"], True, "fp4_b32")):
        if fmt in _FMT:
            w = torch.ones(D, dtype=dtype, device=device) if norm else None
            yield _warmup.Launch("norm_rope_quantize", norm_rope_quantize,
                                 (_warmup.rand((1, 1, D), dtype, device), w, 1e-6, f, fmt))
    q = _warmup.rand((1, 1, d["index_n_heads"], d["index_head_dim"]), dtype, device)
    yield _warmup.Launch("norm_rope_quantize index q", norm_rope_quantize, (q, None, 0.0, f, "fp4_b32", dtype))


FAMILY = KernelFamily(
    "norm_rope_quant", ops={"norm_rope_quantize": norm_rope_quantize},
    supports={"norm_rope_quantize": Support(inputs={"x": _DTYPES, "weight": _DTYPES, "fmt": tuple(_FMT)})},
    tiles=TILES, tile_checks={"norm_rope_quantize.ROW_ELEMS": POW2, "norm_rope_quantize.MAX_D": POW2,
                              "norm_rope_quantize.in_kernel": Tile(kind=bool)},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="RMS norm + rope of the tail + block quantization of a KV row, one program")
