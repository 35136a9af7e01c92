"""mHC kernels: ``hc_coefficients`` (GEMV + Sinkhorn fused), ``hc_collapse``, ``hc_collapse_norm``
(collapse + RMS norm, one program per token), ``hc_expand``.

``hc_coefficients``: ``m = v @ fn.T`` over ``K = hc * D`` for ``T = B * S`` tokens, ``fn`` rows
split in two ``tl.dot`` accumulators: the ``2hc`` pre/post rows (``PP`` columns, padded to 16)
and the ``hc x hc`` comb rows laid out as an ``HCP x HCP`` square (``HCP = max(4, pow2(hc))``).
A program owns ``BLOCK_T`` tokens and a K range (up to the ``FMA_T`` tile's token count the
GEMV is fp32 multiply-adds summed over K instead, in a token tile of the next power of two of T,
not a 16-row dot); with few tokens K is split over programs (partials in a workspace, summed by
each token tile's last split program, :mod:`.splitk`, or by ``_hc_finish_kernel`` when
``hc_finish.in_kernel`` is off; with ``hc_finish.value_major`` the partials are stored value major
and summed in one load, ``_hc_coefficients_vm_kernel``), otherwise the same program runs the
epilogue: rsqrt(mean v**2), sigmoids, softmax and the Sinkhorn iterations in registers.
Dot precision: bf16 ``x`` on the GPU multiplies ``fn`` split into ``FN_PARTS`` bf16 terms
(``x`` is exact in bf16, so 3 parts give fp32 accuracy on the tensor cores); otherwise an
fp32 ``ieee`` dot. The op is memory-bound on ``x`` for many tokens and on ``fn`` for few.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.kernels_cuda.codecs import INTERPRETED, to_out
from flashrt.families import Dim, KernelFamily, Support
from flashrt.tile_checks import COUNT0, DOT, POW2, Tile
from flashrt.kernels_cuda.launch import PlanCache, cdiv, next_pow2
from flashrt.kernels_cuda import norm_rope, splitk
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

TILES = {
    # bf16 x on the GPU (tensor cores); BLOCK_T 128 (8 warps) only from BIG_T tokens on; up to
    # SMALL_T tokens (decode batches) tiles of BLOCK_T_SMALL: more token tiles, each finishing its
    # own splits, instead of one program summing every split of the batch
    # FMA_T: up to this many tokens the GEMV runs on fp32 FMAs and a sum over K (token tiles of the
    # next power of two of T, no 16-row tl.dot tile; 0: off, the dot path everywhere); num_stages:
    # the software pipeline's depth (0: Triton's default; a program with one K block has nothing to
    # pipeline); FMA_BLOCK_K: the multiply-add GEMV's K block (null: BLOCK_K), wider blocks making
    # fewer splits where K is long
    "hc_coefficients": {"BLOCK_K": 128, "FN_PARTS": 3, "PROGRAMS": 264, "BLOCK_T_MAX": 64, "BIG_T": 2048,
                        "SMALL_T": 64, "BLOCK_T_SMALL": 16, "FMA_T": 0, "FMA_BLOCK_K": None, "num_stages": 0},
    "hc_coefficients_fp32": {"BLOCK_K": 64, "BLOCK_T_MAX": 32},  # fp32 FMA dot (ieee): 64 tokens spill
    # in_kernel: the last split program finishes; SPLIT_CHUNK: split partials loaded and summed at
    # once, fewer where a load would pass SPLIT_ELEMS values (BLOCK_T x 16 per split); 1 (one split
    # a load) is the faster at decode shapes on sm_90 (docs/performance.md)
    # value_major: where a token tile's partials of every split fit SPLIT_ELEMS values (the splits padded
    # to a power of two), they are stored with each value's splits side by side and the last split
    # program sums them in one load along the splits (_hc_coefficients_vm_kernel), not split by split
    "hc_finish": {"BLOCK_T": 32, "num_warps": 4, "in_kernel": True, "SPLIT_CHUNK": 1, "SPLIT_ELEMS": 4096,
                  "value_major": False},
    "hc_mix": {"BLOCK_D": 1024, "num_warps": 4},
    # in_kernel: collapse + norm in one program per token (else hc_collapse, then rms_norm)
    "hc_collapse_norm": {"MAX_BLOCK_D": 8192, "num_warps": 4, "in_kernel": True},
}


PLANS = PlanCache("mhc", TILES)  # the active tiles (and launch plans made with them)
_tiles = PLANS.tiles


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_HC = 8


@triton.jit
def _fn_dot(x, x_raw, fn_ptr, rows, valid, kk, K, acc, DOT_BF16: tl.constexpr, FN_PARTS: tl.constexpr):
    """acc += x @ fn[rows, kk].T (fn tile loaded transposed [BLOCK_K, N])."""
    f = tl.load(fn_ptr + rows[None, :].to(tl.int64) * K + kk[:, None], mask=valid[None, :] & (kk < K)[:, None],
                other=0.0)
    if DOT_BF16:
        for _ in tl.static_range(FN_PARTS):
            part = f.to(tl.bfloat16)
            acc = tl.dot(x_raw, part, acc)
            f = f - part.to(tl.float32)
    else:
        acc = tl.dot(x, f, acc, input_precision="ieee")
    return acc


@triton.jit
def _fn_fma(x, fn_ptr, rows, valid, kk, K):
    """x @ fn[rows, kk].T in fp32 multiply-adds (fn tile loaded [N, BLOCK_K], K contiguous)."""
    f = tl.load(fn_ptr + rows[:, None].to(tl.int64) * K + kk[None, :], mask=valid[:, None] & (kk < K)[None, :],
                other=0.0)
    return tl.sum(x[:, None, :] * f[None, :, :], axis=2)


@triton.jit
def _hc_partial(x_ptr, fn_ptr, t0, T, K, x_row_stride, k_lo, k_hi, HC: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_K: tl.constexpr, HCP: tl.constexpr, PP: tl.constexpr, DOT_BF16: tl.constexpr,
                FN_PARTS: tl.constexpr, FMA: tl.constexpr):
    """(acc_p [BLOCK_T, PP], acc_c [BLOCK_T, HCP*HCP], sum of squares [BLOCK_T]) over k in [k_lo, k_hi)."""
    t = t0 + tl.arange(0, BLOCK_T)
    p = tl.arange(0, PP)
    c = tl.arange(0, HCP * HCP)
    j, k = c // HCP, c % HCP
    comb_rows = 2 * HC + j * HC + k
    comb_valid = (j < HC) & (k < HC)
    acc_p = tl.zeros((BLOCK_T, PP), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_T, HCP * HCP), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xm = (t < T)[:, None] & (kk < k_hi)[None, :]
        x_raw = tl.load(x_ptr + t[:, None].to(tl.int64) * x_row_stride + kk[None, :], mask=xm, other=0.0)
        x = x_raw.to(tl.float32)
        ssq += tl.sum(x * x, axis=1)
        kk = tl.where(kk < k_hi, kk, K)  # past this range: masked in fn too
        if FMA:
            acc_p += _fn_fma(x, fn_ptr, p, p < 2 * HC, kk, K)
            acc_c += _fn_fma(x, fn_ptr, comb_rows, comb_valid, kk, K)
        else:
            acc_p = _fn_dot(x, x_raw, fn_ptr, p, p < 2 * HC, kk, K, acc_p, DOT_BF16, FN_PARTS)
            acc_c = _fn_dot(x, x_raw, fn_ptr, comb_rows, comb_valid, kk, K, acc_c, DOT_BF16, FN_PARTS)
    return acc_p, acc_c, ssq


@triton.jit
def _program_partial(x_ptr, fn_ptr, T, K, x_row_stride, k_per_split, HC: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_K: tl.constexpr, HCP: tl.constexpr, PP: tl.constexpr, DOT_BF16: tl.constexpr,
                     FN_PARTS: tl.constexpr, FMA: tl.constexpr):
    """This program's first token (its token tile: program id 0) and :func:`_hc_partial` over its K
    split (program id 1)."""
    t0 = tl.program_id(0) * BLOCK_T
    k_lo = tl.program_id(1) * k_per_split
    acc_p, acc_c, ssq = _hc_partial(x_ptr, fn_ptr, t0, T, K, x_row_stride, k_lo, tl.minimum(k_lo + k_per_split, K),
                                    HC, BLOCK_T, BLOCK_K, HCP, PP, DOT_BF16, FN_PARTS, FMA)
    return t0, acc_p, acc_c, ssq


@triton.jit
def _hc_epilogue(acc_p, acc_c, ssq, t0, T, K, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps,
                 norm_eps, HC: tl.constexpr, BLOCK_T: tl.constexpr, HCP: tl.constexpr, PP: tl.constexpr):
    t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < T
    r = tl.math.rsqrt(ssq / K + norm_eps)
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    p = tl.arange(0, PP)
    zp = (acc_p * r[:, None]) * tl.where(p < HC, s0, s1)[None, :]
    zp += tl.load(base_ptr + p, mask=p < 2 * HC, other=0.0)[None, :]
    sig = 1.0 / (1.0 + tl.exp(-zp))
    tl.store(pre_ptr + t[:, None] * HC + p[None, :], sig + eps, mask=tm[:, None] & (p < HC)[None, :])
    tl.store(post_ptr + t[:, None] * HC + (p - HC)[None, :], 2.0 * sig,
             mask=tm[:, None] & ((p >= HC) & (p < 2 * HC))[None, :])
    j = tl.arange(0, HCP)[:, None]
    k = tl.arange(0, HCP)[None, :]
    valid = ((j < HC) & (k < HC))[None, :, :]
    bc = tl.load(base_ptr + 2 * HC + j * HC + k, mask=(j < HC) & (k < HC), other=0.0)
    z = (tl.reshape(acc_c, (BLOCK_T, HCP, HCP)) * r[:, None, None]) * s2 + bc[None, :, :]
    z = tl.where(valid, z, float("-inf"))
    mx = tl.max(z, axis=2)
    e = tl.where(valid, tl.exp(z - tl.where(mx == float("-inf"), 0.0, mx)[:, :, None]), 0.0)  # pad rows: 0
    # the normalizations divide by the full-range fast division (a reciprocal and a product, within
    # 2 ulp), not the IEEE one: each is a step of the iterations' serial chain, and the IEEE
    # division adds a check, a Newton refinement and a slow-path branch to every step
    c = tl.where(valid, e / tl.maximum(tl.sum(e, axis=2), 1e-30)[:, :, None] + eps, 0.0)
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    tl.store(comb_ptr + t[:, None, None] * (HC * HC) + j[None, :, :] * HC + k[None, :, :], c,
             mask=tm[:, None, None] & valid)


@triton.jit
def _hc_coefficients_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, ws_p, ws_c, ws_s, cnt_ptr,
                            T, K, x_row_stride, k_per_split, n_splits, iters, eps, norm_eps,
                            HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, HCP: tl.constexpr,
                            PP: tl.constexpr, DOT_BF16: tl.constexpr, FN_PARTS: tl.constexpr,
                            SPLIT: tl.constexpr, FINISH: tl.constexpr, SPLIT_CHUNK: tl.constexpr, FMA: tl.constexpr):
    """One (token tile, K split). SPLIT: partials to the workspace, and with FINISH the token tile's
    last split program (a ticket from its counter, :mod:`.splitk`) sums them and runs the epilogue."""
    wait_inputs()
    split = tl.program_id(1)
    t0, acc_p, acc_c, ssq = _program_partial(x_ptr, fn_ptr, T, K, x_row_stride, k_per_split, HC, BLOCK_T, BLOCK_K,
                                             HCP, PP, DOT_BF16, FN_PARTS, FMA)
    if SPLIT:  # partials: ws_p [splits, T, PP], ws_c [splits, T, HCP*HCP], ws_s [splits, T]
        t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        row = split * T + t
        tm = t < T
        p = tl.arange(0, PP)
        c = tl.arange(0, HCP * HCP)
        tl.store(ws_p + row[:, None] * PP + p[None, :], acc_p, mask=tm[:, None])
        tl.store(ws_c + row[:, None] * (HCP * HCP) + c[None, :], acc_c, mask=tm[:, None])
        tl.store(ws_s + row, ssq, mask=tm)
        if FINISH:
            if splitk.last_ticket(cnt_ptr + tl.program_id(0), n_splits):
                _hc_finish(ws_p, ws_c, ws_s, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, t0, T, K, n_splits,
                           iters, eps, norm_eps, HC, BLOCK_T, HCP, PP, SPLIT_CHUNK)
                splitk.reset_ticket(cnt_ptr + tl.program_id(0))
    else:
        _hc_epilogue(acc_p, acc_c, ssq, t0, T, K, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps,
                     norm_eps, HC, BLOCK_T, HCP, PP)


@triton.jit
def _hc_coefficients_vm_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, ws_p, ws_c, ws_s,
                               cnt_ptr, T, K, x_row_stride, k_per_split, n_splits, iters, eps, norm_eps,
                               HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, HCP: tl.constexpr,
                               PP: tl.constexpr, DOT_BF16: tl.constexpr, FN_PARTS: tl.constexpr, FMA: tl.constexpr,
                               SPLITS: tl.constexpr):
    """One (token tile, K split) with the partials value major: ws_p [T, PP, SPLITS], ws_c
    [T, HCP*HCP, SPLITS], ws_s [T, SPLITS] (SPLITS: the split count's power of two, the padding never
    written nor read). The token tile's last split program loads every split of its values at once
    and sums along the splits (within threads and lanes: the splits are the contiguous axis), then
    runs the epilogue."""
    wait_inputs()
    split = tl.program_id(1)
    t0, acc_p, acc_c, ssq = _program_partial(x_ptr, fn_ptr, T, K, x_row_stride, k_per_split, HC, BLOCK_T, BLOCK_K,
                                             HCP, PP, DOT_BF16, FN_PARTS, FMA)
    t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < T
    p = tl.arange(0, PP)
    c = tl.arange(0, HCP * HCP)
    tl.store(ws_p + (t[:, None] * PP + p[None, :]) * SPLITS + split, acc_p, mask=tm[:, None])
    tl.store(ws_c + (t[:, None] * (HCP * HCP) + c[None, :]) * SPLITS + split, acc_c, mask=tm[:, None])
    tl.store(ws_s + t * SPLITS + split, ssq, mask=tm)
    if splitk.last_ticket(cnt_ptr + tl.program_id(0), n_splits):
        sp = tl.arange(0, SPLITS)
        ok = tm[:, None, None] & (sp < n_splits)[None, None, :]
        acc_p = tl.sum(tl.load(ws_p + (t[:, None, None] * PP + p[None, :, None]) * SPLITS + sp[None, None, :],
                               mask=ok, other=0.0, cache_modifier=".cg"), axis=2)
        acc_c = tl.sum(tl.load(ws_c + (t[:, None, None] * (HCP * HCP) + c[None, :, None]) * SPLITS
                               + sp[None, None, :], mask=ok, other=0.0, cache_modifier=".cg"), axis=2)
        ssq = tl.sum(tl.load(ws_s + t[:, None] * SPLITS + sp[None, :], mask=tm[:, None] & (sp < n_splits)[None, :],
                             other=0.0, cache_modifier=".cg"), axis=1)
        _hc_epilogue(acc_p, acc_c, ssq, t0, T, K, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps,
                     norm_eps, HC, BLOCK_T, HCP, PP)
        splitk.reset_ticket(cnt_ptr + tl.program_id(0))


@triton.jit
def _hc_finish(ws_p, ws_c, ws_s, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, t0, T, K, n_splits,
               iters, eps, norm_eps, HC: tl.constexpr, BLOCK_T: tl.constexpr, HCP: tl.constexpr, PP: tl.constexpr,
               SPLIT_CHUNK: tl.constexpr):
    """The split partials of tokens t0 + [0, BLOCK_T) summed (``SPLIT_CHUNK`` splits per load, a
    fixed order for a given split count), then the epilogue."""
    t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < T
    p = tl.arange(0, PP)
    c = tl.arange(0, HCP * HCP)
    acc_p = tl.zeros((BLOCK_T, PP), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_T, HCP * HCP), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s0 in range(0, n_splits, SPLIT_CHUNK):
        sj = s0 + tl.arange(0, SPLIT_CHUNK)
        row = sj[:, None] * T + t[None, :]  # [SPLIT_CHUNK, BLOCK_T]
        ok = (sj < n_splits)[:, None] & tm[None, :]
        acc_p += tl.sum(tl.load(ws_p + row[:, :, None] * PP + p[None, None, :], mask=ok[:, :, None], other=0.0,
                                cache_modifier=".cg"), axis=0)
        acc_c += tl.sum(tl.load(ws_c + row[:, :, None] * (HCP * HCP) + c[None, None, :], mask=ok[:, :, None],
                                other=0.0, cache_modifier=".cg"), axis=0)
        ssq += tl.sum(tl.load(ws_s + row, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
    _hc_epilogue(acc_p, acc_c, ssq, t0, T, K, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps,
                 norm_eps, HC, BLOCK_T, HCP, PP)


@triton.jit
def _hc_finish_kernel(ws_p, ws_c, ws_s, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, K, n_splits,
                      iters, eps, norm_eps, HC: tl.constexpr, BLOCK_T: tl.constexpr, HCP: tl.constexpr,
                      PP: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    wait_inputs()
    _hc_finish(ws_p, ws_c, ws_s, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, tl.program_id(0) * BLOCK_T, T, K,
               n_splits, iters, eps, norm_eps, HC, BLOCK_T, HCP, PP, SPLIT_CHUNK)


def _hc_plan(T: int, K: int, splits: int | None, dot_bf16: bool, fma: bool = False):
    """(BLOCK_T, BLOCK_K, num_warps, number of K splits, K per split): enough programs to fill the GPU.
    ``fma``: the multiply-add GEMV's token tile (the next power of two of T)."""
    t = _tiles()["hc_coefficients"]
    sizes = t if dot_bf16 else _tiles()["hc_coefficients_fp32"]
    block_t = min(max(16, next_pow2(T)), sizes["BLOCK_T_MAX"])
    if fma:
        block_t = next_pow2(T)
    elif dot_bf16 and T >= t["BIG_T"]:
        block_t = 128
    elif dot_bf16 and T <= t["SMALL_T"]:
        block_t = min(block_t, t["BLOCK_T_SMALL"])
    block_k = min((t["FMA_BLOCK_K"] or sizes["BLOCK_K"]) if fma else sizes["BLOCK_K"], max(16, next_pow2(K)))
    chunks = cdiv(K, block_k)
    if splits is None:
        splits = max(1, min(chunks, t["PROGRAMS"] // cdiv(T, block_t)))
    per = cdiv(chunks, max(1, min(splits, chunks)))
    return block_t, block_k, 8 if block_t >= 128 else 4, cdiv(chunks, per), per * block_k


def _coefficients_plan(T: int, K: int, hc: int, splits: int | None, dot_bf16: bool) -> dict:
    """Everything of one hc_coefficients launch that follows from the shapes and the active tiles."""
    fma = 0 < T <= _tiles()["hc_coefficients"]["FMA_T"]
    block_t, block_k, num_warps, n_splits, k_per = _hc_plan(T, K, splits, dot_bf16, fma)
    stages = _tiles()["hc_coefficients"]["num_stages"]
    f = _tiles()["hc_finish"]
    tiles = cdiv(T, block_t)
    finish = n_splits > 1 and f["in_kernel"] and splitk.fits(tiles)
    consts = dict(HC=hc, HCP=max(4, next_pow2(hc)), PP=max(16, next_pow2(2 * hc)))
    width = max(consts["PP"], consts["HCP"] ** 2)  # values of one token's partial (the wider part)

    # splits summed per load: one count for both finishes (the same sums in the same order), from
    # the larger of their token tiles
    fit = max(1, f["SPLIT_ELEMS"] // (max(block_t, f["BLOCK_T"]) * width))
    chunk = min(f["SPLIT_CHUNK"], 1 << (fit.bit_length() - 1))
    # the value-major partials: the in-kernel finish, every split of a token tile's values in one load
    value_major = finish and f["value_major"] and block_t * width * next_pow2(n_splits) <= f["SPLIT_ELEMS"]
    common = dict(BLOCK_T=block_t, BLOCK_K=block_k, DOT_BF16=dot_bf16, FN_PARTS=_tiles()["hc_coefficients"]["FN_PARTS"],
                  FMA=fma, num_warps=num_warps, **({"num_stages": stages} if stages else {}), **consts)

    return dict(grid=(tiles, n_splits), n_splits=n_splits, k_per=k_per, finish=finish, consts=consts,
                value_major=value_major and dict(common, SPLITS=next_pow2(n_splits)),
                kernel=dict(common, SPLIT=n_splits > 1, FINISH=finish, SPLIT_CHUNK=chunk),
                finish_grid=(cdiv(T, f["BLOCK_T"]),),
                finish_kernel=dict(BLOCK_T=f["BLOCK_T"], num_warps=f["num_warps"], SPLIT_CHUNK=chunk,
                                   **consts))


def hc_coefficients(x, fn, scale, base, iters, eps, norm_eps, splits: int | None = None):
    B, S, hc, D = x.shape
    T, K = B * S, hc * D
    x2 = x.reshape(T, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    fn, scale, base = fn.contiguous(), scale.contiguous(), base.contiguous()
    dev = x.device
    pre = torch.empty(B, S, hc, dtype=torch.float32, device=dev)
    post = torch.empty(B, S, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(B, S, hc, hc, dtype=torch.float32, device=dev)
    if T == 0:
        return pre, post, comb
    dot_bf16 = x.dtype == torch.bfloat16 and not INTERPRETED
    key = ("hc_coefficients", T, K, hc, splits, dot_bf16)
    plan = PLANS.lookup(key)[1] or PLANS.store(key, _coefficients_plan(T, K, hc, splits, dot_bf16))
    n_splits, consts = plan["n_splits"], plan["consts"]
    widths = (consts["PP"], consts["HCP"] * consts["HCP"], 1)
    vm = plan["value_major"]
    ws = [pre] * 3  # unused without a split
    if vm:  # value major: [T, values, splits]
        ws = [torch.empty(T, n, vm["SPLITS"], dtype=torch.float32, device=dev) for n in widths]
    elif n_splits > 1:
        ws = [torch.empty(n_splits, T, n, dtype=torch.float32, device=dev) for n in widths]
    cnt = splitk.counters(dev) if plan["finish"] else pre
    args = (x2, fn, scale, base, pre, post, comb, *ws, cnt, T, K, x2.stride(0), plan["k_per"], n_splits, iters,
            float(eps), float(norm_eps))
    if vm:
        _hc_coefficients_vm_kernel[plan["grid"]](*args, **vm, **pdl.options(x2.device))
    else:
        _hc_coefficients_kernel[plan["grid"]](*args, **plan["kernel"], **pdl.options(x2.device))
    if n_splits > 1 and not plan["finish"]:
        _hc_finish_kernel[plan["finish_grid"]](
            *ws, scale, base, pre, post, comb, T, K, n_splits, iters, float(eps), float(norm_eps),
            **plan["finish_kernel"], **pdl.options(scale.device))
    return pre, post, comb


@triton.jit
def _hc_collapse_kernel(x_ptr, pre_ptr, out_ptr, D, HC: tl.constexpr, HCP: tl.constexpr, BLOCK_D: tl.constexpr):
    wait_inputs()
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
            x, pre, out, D, HC=hc, HCP=next_pow2(hc), BLOCK_D=block_d, num_warps=t["num_warps"], **pdl.options(x.device))
    return out


@triton.jit
def _hc_collapse_norm_kernel(x_ptr, pre_ptr, w_ptr, out_ptr, D, eps, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token: the collapse of its hc streams, kept in registers (one stream at a time is read),
    rounded to the output dtype as ``hc_collapse`` stores it, then normalised as ``rms_norm``."""
    wait_inputs()
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
                                           num_warps=t["num_warps"], **pdl.options(x.device))
    return out


@triton.jit
def _hc_expand_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, HCP: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    wait_inputs()
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
            num_warps=t["num_warps"], **pdl.options(y.device))
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
    tiles=TILES, tile_checks={"hc_coefficients.FMA_T": COUNT0, "hc_coefficients.num_stages": COUNT0,
                              "hc_coefficients.FMA_BLOCK_K": Tile(low=16, pow2=True, nullable=True, kind=int),
                              "*.BLOCK_K": DOT, "*.BLOCK_T_MAX": DOT,
                              "*.BLOCK_T_SMALL": DOT, "hc_finish.BLOCK_T": POW2,
                              "hc_finish.in_kernel": Tile(kind=bool), "hc_finish.SPLIT_CHUNK": POW2,
                              "hc_finish.SPLIT_ELEMS": POW2, "hc_finish.value_major": Tile(kind=bool),
                              "hc_mix.BLOCK_D": POW2,
                              "hc_collapse_norm.MAX_BLOCK_D": POW2, "hc_collapse_norm.in_kernel": Tile(kind=bool)},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="mHC: mixing coefficients (GEMV + Sinkhorn), collapse (with its norm), expand")
