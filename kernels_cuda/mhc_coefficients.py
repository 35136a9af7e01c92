"""``hc_coefficients``: ``m = v @ fn.T`` over ``K = hc * D`` for ``T = B * S`` tokens, ``fn`` rows
split in two ``tl.dot`` accumulators: the ``2hc`` pre/post rows (``PP`` columns, padded to 16)
and the ``hc x hc`` comb rows laid out as an ``HCP x HCP`` square (``HCP = max(4, pow2(hc))``).
A program owns a token tile and a K range. Few tokens (decode): ``SPLIT_BLOCK_T``-token tiles with
K split so that tiles x splits is about ``PROGRAMS`` (one wave), partials in a workspace; each
token tile's last split program (a ticket, :mod:`.splitk`; or ``_hc_finish_kernel`` when
``hc_finish.in_kernel`` is off) sums them ``SUM_SPLITS`` splits a round (one round of loads,
not one per split) and runs the epilogue. Many tokens: tiles up to ``BLOCK_T_MAX`` tokens, K
split only while the tiles leave programs free. The epilogue: rsqrt(mean v**2), sigmoids,
softmax and the Sinkhorn iterations in registers.
Dot precision: bf16 ``x`` on the GPU multiplies ``fn`` split into ``FN_PARTS`` bf16 terms
(``x`` is exact in bf16, so 3 parts give fp32 accuracy on the tensor cores); otherwise an
fp32 ``ieee`` dot. The op is memory-bound on ``x`` for many tokens and on ``fn`` for few.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.kernels_cuda import splitk
from flashrt.kernels_cuda.codecs import INTERPRETED
from flashrt.kernels_cuda.launch import cdiv, next_pow2
from flashrt.kernels_cuda.mhc_tiles import PLANS, _tiles


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
def _hc_partial(x_ptr, fn_ptr, t0, T, K, x_row_stride, k_lo, k_hi, HC: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_K: tl.constexpr, HCP: tl.constexpr, PP: tl.constexpr, DOT_BF16: tl.constexpr,
                FN_PARTS: tl.constexpr):
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
        acc_p = _fn_dot(x, x_raw, fn_ptr, p, p < 2 * HC, kk, K, acc_p, DOT_BF16, FN_PARTS)
        acc_c = _fn_dot(x, x_raw, fn_ptr, comb_rows, comb_valid, kk, K, acc_c, DOT_BF16, FN_PARTS)
    return acc_p, acc_c, ssq


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
    c = tl.where(valid, tl.math.div_rn(e, tl.maximum(tl.sum(e, axis=2), 1e-30)[:, :, None]) + eps, 0.0)
    c = tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        c = tl.math.div_rn(c, tl.sum(c, axis=2)[:, :, None] + eps)
        c = tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + eps)
    tl.store(comb_ptr + t[:, None, None] * (HC * HC) + j[None, :, :] * HC + k[None, :, :], c,
             mask=tm[:, None, None] & valid)


@triton.jit(do_not_specialize=("T", "n_splits"))
def _hc_coefficients_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, ws_p, ws_c, ws_s, cnt_ptr,
                            T, K, x_row_stride, k_per_split, n_splits, iters, eps, norm_eps,
                            HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, HCP: tl.constexpr,
                            PP: tl.constexpr, DOT_BF16: tl.constexpr, FN_PARTS: tl.constexpr,
                            SPLIT: tl.constexpr, FINISH: tl.constexpr, SUM_SPLITS: tl.constexpr):
    """One (token tile, K split). SPLIT: partials to the workspace, and with FINISH the token tile's
    last split program (a ticket from its counter, :mod:`.splitk`) sums them and runs the epilogue."""
    t0 = tl.program_id(0) * BLOCK_T
    split = tl.program_id(1)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc_p, acc_c, ssq = _hc_partial(x_ptr, fn_ptr, t0, T, K, x_row_stride, k_lo, k_hi, HC, BLOCK_T, BLOCK_K,
                                    HCP, PP, DOT_BF16, FN_PARTS)
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
                           iters, eps, norm_eps, HC, BLOCK_T, HCP, PP, SUM_SPLITS)
                splitk.reset_ticket(cnt_ptr + tl.program_id(0))
    else:
        _hc_epilogue(acc_p, acc_c, ssq, t0, T, K, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps,
                     norm_eps, HC, BLOCK_T, HCP, PP)


@triton.jit
def _hc_finish(ws_p, ws_c, ws_s, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, t0, T, K, n_splits,
               iters, eps, norm_eps, HC: tl.constexpr, BLOCK_T: tl.constexpr, HCP: tl.constexpr, PP: tl.constexpr,
               SUM_SPLITS: tl.constexpr):
    """The split partials of tokens t0 + [0, BLOCK_T) summed, then the epilogue. SUM_SPLITS splits
    of the three partials a round (their loads issued together), summed as a tree in a fixed order:
    deterministic for a given split count."""
    t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < T
    p = tl.arange(0, PP)[None, None, :]
    c = tl.arange(0, HCP * HCP)[None, None, :]
    acc_p = tl.zeros((BLOCK_T, PP), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_T, HCP * HCP), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s0 in range(0, n_splits, SUM_SPLITS):
        s = s0 + tl.arange(0, SUM_SPLITS)
        row = s.to(tl.int64)[:, None] * T + t[None, :]  # [SUM_SPLITS, BLOCK_T]
        m = (s < n_splits)[:, None] & tm[None, :]
        part_p = tl.load(ws_p + row[:, :, None] * PP + p, mask=m[:, :, None], other=0.0, cache_modifier=".cg")
        part_c = tl.load(ws_c + row[:, :, None] * (HCP * HCP) + c, mask=m[:, :, None], other=0.0,
                         cache_modifier=".cg")
        part_s = tl.load(ws_s + row, mask=m, other=0.0, cache_modifier=".cg")
        acc_p += tl.sum(part_p, axis=0)
        acc_c += tl.sum(part_c, axis=0)
        ssq += tl.sum(part_s, axis=0)
    _hc_epilogue(acc_p, acc_c, ssq, t0, T, K, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps,
                 norm_eps, HC, BLOCK_T, HCP, PP)


@triton.jit(do_not_specialize=("T", "n_splits"))
def _hc_finish_kernel(ws_p, ws_c, ws_s, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, K, n_splits,
                      iters, eps, norm_eps, HC: tl.constexpr, BLOCK_T: tl.constexpr, HCP: tl.constexpr,
                      PP: tl.constexpr, SUM_SPLITS: tl.constexpr):
    _hc_finish(ws_p, ws_c, ws_s, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, tl.program_id(0) * BLOCK_T, T, K,
               n_splits, iters, eps, norm_eps, HC, BLOCK_T, HCP, PP, SUM_SPLITS)


def _hc_plan(T: int, K: int, splits: int | None, dot_bf16: bool):
    """(BLOCK_T, BLOCK_K, num_warps, number of K splits, K per split). Few tokens: SPLIT_BLOCK_T-token
    tiles, K split over about PROGRAMS programs (decode: one wave of short programs). Many tokens:
    the wide tiles, K split only while they number fewer than PROGRAMS / 2. A forced ``splits`` > 1
    takes the few-token tiles."""
    t = _tiles()["hc_coefficients"]
    sizes = t if dot_bf16 else _tiles()["hc_coefficients_fp32"]
    block_t = min(max(16, next_pow2(T)), sizes["BLOCK_T_MAX"])
    if dot_bf16 and T >= t["BIG_T"]:
        block_t = 128
    block_k = min(sizes["BLOCK_K"], max(16, next_pow2(K)))
    small_t, small_k = min(block_t, t["SPLIT_BLOCK_T"]), min(block_k, t["SPLIT_BLOCK_K"])
    few = t["PROGRAMS"] // cdiv(T, small_t) >= 2 if splits is None else splits > 1
    if few:
        block_t, block_k = small_t, small_k
    chunks = cdiv(K, block_k)
    if splits is None:
        splits = max(1, min(chunks, t["PROGRAMS"] // cdiv(T, block_t)))
    per = cdiv(chunks, max(1, min(splits, chunks)))
    warps = t["SPLIT_WARPS"] if few else 8 if block_t >= 128 else 4
    return block_t, block_k, warps, cdiv(chunks, per), per * block_k


def _coefficients_plan(T: int, K: int, hc: int, splits: int | None, dot_bf16: bool) -> dict:
    """Everything of one hc_coefficients launch that follows from the shapes and the active tiles."""
    block_t, block_k, num_warps, n_splits, k_per = _hc_plan(T, K, splits, dot_bf16)
    f = _tiles()["hc_finish"]
    tiles = cdiv(T, block_t)
    finish = n_splits > 1 and f["in_kernel"] and splitk.fits(tiles)
    consts = dict(HC=hc, HCP=max(4, next_pow2(hc)), PP=max(16, next_pow2(2 * hc)))
    return dict(grid=(tiles, n_splits), n_splits=n_splits, k_per=k_per, finish=finish, consts=consts,
                kernel=dict(BLOCK_T=block_t, BLOCK_K=block_k, DOT_BF16=dot_bf16,
                            FN_PARTS=_tiles()["hc_coefficients"]["FN_PARTS"], SPLIT=n_splits > 1, FINISH=finish,
                            SUM_SPLITS=_sum_splits(block_t), num_warps=num_warps, **consts),
                finish_grid=(cdiv(T, f["BLOCK_T"]),),
                finish_kernel=dict(BLOCK_T=f["BLOCK_T"], SUM_SPLITS=_sum_splits(f["BLOCK_T"]), num_warps=f["num_warps"],
                                   **consts))


def _sum_splits(block_t: int) -> int:
    """Splits a finishing round loads for a ``block_t``-token tile: SUM_SPLITS at SPLIT_BLOCK_T tokens,
    fewer for wider tiles (the same partial rows a round, the registers they take bounded)."""
    t = _tiles()["hc_coefficients"]
    return max(1, t["SUM_SPLITS"] * t["SPLIT_BLOCK_T"] // block_t)


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
    ws = [pre] * 3  # unused without a split
    if n_splits > 1:
        ws = [torch.empty(n_splits, T, n, dtype=torch.float32, device=dev)
              for n in (consts["PP"], consts["HCP"] * consts["HCP"], 1)]
    cnt = splitk.counters(dev) if plan["finish"] else pre
    _hc_coefficients_kernel[plan["grid"]](
        x2, fn, scale, base, pre, post, comb, *ws, cnt, T, K, x2.stride(0), plan["k_per"], n_splits, iters,
        float(eps), float(norm_eps), **plan["kernel"])
    if n_splits > 1 and not plan["finish"]:
        _hc_finish_kernel[plan["finish_grid"]](
            *ws, scale, base, pre, post, comb, T, K, n_splits, iters, float(eps), float(norm_eps),
            **plan["finish_kernel"])
    return pre, post, comb
