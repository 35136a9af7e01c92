"""Engram kernels: ``engram_lookup`` (fp8 row gather + dequantize), ``engram_gate`` and
``engram_hash`` (the n-gram bucket ids in one launch: ``kernels_cuda/engram_hash.py``;
``engram_hash.in_kernel`` off: plain torch, about 25 launches a decode step).

``engram_lookup``: a program gathers ``BLOCK_N`` ids, reads their E4M3 rows and UE8M0 scales
(one per 32) in place (row strides of the table, int64 offsets: tables have 16M+ rows) and
writes bf16, bit-exact with ``formats.dequantize_rows``.
``engram_gate``: a program owns one (token, stream) row of ``D``: the three reductions (sum of
squares of h and key, sum of h * weight * key), the gate, then ``h + g * value``; a row that
fits ``BLOCK_D`` is read once (``SINGLE``), a longer one twice. fp32 math, output ``h.dtype``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashrt.kernels_cuda.codecs import e4m3_to_f32, e8m0_to_f32, to_out
from flashrt.families import KernelFamily, Support
from flashrt.tile_checks import POW2, Tile
from flashrt.kernels_cuda.launch import PlanCache, cdiv, next_pow2, zeros_stored
from flashrt.kernels_cuda import engram_hash as _hash, warmup as _warmup
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

TILES = {
    "engram_lookup": {"ROWS_ELEMS": 4096, "num_warps": 4},
    "engram_gate": {"MAX_BLOCK_D": 8192, "ELEMS_PER_WARP": 512},  # num_warps = BLOCK_D / this, 4..16
    "engram_hash": {"in_kernel": True, "BLOCK_R": 16, "num_warps": 4},  # in_kernel False: plain torch
}


PLANS = PlanCache("engram", TILES)  # the active tiles (and launch plans made with them)
_tiles = PLANS.tiles


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _engram_lookup_kernel(data_ptr, scale_ptr, ids_ptr, out_ptr, n_ids, DH, data_row_stride, scale_row_stride,
                          BLOCK_N: tl.constexpr, BLOCK_DH: tl.constexpr):
    wait_inputs()
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    im = i < n_ids
    row = tl.load(ids_ptr + i, mask=im, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK_DH)
    m = im[:, None] & (c < DH)[None, :]
    b = tl.load(data_ptr + row[:, None] * data_row_stride + c[None, :], mask=m, other=0).to(tl.int32)
    e = tl.load(scale_ptr + row[:, None] * scale_row_stride + (c // 32)[None, :], mask=m, other=127).to(tl.int32)
    v = e4m3_to_f32(b) * e8m0_to_f32(e)
    tl.store(out_ptr + i[:, None] * DH + c[None, :], to_out(v, out_ptr.dtype.element_ty), mask=m)


def engram_lookup(table, ids: torch.Tensor) -> torch.Tensor:
    rows, dh = table.shape
    data, scale = table.data.view(torch.uint8), table.scale.view(torch.uint8)
    assert data.stride(-1) == 1 and scale.stride(-1) == 1
    ids = ids.contiguous()
    out = torch.empty(*ids.shape, dh, dtype=torch.bfloat16, device=ids.device)
    n = ids.numel()
    if n == 0 or dh == 0:
        return out
    t = _tiles()["engram_lookup"]
    block_dh = next_pow2(dh)
    block_n = min(max(1, t["ROWS_ELEMS"] // block_dh), next_pow2(n))
    _engram_lookup_kernel[(cdiv(n, block_n),)](
        data, scale, ids, out, n, dh, data.stride(0), scale.stride(0), BLOCK_N=block_n, BLOCK_DH=block_dh,
        num_warps=t["num_warps"], **pdl.options(data.device))
    return out


@triton.jit
def _gate(sh, sk, dot, D, eps, sqrt_d):
    """sigmoid(copysign(sqrt(max(|d|, 1e-6)), d)) with d = dot * r / sqrt(D)."""
    r = tl.math.rsqrt(sh / D + eps) * tl.math.rsqrt(sk / D + eps)
    d = dot * r / sqrt_d
    mag = tl.sqrt(tl.maximum(tl.abs(d), 1e-6))
    signed = tl.where(d.to(tl.int32, bitcast=True) < 0, -mag, mag)
    return 1.0 / (1.0 + tl.exp(-signed))


@triton.jit
def _engram_gate_kernel(h_ptr, key_ptr, value_ptr, w_ptr, out_ptr, HC, D, eps, sqrt_d,
                        BLOCK_D: tl.constexpr, SINGLE: tl.constexpr):
    wait_inputs()
    pid = tl.program_id(0).to(tl.int64)  # token * HC + stream
    row = pid * D
    v_row = (pid // HC) * D
    w_row = (pid % HC) * D
    d = tl.arange(0, BLOCK_D)
    if SINGLE:
        dm = d < D
        h = tl.load(h_ptr + row + d, mask=dm, other=0.0).to(tl.float32)
        key = tl.load(key_ptr + row + d, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + w_row + d, mask=dm, other=0.0).to(tl.float32)
        g = _gate(tl.sum(h * h), tl.sum(key * key), tl.sum(h * w * key), D, eps, sqrt_d)
        value = tl.load(value_ptr + v_row + d, mask=dm, other=0.0).to(tl.float32)
        tl.store(out_ptr + row + d, to_out(h + g * value, out_ptr.dtype.element_ty), mask=dm)
    else:
        sh = tl.zeros((BLOCK_D,), dtype=tl.float32)
        sk = tl.zeros((BLOCK_D,), dtype=tl.float32)
        dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dm = d0 + d < D
            h = tl.load(h_ptr + row + d0 + d, mask=dm, other=0.0).to(tl.float32)
            key = tl.load(key_ptr + row + d0 + d, mask=dm, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + w_row + d0 + d, mask=dm, other=0.0).to(tl.float32)
            sh += h * h
            sk += key * key
            dot += h * w * key
        g = _gate(tl.sum(sh), tl.sum(sk), tl.sum(dot), D, eps, sqrt_d)
        for d0 in range(0, D, BLOCK_D):
            dm = d0 + d < D
            h = tl.load(h_ptr + row + d0 + d, mask=dm, other=0.0).to(tl.float32)
            value = tl.load(value_ptr + v_row + d0 + d, mask=dm, other=0.0).to(tl.float32)
            tl.store(out_ptr + row + d0 + d, to_out(h + g * value, out_ptr.dtype.element_ty), mask=dm)


def engram_gate(h, key, value, weight, eps: float) -> torch.Tensor:
    B, S, hc, D = h.shape
    h, key, value, weight = h.contiguous(), key.contiguous(), value.contiguous(), weight.contiguous()
    out = torch.empty(B, S, hc, D, dtype=h.dtype, device=h.device)
    if out.numel() == 0:
        return out
    t = _tiles()["engram_gate"]
    block_d = min(next_pow2(D), t["MAX_BLOCK_D"])
    _engram_gate_kernel[(B * S * hc,)](h, key, value, weight, out, hc, D, float(eps), math.sqrt(D),
                                       BLOCK_D=block_d, SINGLE=block_d >= D,
                                       num_warps=max(4, min(16, block_d // t["ELEMS_PER_WARP"])),
                                       **pdl.options(h.device))
    return out


def engram_hash(seq, multipliers, primes, offsets, pad: int) -> torch.Tensor:
    return _hash.engram_hash(seq, multipliers, primes, offsets, pad, _tiles()["engram_hash"])


def warmup_cases(device, d: dict, dtype):
    """engram_hash of a step's tokens (two Engram layers), engram_lookup of its n-gram ids (int64)
    from an fp8 table; engram_gate on the hc copies."""
    hc, dim, cols = d["hc_mult"], d["dim"], (d["engram_max_ngram_size"] - 1) * d["engram_n_heads"]
    N = d["engram_max_ngram_size"]
    mult = torch.ones(2, N, dtype=torch.long, device=device)
    primes = torch.full((2, cols), 7, dtype=torch.long, device=device)
    table = zeros_stored("fp8", (256, d["engram_head_dim"]), None, device)
    weight = torch.ones(hc, dim, device=device)
    for n in _warmup.TOKENS:
        seq = torch.zeros(1, N - 1 + n, dtype=torch.long, device=device)
        yield _warmup.Launch("engram_hash", engram_hash, (seq, mult, primes, primes, 0))
        ids = torch.randint(0, 256, (1, n, cols), device=device)
        yield _warmup.Launch("engram_lookup", engram_lookup, (table, ids))
        x, key = _warmup.rand((1, n, hc, dim), dtype, device), _warmup.rand((1, n, hc, dim), dtype, device)
        value = _warmup.rand((1, n, dim), dtype, device)
        yield _warmup.Launch("engram_gate", engram_gate, (x, key, value, weight, d["norm_eps"]))


FAMILY = KernelFamily(
    "engram", ops={"engram_lookup": engram_lookup, "engram_gate": engram_gate, "engram_hash": engram_hash},
    supports={"engram_gate": Support(inputs={name: _DTYPES for name in ("h", "key", "value", "weight")})},
    tiles=TILES, tile_checks={"engram_lookup.ROWS_ELEMS": POW2, "engram_gate.MAX_BLOCK_D": POW2,
                              "engram_hash.in_kernel": Tile(kind=bool), "engram_hash.BLOCK_R": POW2},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="Engram n-gram bucket ids, table rows (fp8) and the gated add")
