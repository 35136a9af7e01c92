"""``linear`` with a plain bf16 / fp16 weight (compressor, indexer weights, output groups, the head):
``x @ w.T`` accumulated in fp32, as the reference computes it, without its per-call fp32 copy of the
weight (a weight read, an fp32 write and an fp32 GEMM that reads twice the bytes, every call).

``_plain_linear_kernel`` reads the weight once, as stored, and runs the MMA on it:

- x in the weight's dtype: one ``tl.dot`` per K block (exact products, fp32 accumulation);
- fp32 x with a bf16 weight (the layers computed in fp32): x is split into three bf16 parts,
  ``x = hi + mid + lo`` exactly (each part takes the next 8 significant bits; the rest of a 24-bit
  mantissa is at most 8 bits), and the three dots with the bf16 weight give exact products summed
  in fp32: the reference's fp32 GEMM up to summation order, at the tensor-core rate. The tensor
  cores' fp32 accumulation truncates, so the result is a few times less accurate than cuBLAS's
  fp32 GEMM; an fp32 FMA dot is more accurate but slower end to end (both measured in
  docs/performance.md, plain-weight linear with fp32 inputs).

A rule with the ``gemv`` knob runs its launches as a GEMV instead (:func:`.gemv._plain_gemv_kernel`:
a program per row, fp32 multiply-adds on the CUDA cores, no MMA).

The output is ``x.dtype``; few output tiles (decode) split K over programs, each tile's last program
summing the fp32 partials (:mod:`.splitk`). A tile rule's launch knobs are the quantized ``linear``
rules' (:data:`KNOBS`): narrower column tiles, then a K split, where the output tiles do not fill
the SMs.
Under the Triton interpreter the dot operands are fp32 (exact for these values) and fp32 -> bf16
rounding is done by hand (:func:`.codecs.to_out`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.jit_triton import interpreted
from flashrt.refmath_linear import per_group
from flashrt.families import KernelFamily, Support
from flashrt.tile_checks import DOT, Tile
from flashrt.kernels_cuda import splitk
from flashrt.kernels_cuda import gemv
from flashrt.kernels_cuda.gemv import _plain_gemv_kernel
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.launch import TL_DTYPES, PlanCache, cdiv, last_dense, sm_count
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

# A rule's launch knobs (not kernel parameters; a rule without them gets these values), as linear's:
# min_block_n halves BLOCK_N, down to it, while the output tiles at the halved width still fit in
# the SMs (None: BLOCK_N as given; splitk.narrow_block_n); split_min_blocks: the fewest K blocks a
# split keeps when K is split because the output tiles do not fill the SMs (None: no split);
# split_per_sm: split K to bring the programs nearest to this many an SM (linear's knob); gemv: the
# rule's launches as a GEMV (:func:`.gemv._plain_gemv_kernel`: gemv_rows rows and BLOCK_N weight rows a
# program, fp32 multiply-adds on the CUDA cores; BLOCK_M and min_block_n unused)
KNOBS = dict(min_block_n=None, split_min_blocks=4, split_per_sm=None, gemv=False, gemv_rows=1)

TILES = {
    # (largest M the rule serves or None, tile): the first matching rule applies
    "plain": (
        (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, **KNOBS)),  # decode: weight-bound
        # decode at larger batches: the prefill tile, apart so that its knobs leave prefill as it is
        (64, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
        (None, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    ),
    "split_k": None,  # None: split K when the output tiles do not fill the SMs; or a forced count
    "reduce_in_kernel": True,  # a split K summed by each tile's last program (False: sum and cast launches)
}
PLANS = PlanCache("linear_plain", TILES)  # the active tiles and the launch plans made with them
WEIGHT_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _plain_linear_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, n_group, k_split, n_splits, stride_xm,
                         stride_wn, stride_om, stride_os, SPLIT3: tl.constexpr, DOT: tl.constexpr, WDT: tl.constexpr,
                         OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         REDUCE: tl.constexpr):
    """out[:, n] = x[:, g*K:(g+1)*K] @ w[n].T with g = n // n_group (n_group = N: one group; a
    column tile lies inside one group)."""
    wait_inputs()
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (pid_n * BLOCK_N // n_group).to(tl.int64) * K
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_k * k_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_rows + kk[None, :], mask=(offs_m < M)[:, None] & (kk < K)[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=(offs_n < N)[:, None] & (kk < K)[None, :], other=0.0)
        wt = tl.trans(w.to(DOT))
        if SPLIT3:  # fp32 x = hi + mid + lo exactly, each a bf16 value
            hi = x.to(WDT).to(tl.float32)
            r = x - hi
            mid = r.to(WDT).to(tl.float32)
            lo = (r - mid).to(WDT).to(tl.float32)
            acc = tl.dot(hi.to(DOT), wt, acc, input_precision="ieee")
            acc = tl.dot(mid.to(DOT), wt, acc, input_precision="ieee")
            acc = tl.dot(lo.to(DOT), wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(DOT), wt, acc, input_precision="ieee")
    out = out_ptr if REDUCE else out_ptr + pid_k.to(tl.int64) * stride_os
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    splitk.store_tile(acc, out, ws_ptr, cnt_ptr, pid_n + pid_m * tl.num_programs(0), pid_k, n_splits, offs_m, offs_n,
                      ok, stride_om, M, N, OUT, REDUCE)


def _plan(m: int, n: int, k: int, xdt: torch.dtype, wdt: torch.dtype, odt: torch.dtype, *, sms: int,
          n_group: int | None = None) -> dict | None:
    """The launch of an [m, k] x [n, k] product (``n_group``: output columns per group, each group
    reading its own k columns of x; a column tile must not straddle two: None when none fits)."""
    tiles = PLANS.tiles()
    rule = next(tile for limit, tile in tiles["plain"] if limit is None or m <= limit)
    t = {key: v for key, v in rule.items() if key not in KNOBS}
    knobs = {key: rule.get(key, default) for key, default in KNOBS.items()}
    if n_group is not None and n_group % t["BLOCK_N"]:
        block_n = next((b for b in (128, 64, 32, 16) if b <= t["BLOCK_N"] and n_group % b == 0), None)
        if block_n is None:
            return None
        t["BLOCK_N"] = block_n
    if knobs["gemv"]:
        return dict(gemv.plan(m, n, k, odt, t, knobs, tiles["split_k"], sms, tiles["reduce_in_kernel"]),
                    n_group=n_group or n)
    row_tiles = cdiv(m, t["BLOCK_M"])
    # halving a power of two that divides n_group keeps dividing it: a tile stays inside one group
    t["BLOCK_N"] = splitk.narrow_block_n(t["BLOCK_N"], n, row_tiles, sms, knobs["min_block_n"])
    out_tiles = row_tiles * cdiv(n, t["BLOCK_N"])
    split, k_split = splitk.splits(out_tiles, k, t["BLOCK_K"], sms, tiles["split_k"], knobs["split_min_blocks"],
                                   knobs["split_per_sm"])
    reduce = split > 1 and tiles["reduce_in_kernel"] and splitk.fits(out_tiles) and split * m * n < 2 ** 31
    out_dtype = odt if split == 1 or reduce else torch.float32
    dot = tl.float32 if interpreted() else TL_DTYPES[wdt]
    return dict(grid=(cdiv(n, t["BLOCK_N"]), cdiv(m, t["BLOCK_M"]), split), split=split, k_split=k_split,
                out_dtype=out_dtype, reduce=reduce, n_group=n_group or n, gemv=False,
                constexprs=dict(SPLIT3=xdt == torch.float32, DOT=dot, WDT=TL_DTYPES[wdt], OUT=TL_DTYPES[out_dtype],
                                REDUCE=reduce, **t))


def num_sms(device: torch.device) -> int:
    """The SMs the launch plans fill (1 under the interpreter: no split, no narrowing there)."""
    return 1 if interpreted() else sm_count(device)


def plain_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., in] (fp32, or the weight's dtype), weight [out, in] bf16 / fp16 -> [..., out] in x.dtype
    (``out_dtype``: fp32 for callers that keep the fp32 sums, e.g. the MoE gate)."""
    n, k = weight.shape
    out = _launch(x.reshape(-1, k), weight, out_dtype or x.dtype, None)
    return out.view(*x.shape[:-1], n)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grouped_linear``: x [..., G, in], weight [G * out, in] -> [..., G * out], one launch when a
    column tile fits inside a group (else one ``linear`` per group)."""
    G, k = x.shape[-2], x.shape[-1]
    n = weight.shape[0]
    out = _launch(x.reshape(-1, G * k), weight, x.dtype, n // G)
    if out is None:
        return per_group(plain_linear, x, weight)
    return out.view(*x.shape[:-2], n)


def _launch(x2: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, n_group: int | None):
    """``x2 [m, G * k] @ weight [n, k].T`` group by group (``n_group`` columns each; None: one
    group) -> [m, n] in ``out_dtype``; None when no column tile fits a group."""
    n, k = weight.shape
    x2 = last_dense(x2)
    m = x2.shape[0]
    if m == 0 or n == 0 or k == 0:
        return x2.new_zeros(m, n, dtype=out_dtype)
    key = (m, n, k, x2.dtype, weight.dtype, out_dtype, n_group)
    plan = PLANS.lookup(key)[1]
    if plan is None:  # False: planned, and no column tile fits a group
        sms = num_sms(x2.device)
        plan = PLANS.store(key, _plan(m, n, k, x2.dtype, weight.dtype, out_dtype, sms=sms, n_group=n_group) or False)
    if plan is False:
        return None
    w = last_dense(weight)
    out, ws, cnt = splitk.outputs(plan, m, n, x2.device)
    args = (x2, w, out, ws, cnt, m, n, k, plan["n_group"], plan["k_split"], plan["split"], x2.stride(0), w.stride(0),
            out.stride(1), out.stride(0))  # the two kernels take the same parameters
    if plan["gemv"]:
        _plain_gemv_kernel[plan["grid"]](*args, **plan["constexprs"], **pdl.options(x2.device))
    else:
        _plain_linear_kernel[plan["grid"]](*args, **plan["constexprs"], **pdl.options(x2.device))
    return splitk.result(out, plan, out_dtype)


def supports_plain_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A 2-D bf16 / fp16 weight with x in its dtype, or fp32 x with a bf16 weight (fp32 weights,
    fp32 x with fp16 weights and mixed bf16 / fp16 are the reference's)."""
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.dtype not in WEIGHT_DTYPES:
        return False
    return x.dtype == weight.dtype or (x.dtype == torch.float32 and weight.dtype == torch.bfloat16)


