"""``moe_experts``: routed SwiGLU experts with ``fp4_w`` / ``fp8_w`` weights, grouped by expert.

The (token, slot) pairs are sorted by expert with a table of row tiles, each inside one expert
(:mod:`.moe_tables`: one program for decode-sized batches, a sort and two kernels past that; no
host sync, so it can be captured in a CUDA graph). Then three kernels:

1. ``_moe_up_kernel``: per (row tile, column tile of I), W1 and W3 over the fp8 activations of the
   tile's tokens (rows gathered by token id; up to ``fused_max_tokens`` tokens quantized in the kernel
   from x, past that by one ``act_quant`` launch first), the SwiGLU epilogue in fp32 (gate and up rounded to
   x.dtype first, clamp, silu, times the routing weight), h rounded to x.dtype and quantized to fp8
   per 32 (the input W2 sees, as ``linear`` would quantize it), stored in pair order;
2. ``_moe_down_kernel``: per (row tile, column tile of D), W2 over h, output rounded to x.dtype;
3. ``_moe_combine_kernel``: each token sums its k rows in fp32 (a deterministic gather-sum), adds
   the op's ``add`` row after the sum and stores in ``out_dtype``; with ``combine.in_kernel`` (up
   to ``splitk.POOL`` token x column tiles) the down kernel does it: each (token, column tile) has a
   ticket counter (kernels_cuda/splitk.py's pool), and the program that stores a token's last row
   sums its k rows in slot order, so the bits are the combine kernel's.

One expert and one slot a token (the shared expert; ``direct`` on) needs no tables and no sum:
pair ``t`` is token ``t``, the row tiles are ``BLOCK_M`` tokens each (``DIRECT``), and the down
kernel writes each token's x.dtype-rounded row as fp32 (the combine's sum of one row): two launches.

The MMA modes are those of ``linear.py`` (promote for fp8_w on sm_89+, dequant-to-bf16 otherwise).
``moe_route`` is not served here (the reference does it: one small GEMM and a top-k).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.families import Dim, KernelFamily, Support
from flashrt.formats import QTensor
from flashrt.tile_checks import COUNT0, DOT, POW2, Tile, gemm_smem
from flashrt.kernels_cuda.launch import TL_DTYPES, PlanCache, cdiv, last_dense, zeros_stored
from flashrt.kernels_cuda import moe_tables, splitk
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.codecs import quant_fp8, to_out
from flashrt.kernels_cuda.linear import (FLOATS, SCALED, WEIGHT_FORMATS, act_quant, mma_mode, pick_tile,
                                         weight_operands)
from flashrt.kernels_cuda.linear_kernel import _k_loop
from flashrt.refmath_moe import finish_experts

TILES = {
    # (largest mean rows per expert the rule serves or None, tile): the first matching rule applies
    "experts": (
        (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),  # decode: weight-bound
        (None, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    ),
    "combine": dict(BLOCK_D=1024, num_warps=4, in_kernel=True),  # in_kernel: the down kernel's last program sums
    "route": moe_tables.ROUTE,  # the routing tables: one program up to max_pairs (token, slot) pairs
    "fused_max_tokens": 64,  # up to this many tokens the up kernel quantizes x itself (no act_quant launch)
    "direct": True,  # one expert, one slot (the shared expert): no routing tables, no combine launch
}


PLANS = PlanCache("moe", TILES)  # the active tiles (and launch plans made with them)
_tiles = PLANS.tiles


@triton.jit
def _tile_rows(tile_e_ptr, tile_row_ptr, row_end_ptr, n_rows, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """(expert, pair rows [BLOCK_M], row mask) of this program's row tile (``DIRECT``: expert 0,
    rows ``t * BLOCK_M ..`` of ``n_rows``; the tables are not read)."""
    t = tl.program_id(1)
    if DIRECT:
        e = tl.full([], 0, tl.int32)
        rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
        end = n_rows
    else:
        e = tl.load(tile_e_ptr + t)
        rows = tl.load(tile_row_ptr + t) + tl.arange(0, BLOCK_M)
        end = tl.load(row_end_ptr + t)
    return e, rows, rows < end


@triton.jit
def _swiglu(g, u, rw, limit, CLAMP: tl.constexpr, XDT: tl.constexpr):
    """h = silu(min(g, L)) * clamp(u, -L, L) * rw in fp32 from x.dtype-rounded g, u; rounded to x.dtype."""
    g = to_out(g, XDT).to(tl.float32)
    u = to_out(u, XDT).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g / (1.0 + tl.exp(-g)) * u * rw[:, None]
    return to_out(h, XDT).to(tl.float32)


@triton.jit
def _moe_up_kernel(xq_ptr, sx_ptr, tok_ptr, rw_ptr, w1_ptr, sw1_ptr, w3_ptr, sw3_ptr, hq_ptr, sh_ptr,
                   tile_e_ptr, tile_row_ptr, row_end_ptr, E, I, D, limit, n_rows,
                   stride_xm, stride_sxm, stride_we, stride_wn, stride_swe, stride_swn, stride_hm, stride_shm,
                   FP4: tl.constexpr, PROMOTE: tl.constexpr, DOT: tl.constexpr, CLAMP: tl.constexpr, XDT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QX: tl.constexpr,
                   DIRECT: tl.constexpr):
    """QX: xq_ptr holds the float x rows, quantized to fp8 in registers (sx_ptr unused). DIRECT:
    pair = token (tok_ptr unused), rw_ptr the [N] routing weights."""
    e, rows, row_ok = _tile_rows(tile_e_ptr, tile_row_ptr, row_end_ptr, n_rows, BLOCK_M, DIRECT)
    if e >= E:  # past the last tile
        return
    if DIRECT:
        tok = rows.to(tl.int64)
    else:
        tok = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    ew, es = e.to(tl.int64) * stride_we, e.to(tl.int64) * stride_swe
    g, u = _k_loop(xq_ptr + tok * stride_xm, sx_ptr + tok * stride_sxm, row_ok, w1_ptr + ew, sw1_ptr + es,
                   w3_ptr + ew, sw3_ptr + es, n0, I, 0, D, stride_wn, stride_swn,
                   FP4, PROMOTE, True, DOT, BLOCK_M, BLOCK_N, BLOCK_K, QX)
    rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0)
    h = _swiglu(g, u, rw, limit, CLAMP, XDT)
    q, s = quant_fp8(tl.reshape(h, (BLOCK_M, BLOCK_N // 32, 32)))  # fp8 bytes: E4M3 and UE8M0
    kg = n0 + tl.arange(0, BLOCK_N // 32) * 32
    r64 = rows.to(tl.int64)
    ok = row_ok[:, None] & (kg < I)[None, :]
    ptrs = hq_ptr + r64[:, None, None] * stride_hm + kg[None, :, None] + tl.arange(0, 32)[None, None, :]
    tl.store(ptrs, q.to(tl.uint8), mask=ok[:, :, None])
    tl.store(sh_ptr + r64[:, None] * stride_shm + (kg // 32)[None, :], s.to(tl.uint8), mask=ok)


@triton.jit
def _moe_down_kernel(hq_ptr, sh_ptr, w2_ptr, sw2_ptr, y_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, E, D, I, n_rows,
                     stride_hm, stride_shm, stride_we, stride_wn, stride_swe, stride_swn, stride_ym,
                     tok_ptr, pos_ptr, out_ptr, cnt_ptr, TOPK, stride_om, add_ptr, stride_am,
                     FP4: tl.constexpr, PROMOTE: tl.constexpr, DOT: tl.constexpr, XDT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT: tl.constexpr,
                     COMBINE: tl.constexpr, HAS_ADD: tl.constexpr):
    """y rows rounded to XDT (stored as y's dtype: fp32 when DIRECT writes the op's output).
    COMBINE: then a ticket per (token, column tile) of each row; the program drawing a token's
    last (TOPK-th) ticket sums its TOPK rows in slot order (``_moe_combine_kernel``'s sum), adds
    the token's ``add`` row after the sum (HAS_ADD), stores it in ``out``'s dtype and puts the
    counter back to zero."""
    e, rows, row_ok = _tile_rows(tile_e_ptr, tile_row_ptr, row_end_ptr, n_rows, BLOCK_M, DIRECT)
    if e >= E:
        return
    r64 = rows.to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    w2, sw2 = w2_ptr + e.to(tl.int64) * stride_we, sw2_ptr + e.to(tl.int64) * stride_swe
    acc, _ = _k_loop(hq_ptr + r64 * stride_hm, sh_ptr + r64 * stride_shm, row_ok, w2, sw2, w2, sw2,
                     n0, D, 0, I, stride_wn, stride_swn, FP4, PROMOTE, False, DOT, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    y = to_out(acc, XDT).to(y_ptr.dtype.element_ty)
    col_ok = offs_n < D
    tl.store(y_ptr + r64[:, None] * stride_ym + offs_n[None, :], y, mask=row_ok[:, None] & col_ok[None, :])
    if COMBINE:
        tok = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        slot = cnt_ptr + tok * tl.num_programs(0) + tl.program_id(0)
        last = row_ok & splitk.last_ticket(slot, TOPK, row_ok)  # once every thread's rows are stored
        tl.debug_barrier()  # a row's ticket and its loads below may sit in different threads
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in range(TOPK):
            p = tl.load(pos_ptr + tok * TOPK + s, mask=last, other=0).to(tl.int64)
            total += tl.load(y_ptr + p[:, None] * stride_ym + offs_n[None, :], mask=last[:, None] & col_ok[None, :],
                             other=0.0, cache_modifier=".cg").to(tl.float32)
        if HAS_ADD:
            total += tl.load(add_ptr + tok[:, None] * stride_am + offs_n[None, :], mask=last[:, None] & col_ok[None, :],
                             other=0.0)
        tl.store(out_ptr + tok[:, None] * stride_om + offs_n[None, :], to_out(total, out_ptr.dtype.element_ty),
                 mask=last[:, None] & col_ok[None, :])
        splitk.reset_ticket(slot, last)


@triton.jit
def _moe_combine_kernel(y_ptr, pos_ptr, out_ptr, add_ptr, D, TOPK, stride_ym, stride_om, stride_am,
                        BLOCK_D: tl.constexpr, HAS_ADD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(TOPK):
        p = tl.load(pos_ptr + t * TOPK + s).to(tl.int64)
        acc += tl.load(y_ptr + p * stride_ym + offs, mask=offs < D, other=0.0).to(tl.float32)
    if HAS_ADD:  # after the sum, as the op adds it
        acc += tl.load(add_ptr + t * stride_am + offs, mask=offs < D, other=0.0)
    tl.store(out_ptr + t * stride_om + offs, to_out(acc, out_ptr.dtype.element_ty), mask=offs < D)


def _direct_tables(weights: torch.Tensor, block_m: int) -> dict:
    """What the kernels read of the tables in ``DIRECT`` mode: the [N] routing weights (fp32) and
    the number of row tiles (the other entries are never read: the weights stand in)."""
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    return dict(tok=rw, rw=rw, tile_e=rw, tile_row=rw, row_end=rw, tiles=cdiv(rw.shape[0], block_m))


def _experts_up(xq, sx, tab, w1, w3, I, limit, xdtype, t, qx: bool, direct: bool = False):
    (d1, s1), (d3, s3) = weight_operands(w1), weight_operands(w3)
    assert d1.stride() == d3.stride() and s1.stride() == s3.stride(), "w1 and w3 must share a layout"
    pairs, D = tab["tok"].shape[0], xq.shape[1]
    hq = torch.empty(pairs, I, dtype=torch.uint8, device=xq.device)  # E4M3 bytes
    sh = torch.empty(pairs, I // 32, dtype=torch.uint8, device=xq.device)  # UE8M0 bytes
    promote, dot = mma_mode(w1.fmt)
    grid = (cdiv(I, t["BLOCK_N"]), tab["tiles"] if direct else tab["tile_e"].shape[0])
    _moe_up_kernel[grid](
        xq, sx, tab["tok"], tab["rw"], d1, s1, d3, s3, hq, sh, tab["tile_e"], tab["tile_row"], tab["row_end"],
        w1.shape[0], I, D, limit, pairs, xq.stride(0), sx.stride(0), d1.stride(0), d1.stride(1), s1.stride(0),
        s1.stride(1), hq.stride(0), sh.stride(0), FP4=w1.fmt == "fp4_w", PROMOTE=promote, DOT=dot, CLAMP=limit > 0,
        XDT=TL_DTYPES[xdtype], QX=qx, DIRECT=direct, **t)
    return hq, sh


def _experts_down(hq, sh, tab, w2, D, xdtype, t, direct: bool = False, combine=None, add=None):
    """The pairs' rows [pairs, D] in x.dtype (``direct``: the op's fp32 output, pair = token).
    ``combine``: (out [N, D], k): the kernel also sums each token's k rows, plus ``add`` (fp32
    [N, D] or None), into ``out`` (in out's dtype)."""
    d2, s2 = weight_operands(w2)
    y = torch.empty(hq.shape[0], D, dtype=torch.float32 if direct else xdtype, device=hq.device)
    promote, dot = mma_mode(w2.fmt)
    grid = (cdiv(D, t["BLOCK_N"]), tab["tiles"] if direct else tab["tile_e"].shape[0])
    out, k = combine if combine is not None else (y, 1)
    cnt = splitk.counters(hq.device) if combine is not None else y
    _moe_down_kernel[grid](
        hq, sh, d2, s2, y, tab["tile_e"], tab["tile_row"], tab["row_end"], w2.shape[0], D, hq.shape[1], hq.shape[0],
        hq.stride(0), sh.stride(0), d2.stride(0), d2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        tab["tok"], tab.get("pos", y), out, cnt, k, out.stride(0), add if add is not None else out,
        add.stride(0) if add is not None else 0,
        FP4=w2.fmt == "fp4_w", PROMOTE=promote, DOT=dot, XDT=TL_DTYPES[xdtype], DIRECT=direct,
        COMBINE=combine is not None, HAS_ADD=add is not None, **t)
    return y


def moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit, add=None, out_dtype=torch.float32):
    """x [N, D], weights [N, k] fp32, indices [N, k] int32, w1/w3 [E, I, D], w2 [E, D, I] QTensor,
    add fp32 [N, D] or None -> [N, D] in out_dtype (the sum, plus add, cast: in the combine)."""
    assert _quantized_up_pair(w1, w3, w2), (w1, w3, w2)  # dispatch checked the rest of FAMILY's support
    n, D = x.shape
    k = indices.shape[1]
    E, I = w1.shape[0], w1.shape[1]
    if n * k == 0 or D == 0 or I == 0:
        return finish_experts(torch.zeros(n, D, dtype=torch.float32, device=x.device), add, out_dtype)
    key = ("experts", n, k, E, D)
    plan = PLANS.lookup(key)[1] or PLANS.store(key, _experts_plan(n, k, E, D))
    t, qx = plan["tile"], plan["qx"]
    xq, sx = (last_dense(x),) * 2 if qx else act_quant(x)
    if plan["direct"]:  # every token's one slot is expert 0
        tab = _direct_tables(weights, t["BLOCK_M"])
        hq, sh = _experts_up(xq, sx, tab, w1, w3, I, float(swiglu_limit), x.dtype, t, qx, direct=True)
        return finish_experts(_experts_down(hq, sh, tab, w2, D, x.dtype, t, direct=True), add, out_dtype)
    tab = moe_tables.route_tables(indices, weights, E, t["BLOCK_M"], plan["route"])
    hq, sh = _experts_up(xq, sx, tab, w1, w3, I, float(swiglu_limit), x.dtype, t, qx)
    out = torch.empty(n, D, dtype=out_dtype, device=x.device)  # every row is written: k >= 1
    add = add.contiguous() if add is not None else None
    c = plan["combine"]
    if plan["combine_in_kernel"]:
        _experts_down(hq, sh, tab, w2, D, x.dtype, t, combine=(out, k), add=add)
        return out
    y = _experts_down(hq, sh, tab, w2, D, x.dtype, t)
    _moe_combine_kernel[(n, cdiv(D, c["BLOCK_D"]))](
        y, tab["pos"], out, add if add is not None else out, D, k, y.stride(0), out.stride(0),
        add.stride(0) if add is not None else 0, BLOCK_D=c["BLOCK_D"], HAS_ADD=add is not None,
        num_warps=c["num_warps"])
    return out


