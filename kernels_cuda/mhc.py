"""mHC kernels: ``hc_coefficients`` (GEMV + Sinkhorn fused, :mod:`.mhc_coefficients`), ``hc_collapse``,
``hc_collapse_norm`` (collapse + RMS norm, one program per token), ``hc_expand``; the family's tiles:
:mod:`.mhc_tiles`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.kernels_cuda.codecs import to_out
from flashrt.families import Dim, KernelFamily, Support
from flashrt.tile_checks import DOT, POW2, WARPS, Tile
from flashrt.kernels_cuda.launch import cdiv, next_pow2
from flashrt.kernels_cuda import norm_rope
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.mhc_tiles import PLANS, TILES, _tiles  # noqa: F401 (PLANS: the family's launch plans)
from flashrt.kernels_cuda.mhc_coefficients import _coefficients_plan, _hc_plan, hc_coefficients  # noqa: F401

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_HC = 8


@triton.jit
def _hc_collapse_kernel(x_ptr, pre_ptr, out_ptr, D, HC: tl.constexpr, HCP: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.arange(0, HCP)
    m = (k < HC)[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + (tok * HC + k[:, None]) * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(pre_ptr + tok * HC + k, mask=k < HC, other=0.0)
    tl.store(out_ptr + tok * D + d, to_out(tl.sum(w[:, None] * x, axis=0), out_ptr.dtype.element_ty), mask=d < D)


def hc_collapse(x, pre):
    B, S, hc, D = x.shape
    x, pre = x.contiguous(), pre.contiguous()
    out = torch.empty(B, S, D, dtype=x.dtype, device=x.device)
    if out.numel():
        t = _tiles()["hc_mix"]
        block_d = min(t["BLOCK_D"], next_pow2(D))
        _hc_collapse_kernel[(B * S, cdiv(D, block_d))](
            x, pre, out, D, HC=hc, HCP=next_pow2(hc), BLOCK_D=block_d, num_warps=t["num_warps"])
    return out


@triton.jit
def _hc_collapse_norm_kernel(x_ptr, pre_ptr, w_ptr, out_ptr, D, eps, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token: the collapse of its hc streams, kept in registers (one stream at a time is read),
    rounded to the output dtype as ``hc_collapse`` stores it, then normalised as ``rms_norm``."""
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(HC):
        w = tl.load(pre_ptr + tok * HC + k)
        acc += w * tl.load(x_ptr + (tok * HC + k) * D + d, mask=dm, other=0.0).to(tl.float32)
    y = to_out(acc, out_ptr.dtype.element_ty).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(y * y, axis=0) / D + eps)
    g = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * D + d, to_out(y * r * g, out_ptr.dtype.element_ty), mask=dm)


def hc_collapse_norm(x, pre, weight, eps):
    B, S, hc, D = x.shape
    t = _tiles()["hc_collapse_norm"]
    if not t["in_kernel"] or next_pow2(D) > t["MAX_BLOCK_D"]:  # the row does not fit one program
        return norm_rope.rms_norm(hc_collapse(x, pre), weight, eps)
    x, pre, weight = x.contiguous(), pre.contiguous(), weight.contiguous()
    out = torch.empty(B, S, D, dtype=x.dtype, device=x.device)
    if out.numel():
        _hc_collapse_norm_kernel[(B * S,)](x, pre, weight, out, D, float(eps), HC=hc, BLOCK_D=next_pow2(D),
                                           num_warps=t["num_warps"])
    return out


@triton.jit
def _hc_expand_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, HCP: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    i = tl.arange(0, HCP)  # j (source stream) along axis 0, k (output stream) along axis 1 below
    im = i < HC
    res = tl.load(res_ptr + (tok * HC + i[:, None]) * D + d[None, :], mask=im[:, None] & dm[None, :],
                  other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + tok * HC * HC + i[:, None] * HC + i[None, :], mask=im[:, None] & im[None, :],
                   other=0.0)  # [j, k]
    mixed = tl.sum(comb[:, :, None] * res[:, None, :], axis=0)  # [k, BLOCK_D]
    y = tl.load(y_ptr + tok * D + d, mask=dm, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + tok * HC + i, mask=im, other=0.0)
    out = post[:, None] * y[None, :] + mixed
    tl.store(out_ptr + (tok * HC + i[:, None]) * D + d[None, :], to_out(out, out_ptr.dtype.element_ty),
             mask=im[:, None] & dm[None, :])


