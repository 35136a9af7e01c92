"""RMS norm and rotary embedding (docs/ops.md ``rms_norm``, ``rope``).

``rms_norm``: a program normalises ``BLOCK_M`` rows; a row that fits ``BLOCK_N`` is read once
and kept in registers (``SINGLE``), a longer one is read twice (sum of squares, then scale).
``rope``: x is seen as ``[B, S, H, R]`` with its own strides (a slice such as ``q[..., -64:]``
is read in place); a table of ``P < R/2`` pairs rotates the last ``2P`` channels and the first
``R - 2P`` are copied in the same pass (the model's rope on a head's tail); a program rotates ``BLOCK_ROWS`` rows of the flattened (b, s, h), each with
its table row (``torch.view_as_real`` of the complex table; per-sequence tables by batch stride,
shared ones with stride 0), so ``[B, S, R]`` inputs get full tiles too.
All math in fp32; outputs are contiguous in ``x.dtype``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.kernels_cuda.codecs import to_out
from flashrt.families import KernelFamily, Support
from flashrt.tile_checks import POW2
from flashrt.kernels_cuda.launch import PlanCache, cdiv, next_pow2
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

TILES = {
    "rms_norm": {"MAX_BLOCK_N": 8192, "ROW_ELEMS": 4096, "num_warps": 8},
    "rope": {"TILE_ELEMS": 4096, "num_warps": 4},
}


PLANS = PlanCache("norm_rope", TILES)  # the active tiles (and launch plans made with them)
_tiles = PLANS.tiles


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, N, x_row_stride, eps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr):
    wait_inputs()
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    cols = tl.arange(0, BLOCK_N)
    x_rows = x_ptr + rows[:, None] * x_row_stride
    out_rows = out_ptr + rows[:, None] * N
    if SINGLE:
        m = rmask[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(out_rows + cols[None, :], to_out(x * r[:, None] * w[None, :], out_ptr.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            m = rmask[:, None] & ((n0 + cols) < N)[None, :]
            x = tl.load(x_rows + n0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc += x * x
        r = tl.math.rsqrt(tl.sum(acc, axis=1) / N + eps)
        for n0 in range(0, N, BLOCK_N):
            cmask = (n0 + cols) < N
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(x_rows + n0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + n0 + cols, mask=cmask, other=0.0).to(tl.float32)
            y = x * r[:, None] * w[None, :]
            tl.store(out_rows + n0 + cols[None, :], to_out(y, out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0 or n == 0:
        return out
    t = _tiles()["rms_norm"]
    block_n = min(next_pow2(n), t["MAX_BLOCK_N"])
    block_m = max(1, t["ROW_ELEMS"] // block_n) if block_n >= n else 1
    block_m = min(block_m, next_pow2(rows))
    grid = (cdiv(rows, block_m),)
    _rms_norm_kernel[grid](x2, weight, out, rows, n, x2.stride(0), float(eps),
                           BLOCK_M=block_m, BLOCK_N=block_n, SINGLE=block_n >= n, num_warps=t["num_warps"],
                           **pdl.options(x2.device))
    return out


@triton.jit
def _rope_kernel(x_ptr, f_ptr, out_ptr, n_rows, S, H, R, HEAD, sxb, sxs, sxh, sfb, sfs, sfp,
                 INVERSE: tl.constexpr, PAIRS_CONTIGUOUS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """Rows of R channels: the first HEAD (even) copied, the rest rotated by the table's pairs."""
    wait_inputs()
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # flattened (b, s, h); int32 divisions
    h = (row % H).to(tl.int64)
    s = ((row // H) % S).to(tl.int64)
    b = (row // (H * S)).to(tl.int64)
    c = tl.arange(0, BLOCK_R)
    m = (row < n_rows)[:, None] & (c < R)[None, :]
    ct = c - HEAD  # table channel (negative: a copied head channel)
    fc = ct if PAIRS_CONTIGUOUS else (ct // 2) * sfp + ct % 2  # table pairs adjacent (sfp == 2): one vector load
    f = tl.load(f_ptr + (b * sfb + s * sfs)[:, None] + fc[None, :], mask=m & (ct >= 0)[None, :], other=0.0)
    fr, fi = tl.split(tl.reshape(f, (BLOCK_ROWS, BLOCK_R // 2, 2)))  # interleaved (re, im) pairs
    if INVERSE:
        fi = -fi
    x = tl.load(x_ptr + (b * sxb + s * sxs + h * sxh)[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
    xr, xi = tl.split(tl.reshape(x, (BLOCK_ROWS, BLOCK_R // 2, 2)))
    yr = xr * fr - xi * fi
    yi = xr * fi + xi * fr
    y = tl.where((c < HEAD)[None, :], x, tl.reshape(tl.join(yr, yi), (BLOCK_ROWS, BLOCK_R)))
    tl.store(out_ptr + row.to(tl.int64)[:, None] * R + c[None, :], to_out(y, out_ptr.dtype.element_ty), mask=m)


def rope(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    x4 = x.unsqueeze(0) if x.dim() == 2 else x  # [S, R] -> [1, S, R]
    x4 = x4.unsqueeze(2) if x4.dim() == 3 else x4  # [B, S, R] -> [B, S, 1, R]
    B, S, H, R = x4.shape
    f = torch.view_as_real(freqs_cis)  # [(B,) S, P, 2] fp32: the last 2P channels rotate
    assert f.dtype == torch.float32 and f.stride(-1) == 1
    sfb = f.stride(0) if f.dim() == 4 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = B * S * H
    if out.numel() == 0:
        return out
    t = _tiles()["rope"]
    block_r = next_pow2(R)
    block_rows = min(next_pow2(n_rows), max(1, t["TILE_ELEMS"] // block_r))
    _rope_kernel[(cdiv(n_rows, block_rows),)](
        x4, f, out, n_rows, S, H, R, R - 2 * f.shape[-2], x4.stride(0), x4.stride(1), x4.stride(2), sfb, f.stride(-3), f.stride(-2),
        INVERSE=bool(inverse), PAIRS_CONTIGUOUS=f.stride(-2) == 2, BLOCK_ROWS=block_rows, BLOCK_R=block_r, num_warps=t["num_warps"],
        **pdl.options(x4.device))
    return out


def warmup_cases(device, d: dict, dtype):
    """rms_norm at every width the model normalises (bf16 weights); rope on the q, kv, index q and
    compressed-entry rows with a table of the tail's pairs, and the inverse on the attention output."""
    rd, hd, ihd = d["rope_head_dim"], d["head_dim"], d["index_head_dim"]
    for n in _warmup.TOKENS:
        entries = sorted({n, max(1, n // 2)})
        for width, rows in ((d["dim"], [n]), (d["q_lora_rank"], [n]), (hd, entries), (ihd, entries)):
            for m in rows:
                x = _warmup.rand((1, m, width), dtype, device)
                yield _warmup.Launch("rms_norm", rms_norm, (x, torch.ones(width, dtype=torch.bfloat16, device=device),
                                                          d["norm_eps"]))
        for m in entries:
            f = torch.polar(torch.ones(1, m, rd // 2, device=device), torch.rand(1, m, rd // 2, device=device))
            shapes = [(1, m, hd), (1, m, ihd)] + ([(1, m, d["n_heads"], hd), (1, m, d["index_n_heads"], ihd)]
                                                   if m == n else [])
            for shape in shapes:
                yield _warmup.Launch("rope", rope, (_warmup.rand(shape, dtype, device), f, False))
            if m == n:
                o = _warmup.rand((1, m, d["n_heads"], hd), dtype, device)
                yield _warmup.Launch("rope inverse", rope, (o, f, True))
    if "vision_dim" in d:  # the image encoder: bf16 rows of vision_dim, 2-D rope over whole heads
        vh, n = d["vision_dim"] // d["vision_n_heads"], d["vision_max_n_token"]
        x = _warmup.rand((n, d["vision_dim"]), torch.bfloat16, device)
        yield _warmup.Launch("rms_norm vision", rms_norm, (x, torch.ones(d["vision_dim"], dtype=torch.bfloat16,
                                                                         device=device), 1e-6))
        f = torch.polar(torch.ones(n, vh // 2, device=device), torch.rand(n, vh // 2, device=device))
        q = _warmup.rand((1, n, d["vision_n_heads"], vh), torch.bfloat16, device)
        yield _warmup.Launch("rope vision", rope, (q, f, False))


FAMILY = KernelFamily(
    "norm_rope", ops={"rms_norm": rms_norm, "rope": rope},
    supports={"rms_norm": Support(inputs={"x": _DTYPES, "weight": _DTYPES}), "rope": Support(inputs={"x": _DTYPES})},
    tiles=TILES, tile_checks={"rms_norm.MAX_BLOCK_N": POW2, "rms_norm.ROW_ELEMS": POW2, "rope.TILE_ELEMS": POW2},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="RMSNorm and rotary embedding")