def _experts_plan(n: int, k: int, E: int, D: int) -> dict:
    """The tiles and paths of one (tokens, top-k, experts, dim) under the active tiles."""
    t = pick_tile(_tiles()["experts"], n * k / E)
    c = _tiles()["combine"]
    return dict(tile=t, qx=n <= _tiles()["fused_max_tokens"], direct=E == 1 and k == 1 and _tiles()["direct"],
                route=_tiles()["route"], combine=c,
                combine_in_kernel=c["in_kernel"] and splitk.fits(n * cdiv(D, t["BLOCK_N"])))


def _quantized_up_pair(w1, w3, w2) -> bool:
    """What the launcher's code relies on of the weights (a cheap guard on every call; dispatch
    checks FAMILY's whole support declaration once per call key): all quantized in WEIGHT_FORMATS,
    w1 and w3 in one format."""
    return all(isinstance(w, QTensor) and w.fmt in WEIGHT_FORMATS for w in (w1, w3, w2)) and w1.fmt == w3.fmt


def same_up_format(x, weights, indices, w1, w3, w2, swiglu_limit, add=None, out_dtype=None) -> bool:
    """w1 and w3 in one format (the up kernel reads both with one decoder)."""
    return w1.fmt == w3.fmt


def warmup_cases(device, d: dict, dtype):
    """moe_experts with every tile rule (a token count whose mean rows per expert falls in it) and
    the shared expert (E = 1, k = 1). 16 experts stand for the model's: the kernels see E only as
    an integer (specialised on % 16, like 32 and 384), and the token count picks the rule."""
    D, I, k, E = d["dim"], d["moe_inter_dim"], d["n_activated_experts"], 16
    fmt = "fp4_w" if d["expert_dtype"] == "fp4" else "fp8_w"
    weights = {e: (zeros_stored(fmt, (e, I, D), None, device), zeros_stored(fmt, (e, I, D), None, device),
                   zeros_stored(fmt, (e, D, I), None, device)) for e in (E, 1)}
    for n in rule_tokens(_tiles()["experts"], E, k):
        x, rw = _warmup.rand((n, D), dtype, device), torch.rand(n, k, device=device)
        idx = torch.randint(0, E, (n, k), dtype=torch.int32, device=device)
        yield _warmup.Launch("moe_experts", moe_experts, (x, rw, idx, *weights[E], d["swiglu_limit"]))
    for n in _warmup.TOKENS:
        x, one = _warmup.rand((n, D), dtype, device), torch.ones(n, 1, device=device)
        first = torch.zeros(n, 1, dtype=torch.int32, device=device)
        yield _warmup.Launch("moe_experts shared", moe_experts, (x, one, first, *weights[1], d["swiglu_limit"]))
    yield from route_cases(device, d["n_routed_experts"], k)