def warmup_cases(device, d: dict, dtype):
    """The model's plain linears by kind: fp32 x (head, compressor) and bf16 x (output groups, indexer
    weights, ratio-1 compressor, index keys), a decode step and a prefill (and the row counts the GEMV
    rules give programs of their own: :func:`.gemv.warmup_rows`), with K split (few output tiles) and
    without (8,448 rows: more tiles than an H200 has SMs)."""
    dim = d["dim"]
    tokens = sorted({*_warmup.TOKENS, *gemv.warmup_rows(PLANS.tiles()["plain"])})
    for n_out in (d["head_dim"], 8448):
        w = _warmup.rand((n_out, dim), torch.bfloat16, device)
        for n in tokens:
            for xdt in (torch.float32, torch.bfloat16):
                yield _warmup.Launch(f"plain linear {xdt}", plain_linear, (_warmup.rand((n, dim), xdt, device), w))


def supports_grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """As :func:`supports_plain_linear` for one group's product."""
    return supports_plain_linear(x[..., 0, :], weight)


# ``linear`` (linear.py) and the MoE gate (moe_route.py) launch it too


def _bf16_tile_bytes(t: dict) -> int:
    """At least (stages - 1) buffers of the bf16 x and weight tiles."""
    return max(1, t["num_stages"] - 1) * (t["BLOCK_M"] + t["BLOCK_N"]) * t["BLOCK_K"] * 2


FAMILY = KernelFamily(
    "linear_plain", ops={"grouped_linear": grouped_linear},
    supports={"grouped_linear": Support(inputs={"x": (torch.float32,) + WEIGHT_DTYPES, "weight": WEIGHT_DTYPES},
                                        extra=supports_grouped_linear)},
    tiles=TILES, tile_checks={"plain.BLOCK_M": DOT, "plain.BLOCK_N": DOT, "plain.BLOCK_K": DOT,
                              "split_k": Tile(nullable=True, kind=int), "reduce_in_kernel": Tile(kind=bool),
                              "plain.min_block_n": Tile(low=32, pow2=True, nullable=True, kind=int),
                              "plain.split_min_blocks": Tile(nullable=True, kind=int),
                              "plain.split_per_sm": Tile(low=1, nullable=True, kind=int),
                              "plain.gemv": Tile(kind=bool),
                              "plain.gemv_rows": Tile(choices=(1, 2, 4))},
    smem={"plain": _bf16_tile_bytes}, warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="linear with a plain bf16 / fp16 weight (fp32 accumulation), and grouped by column blocks")