def hc_expand(y, residual, post, comb):
    B, S, hc, D = residual.shape
    y, residual, post, comb = y.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous()
    out = torch.empty(B, S, hc, D, dtype=y.dtype, device=y.device)
    if out.numel():
        t = _tiles()["hc_mix"]
        block_d = min(t["BLOCK_D"] // next_pow2(hc), next_pow2(D))
        _hc_expand_kernel[(B * S, cdiv(D, block_d))](
            y, residual, post, comb, out, D, HC=hc, HCP=next_pow2(hc), BLOCK_D=block_d,
            num_warps=t["num_warps"])
    return out


def warmup_cases(device, d: dict, dtype):
    """hc_coefficients (Sinkhorn fused), hc_collapse and hc_expand on the hc copies of a step."""
    hc, dim = d["hc_mult"], d["dim"]
    mix = (2 + hc) * hc
    fn = torch.randn(mix, hc * dim, device=device) * 1e-3
    scale, base = torch.ones(3, device=device), torch.zeros(mix, device=device)
    for n in _warmup.TOKENS:
        x = _warmup.rand((1, n, hc, dim), dtype, device)
        pre = torch.rand(1, n, hc, device=device)
        yield _warmup.Launch("hc_coefficients", hc_coefficients,
                             (x, fn, scale, base, d["hc_sinkhorn_iters"], d["hc_eps"], d["norm_eps"]))
        yield _warmup.Launch("hc_collapse", hc_collapse, (x, pre))
        norm_w = torch.ones(dim, dtype=dtype, device=device)
        yield _warmup.Launch("hc_collapse_norm", hc_collapse_norm, (x, pre, norm_w, d["norm_eps"]))
        comb = torch.rand(1, n, hc, hc, device=device)
        yield _warmup.Launch("hc_expand", hc_expand, (_warmup.rand((1, n, dim), dtype, device), x, pre, comb))


_STREAMS = Support(inputs={"x": _DTYPES}, dims={"x[2]": Dim(0, _MAX_HC)})
FAMILY = KernelFamily(
    "mhc", ops={"hc_coefficients": hc_coefficients, "hc_collapse": hc_collapse, "hc_collapse_norm": hc_collapse_norm,
                "hc_expand": hc_expand},
    supports={"hc_coefficients": _STREAMS, "hc_collapse": _STREAMS,
              "hc_collapse_norm": Support(inputs={"x": _DTYPES, "weight": _DTYPES}, dims={"x[2]": Dim(0, _MAX_HC)}),
              "hc_expand": Support(inputs={"y": _DTYPES, "residual": _DTYPES}, dims={"residual[2]": Dim(0, _MAX_HC)})},
    tiles=TILES, tile_checks={"*.BLOCK_K": DOT, "*.BLOCK_T_MAX": DOT, "hc_finish.BLOCK_T": POW2,
                              "hc_coefficients.SPLIT_BLOCK_T": DOT, "hc_coefficients.SPLIT_BLOCK_K": DOT,
                              "hc_coefficients.SUM_SPLITS": POW2, "hc_coefficients.SPLIT_WARPS": WARPS,
                              "hc_finish.in_kernel": Tile(kind=bool), "hc_mix.BLOCK_D": POW2,
                              "hc_collapse_norm.MAX_BLOCK_D": POW2, "hc_collapse_norm.in_kernel": Tile(kind=bool)},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="mHC: mixing coefficients (GEMV + Sinkhorn), collapse (with its norm), expand")