def route_cases(device, experts: int, k: int):
    """The routing tables at the model's expert count (their kernels' expert width follows it, where
    the experts' GEMMs above see 16 stand-in experts): the one-program kernel at every power-of-two
    pair count it serves (its sort width follows the pairs: decode batches, prefill chunks) and the
    sorted path past it, for each tile rule's row height."""
    route = _tiles()["route"]
    for bm in sorted({t["BLOCK_M"] for _, t in _tiles()["experts"]}):
        pairs = 16
        while pairs <= route["max_pairs"]:
            yield _route_launch(device, experts, k, max(1, pairs // k), bm, route)  # sort width: pairs
            pairs *= 2
        if route["large"]:
            yield _route_launch(device, experts, k, route["max_pairs"] // k + 1, bm, route)


def _route_launch(device, experts: int, k: int, tokens: int, bm: int, route: dict):
    idx = torch.randint(0, experts, (tokens, k), dtype=torch.int32, device=device)
    return _warmup.Launch(f"moe route tables {tokens * k} pairs", moe_tables.route_tables,
                          (idx, torch.rand(tokens, k, device=device), experts, bm, route))


def rule_tokens(rules, experts: int, k: int) -> list[int]:
    """One token count per tile rule whose mean rows per expert (n * k / experts) it serves."""
    out, low = [], 0
    for limit, _ in rules:
        rows = limit if limit is not None else 2 * max(low, 16)
        n = max(1, rows * experts // k)
        assert n * k / experts > low, (rules, n)
        out.append(n)
        low = limit if limit is not None else low
    return out


FAMILY = KernelFamily(
    "moe", ops={"moe_experts": moe_experts},
    # all three weights quantized (fp4_w / fp8_w), w1 and w3 in one format; plain weights declined
    supports={"moe_experts": Support(inputs={"x": FLOATS, "w1": WEIGHT_FORMATS, "w3": WEIGHT_FORMATS,
                                             "w2": WEIGHT_FORMATS}, dims={"w1[1]": Dim(0, None, 32)},
                                     extra=same_up_format)},
    tiles=TILES, tile_checks={"experts.BLOCK_M": DOT, "experts.BLOCK_N": SCALED, "experts.BLOCK_K": SCALED,
                              "combine.BLOCK_D": POW2, "fused_max_tokens": COUNT0, "direct": Tile(kind=bool),
                              "combine.in_kernel": Tile(kind=bool), "route.large": Tile(kind=bool)},
    smem={"experts": gemm_smem}, warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="routed SwiGLU experts: grouped FP8 / FP4 GEMMs over routing tables")
