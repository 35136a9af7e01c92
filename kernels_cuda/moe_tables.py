"""The routing tables of ``moe_experts`` (:mod:`.moe`): the (token, slot) pairs sorted by expert and a
table of row tiles, each inside one expert.

Outputs (device tensors, sizes fixed by the shapes, no host sync: a CUDA graph can hold them):
``tok`` / ``rw`` token and routing weight of each sorted pair; ``pos`` sorted position of pair
``t * k + s``; ``tile_e`` / ``tile_row`` / ``row_end`` expert, first row and end row of each of
``min(pairs, cdiv(pairs, block_m) + E)`` tiles (``tile_e == E``: an unused tile).

Up to ``tiles.moe.route.max_pairs`` pairs (decode, short prefill chunks) one program builds them
all: a stable sort of ``expert * PB + pair`` keys, per-expert counts by histogram, prefix sums, and
each tile's expert as the number of experts whose tiles end at or before it. That is one launch
where the torch formulation (:func:`route_tables_torch`) is two dozen: at decode every launch costs
more than its work, inside a CUDA graph too (docs/performance.md).

Past the limit (one program's sort of many thousand keys is slow to compile), with
``route.large`` on: one stable ``torch.sort`` of the experts (its permutation is the one-program
kernel's and the torch formulation's), ``_route_pairs_kernel`` over the sorted positions (``tok``, ``rw``, ``pos``), and
one ``_route_tiles_kernel`` program: each expert's end in the sorted experts by binary search, then
the tile table as above, ``TILE_BLOCK`` tiles at a time. Three launches (one more for each cast:
indices not int32, weights not fp32); off, the torch formulation serves.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.kernels_cuda.launch import cdiv, next_pow2
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

# defaults of tiles.moe.route (moe.TILES); large: past max_pairs sort + two kernels, else torch
ROUTE = dict(max_pairs=4096, num_warps=4, large=True)
PAIRS_BLOCK, TILE_BLOCK = 1024, 1024  # sorted positions per _route_pairs_kernel program; tiles per step


@triton.jit
def _route_kernel(idx_ptr, w_ptr, tok_ptr, rw_ptr, pos_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr,
                  P, K, E, T, BLOCK_M: tl.constexpr, PB: tl.constexpr, EB: tl.constexpr, TB: tl.constexpr):
    wait_inputs()
    i = tl.arange(0, PB)
    valid = i < P
    e = tl.load(idx_ptr + i, mask=valid, other=0)
    key = tl.where(valid, e, E) * PB + i  # unique; pairs of one expert stay in pair order (stable)
    order = tl.sort(key) % PB  # the pair at each sorted position
    tl.store(tok_ptr + i, order // K, mask=valid)
    tl.store(rw_ptr + i, tl.load(w_ptr + order, mask=valid, other=0.0), mask=valid)
    tl.store(pos_ptr + order, i, mask=valid)
    counts = tl.histogram(e, EB, mask=valid)  # pairs per expert
    ends = tl.cumsum(counts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    x = tl.arange(0, EB)
    # tile t's expert: how many experts' tiles end at or before t (searchsorted(tile_ends, t, right))
    t = tl.arange(0, TB)
    tile_e = tl.cumsum(tl.histogram(tile_ends, TB, mask=(x < E) & (tile_ends < TB)), 0)
    ec = tl.minimum(tile_e, E - 1)
    first = ends - counts - (tile_ends - tiles) * BLOCK_M  # row of an expert's tile 0 minus its tile 0 * BLOCK_M
    tl.store(tile_e_ptr + t, tile_e, mask=t < T)
    tl.store(tile_row_ptr + t, tl.gather(first, ec, 0) + t * BLOCK_M, mask=t < T)
    tl.store(row_end_ptr + t, tl.gather(ends, ec, 0), mask=t < T)


# The pair and tile counts follow the prefill chunk's tokens: not specialised on (== 1, % 16 == 0),
# so the sorted path is one variant per model (expert count) and tile height, warmed once.
@triton.jit(do_not_specialize=("P",))
def _route_pairs_kernel(order_ptr, w_ptr, tok_ptr, rw_ptr, pos_ptr, P, K, BLOCK: tl.constexpr):
    """Sorted positions ``i`` of this program: the pair ``order[i]``'s token, weight and position."""
    wait_inputs()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = i < P
    order = tl.load(order_ptr + i, mask=valid, other=0).to(tl.int32)  # int64 from torch.sort; pairs < 2**31
    tl.store(tok_ptr + i, order // K, mask=valid)
    tl.store(rw_ptr + i, tl.load(w_ptr + order, mask=valid, other=0.0), mask=valid)
    tl.store(pos_ptr + order, i, mask=valid)


@triton.jit
def _count_below(sorted_ptr, P, steps, x):
    """Per lane: how many of the ``P`` sorted values are below ``x`` (a lower bound in ``steps`` =
    bit length of P halvings)."""
    lo = tl.zeros(x.shape, tl.int32)
    hi = tl.zeros(x.shape, tl.int32) + P
    for _ in range(steps):
        open_ = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(sorted_ptr + mid, mask=open_, other=0) < x
        lo = tl.where(open_ & below, mid + 1, lo)
        hi = tl.where(open_ & ~below, mid, hi)
    return lo


@triton.jit(do_not_specialize=("P", "T", "steps"))
def _route_tiles_kernel(sorted_ptr, tile_e_ptr, tile_row_ptr, row_end_ptr, P, E, T, steps,
                        BLOCK_M: tl.constexpr, EB: tl.constexpr, TB: tl.constexpr):
    """The tile table (as ``_route_kernel``) from the ``P`` experts sorted, ``TB`` tiles per step."""
    wait_inputs()
    x = tl.arange(0, EB)
    ends = _count_below(sorted_ptr, P, steps, x + 1)  # pairs of experts <= x
    counts = ends - tl.where(x > 0, tl.gather(ends, tl.maximum(x - 1, 0), 0), 0)  # one search, not two
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    first = ends - counts - (tile_ends - tiles) * BLOCK_M
    live = x < E
    for t0 in range(0, T, TB):
        t = t0 + tl.arange(0, TB)
        rel = tile_ends - t0  # experts whose tiles end before t0 count for every tile of the step
        before = tl.sum((live & (rel <= 0)).to(tl.int32), 0)
        inside = live & (rel > 0) & (rel < TB)
        tile_e = before + tl.cumsum(tl.histogram(tl.where(inside, rel, 0), TB, mask=inside), 0)
        ec = tl.minimum(tile_e, E - 1)
        tl.store(tile_e_ptr + t, tile_e, mask=t < T)
        tl.store(tile_row_ptr + t, tl.gather(first, ec, 0) + t * BLOCK_M, mask=t < T)
        tl.store(row_end_ptr + t, tl.gather(ends, ec, 0), mask=t < T)


def n_tiles(pairs: int, n_experts: int, block_m: int) -> int:
    """Tiles in the table: enough for any routing of ``pairs`` pairs (each tile holds >= 1 pair)."""
    return min(pairs, cdiv(pairs, block_m) + n_experts)


def route_tables(indices: torch.Tensor, weights: torch.Tensor, n_experts: int, block_m: int,
                 tile: dict | None = None) -> dict:
    """Sorted pairs and row tiles (module docstring) of ``indices`` [N, k] int32 experts and
    ``weights`` [N, k] routing weights; ``tile``: ``tiles.moe.route`` of the profile (``ROUTE``)."""
    n, k = indices.shape
    pairs = n * k
    t = {**ROUTE, **(tile or {})}
    if pairs == 0 or (pairs > t["max_pairs"] and not t["large"]):
        return route_tables_torch(indices, weights, n_experts, block_m)
    T = n_tiles(pairs, n_experts, block_m)
    out = _empty_tables(pairs, T, indices.device)
    idx = indices.reshape(-1)
    idx = idx if idx.dtype == torch.int32 and idx.is_contiguous() else idx.to(torch.int32).contiguous()
    w = weights.reshape(-1).to(torch.float32).contiguous()
    EB = max(16, next_pow2(n_experts))
    if pairs > t["max_pairs"]:
        experts, order = torch.sort(idx, stable=True)  # pairs of one expert stay in pair order
        _route_pairs_kernel[(cdiv(pairs, PAIRS_BLOCK),)](order, w, out["tok"], out["rw"], out["pos"], pairs, k,
                                                         BLOCK=PAIRS_BLOCK, num_warps=t["num_warps"],
                                                         **pdl.options(order.device))
        _route_tiles_kernel[(1,)](experts, out["tile_e"], out["tile_row"], out["row_end"], pairs, n_experts, T,
                                  pairs.bit_length(), BLOCK_M=block_m, EB=EB, TB=TILE_BLOCK,
                                  num_warps=t["num_warps"], **pdl.options(experts.device))
        return out
    _route_kernel[(1,)](idx, w, out["tok"], out["rw"], out["pos"], out["tile_e"], out["tile_row"], out["row_end"],
                        pairs, k, n_experts, T, BLOCK_M=block_m, PB=max(16, next_pow2(pairs)),
                        EB=EB, TB=max(16, next_pow2(T)), num_warps=t["num_warps"], **pdl.options(idx.device))
    return out


def _empty_tables(pairs: int, T: int, dev) -> dict:
    """The six tables, unwritten: ``tok``, ``pos`` and the tile tables int32, ``rw`` fp32."""
    i32 = torch.int32
    return dict(tok=torch.empty(pairs, dtype=i32, device=dev), rw=torch.empty(pairs, dtype=torch.float32, device=dev),
                pos=torch.empty(pairs, dtype=i32, device=dev), tile_e=torch.empty(T, dtype=i32, device=dev),
                tile_row=torch.empty(T, dtype=i32, device=dev), row_end=torch.empty(T, dtype=i32, device=dev))


def route_tables_torch(indices: torch.Tensor, weights: torch.Tensor, n_experts: int, block_m: int) -> dict:
    """The same tables from torch operations (any size; about two dozen launches)."""
    n, k = indices.shape
    pairs = n * k
    flat = indices.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts, 0)
    tiles = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    t = torch.arange(n_tiles(pairs, n_experts, block_m), device=flat.device)
    tile_e = torch.searchsorted(tile_ends, t, right=True)
    e = tile_e.clamp_max(n_experts - 1)
    tile_row = ends[e] - counts[e] + (t - tile_ends[e] + tiles[e]) * block_m
    pos = torch.empty_like(order)
    pos[order] = torch.arange(pairs, device=flat.device)
    return dict(tok=(order // k).to(torch.int32), rw=weights.reshape(-1).to(torch.float32)[order].contiguous(),
                pos=pos.to(torch.int32), tile_e=tile_e.to(torch.int32), tile_row=tile_row.to(torch.int32),
                row_end=ends[e].to(torch.int32))
