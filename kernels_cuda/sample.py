"""``sample`` on CUDA: the argmax of each logits row split over many programs in one launch.

``torch.argmax`` of a ``[B, V]`` row reduces each row in one block: for a 129K-entry vocabulary
that is a long serial reduction on one SM, the costliest single launch of a batch-1 decode step.
``_argmax_kernel`` runs a grid of ``(B, G)`` programs: program ``(b, g)`` scans its slice of row
``b`` in ``BLOCK``-wide tiles, each lane keeping the first NaN, the largest value and the first
column holding it over its columns (no reduction inside the loop), then reduces the lanes once
(NaN ranks above every number, as in ``torch.argmax``; ties go to the lower column),
stores that triple and takes a ticket from the row's counter (:mod:`.splitk`); the program that
draws the row's last ticket merges the ``G`` triples in slice order and writes the index. Greedy
``sample`` (temperature the number 0) is this argmax alone; otherwise the reference's Gumbel-max
runs with it in place of ``torch.argmax`` (same draws from ``generator``, same picks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt import refmath
from flashrt.families import KernelFamily
from flashrt.kernels_cuda import splitk
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.launch import PlanCache, cdiv, last_dense, sm_count
from flashrt.tile_checks import COUNT0, POW2, Tile
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

MAX_SLICES = 256  # slices a row is split into at most (the merge loads them as one vector)
TILES = {
    # BLOCK columns a tile; waves: the programs aimed at, in multiples of the SM count; in_kernel
    # off: torch.argmax
    "argmax": {"BLOCK": 2048, "waves": 4, "num_warps": 4, "in_kernel": True},
}
PLANS = PlanCache("sample", TILES)
MAX_V = 2 ** 31 - 2  # columns are int32 in the kernel; 2**31 - 1 stands for "no column"


@triton.jit(do_not_specialize=("V", "stride", "per_slice"))
def _argmax_kernel(x_ptr, out_ptr, pv_ptr, pi_ptr, cnt_ptr, V, stride, per_slice,
                   BLOCK: tl.constexpr, SLICES: tl.constexpr):
    wait_inputs()
    b, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    G = tl.num_programs(1)
    NONE: tl.constexpr = 2 ** 31 - 1
    # per lane: its first NaN column, its largest number and the first column holding it (lanes see
    # their columns in increasing order, so a strictly larger value is the only reason to move)
    lane_nan = tl.full([BLOCK], NONE, tl.int32)
    lane_v = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_at = tl.full([BLOCK], NONE, tl.int32)
    lo = g * per_slice
    hi = tl.minimum(lo + per_slice, V)
    for c0 in range(lo, hi, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < hi
        x = tl.load(x_ptr + b * stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
        lane_nan = tl.where(ok & (x != x) & (lane_nan == NONE), cols, lane_nan)
        take = ok & (x == x) & ((x > lane_v) | (lane_at == NONE))
        lane_v = tl.where(take, x, lane_v)
        lane_at = tl.where(take, cols, lane_at)
    nan_at = tl.min(lane_nan, axis=0)
    best = tl.max(lane_v, axis=0)
    best_at = tl.min(tl.where((lane_v == best) & (lane_at != NONE), lane_at, NONE), axis=0)
    slot = b * G + g
    tl.store(pv_ptr + slot, best)
    tl.store(pi_ptr + 2 * slot, nan_at)
    tl.store(pi_ptr + 2 * slot + 1, best_at)
    if splitk.last_ticket(cnt_ptr + b, G):
        s = tl.arange(0, SLICES)
        live = s < G
        # partials of other programs of this launch: read past L1
        v = tl.load(pv_ptr + b * G + s, mask=live, other=float("-inf"), cache_modifier=".cg")
        n_at = tl.load(pi_ptr + 2 * (b * G + s), mask=live, other=NONE, cache_modifier=".cg")
        v_at = tl.load(pi_ptr + 2 * (b * G + s) + 1, mask=live, other=NONE, cache_modifier=".cg")
        first_nan = tl.min(n_at, axis=0)
        m = tl.max(tl.where(v_at != NONE, v, float("-inf")), axis=0)
        first_m = tl.min(tl.where((v == m) & (v_at != NONE), v_at, NONE), axis=0)
        tl.store(out_ptr + b, tl.where(first_nan != NONE, first_nan, first_m).to(tl.int64))
        splitk.reset_ticket(cnt_ptr + b)


def _plan(B: int, V: int, device: torch.device) -> tuple[dict, int, int]:
    """(tiles, slices a row, columns a slice: a multiple of BLOCK)."""
    tiles, plan = PLANS.lookup((B, V, device))
    if plan is None:
        t = tiles["argmax"]
        want = cdiv(t["waves"] * sm_count(device), B)
        slices = max(1, min(want, cdiv(V, t["BLOCK"]), MAX_SLICES))
        per = cdiv(cdiv(V, slices), t["BLOCK"]) * t["BLOCK"]
        plan = PLANS.store((B, V, device), (t, cdiv(V, per), per))
    return plan


def argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: the first column of each row's maximum (NaN first), as ``x.argmax(-1)``."""
    B, V = x.shape
    t, slices, per = _plan(B, V, x.device)
    if not t["in_kernel"] or not splitk.fits(B) or B == 0 or V == 0 or V > MAX_V:
        return x.argmax(-1)
    x = last_dense(x)
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    pv = torch.empty(B * slices, dtype=torch.float32, device=x.device)
    pi = torch.empty(2 * B * slices, dtype=torch.int32, device=x.device)
    _argmax_kernel[(B, slices)](x, out, pv, pi, splitk.counters(x.device), V, x.stride(0), per,
                                BLOCK=t["BLOCK"], SLICES=MAX_SLICES, num_warps=t["num_warps"], **pdl.options(x.device))
    return out


def sample(logits, temperature, generator):
    """``flashrt.ops.sample``: greedy (the number 0) is :func:`argmax` of the logits as given (the
    argmax of a bf16 row is that of its fp32 values); else the reference's Gumbel-max with it."""
    if not isinstance(temperature, torch.Tensor) and temperature == 0:
        return argmax(logits)
    return refmath.gumbel_sample(logits, temperature, generator, argmax=argmax)


def warmup_cases(device, d: dict, dtype):
    """Greedy rows of fp32 logits (the head's output) and of the activation dtype: one variant each
    (the vocabulary, row stride and slice width are not specialised on)."""
    for dt in {torch.float32, dtype}:
        yield _warmup.Launch("sample", sample, (torch.zeros(1, 1000, dtype=dt, device=device), 0.0, None))


FAMILY = KernelFamily(
    "sample", ops={"sample": sample}, tiles=TILES,
    tile_checks={"argmax.BLOCK": POW2, "argmax.waves": COUNT0, "argmax.in_kernel": Tile(kind=bool)},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="greedy sampling: each row's argmax split over many programs, merged in the launch")
