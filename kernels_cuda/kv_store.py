"""``store_paged`` (paged KV store): a decode step's new KV rows written into a paged pool in one
launch, the block-table lookup included; ``resolve_paged``: the pool rows of picked logical
entries (the lookup before a paged attention read) in one launch; ``store_rows``: a window ring's
new tokens at (row, slot) pairs in one launch (``_store_rows_kernel``, the same byte copy; a pair
the op's ``keep`` leaves out gets slot -1 from the launcher, which the kernel skips).

``_store_paged_kernel``: one program per ``BLOCK`` pairs of the flat ``[B * n]`` pairs. For pair
``i`` of row ``b`` with entry ``e = max(entry[b, j], 0)``: pool page ``page = table[b, min(e // P,
W - 1)]``; when ``mask`` holds and ``page >= 0`` the pair's stored bytes (data and scale, as 32-bit
words when they divide) go to pool row ``page * P + e % P``, otherwise to ``trash_row``. Nothing
is data-dependent in the launch (grid from the shapes only) and nothing syncs with the host, so a
CUDA graph may hold it. ``store_paged.in_kernel`` off: the plain-torch lookup and byte scatter of
the reference (about a dozen launches).

``_resolve_paged_kernel``: one program per ``BLOCK`` picks; pick ``e`` of row ``b`` maps to
``offset + table[b, min(max(e, 0) // P, W - 1)] * P + e % P``, or ``-1`` where ``e < 0`` or the page is
``< 0`` (``resolve_paged.in_kernel`` off: about a dozen torch launches).

``_store_paged_two_kernel``: two stores at the same entries (``store_paged_many``: a compressed
entry's main KV and its index key), the grid's second axis picking the store.

``_window_indices_kernel``: one program per ``BLOCK`` elements of the flat ``[L, B, S, W]`` output:
every ring layer's window indices of a call in one launch (``window_indices.in_kernel`` off: the
reference's dozen torch launches).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt import profiles, refmath
from flashrt.dtypes import MAIN_KV_FORMAT
from flashrt.families import KernelFamily
from flashrt.kv.util import empty_qtensor
from flashrt.tile_checks import POW2, Tile
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.kv_gather import byte_rows
from flashrt.kernels_cuda.launch import PlanCache, cdiv, dense, next_pow2
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

TILES = {"store_paged": {"in_kernel": True, "BLOCK": 16, "num_warps": 4},  # in_kernel False: plain torch
         "store_rows": {"in_kernel": True, "BLOCK": 16, "num_warps": 4},
         "resolve_paged": {"in_kernel": True, "BLOCK": 1024, "num_warps": 4},
         "window_indices": {"in_kernel": True, "BLOCK": 1024, "num_warps": 4}}
PLANS = PlanCache("kv_store", TILES)
_tiles = PLANS.tiles


@triton.jit
def _copy_rows(val_ptr, vscale_ptr, out_ptr, oscale_ptr, src, dst, ok, ROW: tl.constexpr, SROW: tl.constexpr,
               BR: tl.constexpr, BS: tl.constexpr):
    """Byte rows ``src`` of the values and their scale rows to rows ``dst`` of the output (where ``ok``)."""
    c = tl.arange(0, BR)
    m = ok[:, None] & (c < ROW)[None, :]
    tl.store(out_ptr + dst[:, None] * ROW + c[None, :], tl.load(val_ptr + src[:, None] * ROW + c[None, :], mask=m),
             mask=m)
    c = tl.arange(0, BS)
    m = ok[:, None] & (c < SROW)[None, :]
    tl.store(oscale_ptr + dst[:, None] * SROW + c[None, :], tl.load(vscale_ptr + src[:, None] * SROW + c[None, :], mask=m),
             mask=m)


# counts and sizes, not specialised: their == 1 / % 16 classes follow the load, a compile mid-serving each
@triton.jit(do_not_specialize=["total", "W", "trash"])
def _store_paged_kernel(val_ptr, vscale_ptr, pool_ptr, pscale_ptr, table_ptr, entry_ptr, mask_ptr, total, n, W, P,
                        trash, ROW: tl.constexpr, SROW: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr,
                        BS: tl.constexpr):
    wait_inputs()
    _store_paged_block(val_ptr, vscale_ptr, pool_ptr, pscale_ptr, table_ptr, entry_ptr, mask_ptr, total, n, W, P,
                       trash, ROW, SROW, BLOCK, BR, BS)


@triton.jit(do_not_specialize=["total", "W0", "trash0", "W1", "trash1"])
def _store_paged_two_kernel(val0, vscale0, pool0, pscale0, table0, W0, P0, trash0,
                            val1, vscale1, pool1, pscale1, table1, W1, P1, trash1, entry_ptr, mask_ptr, total, n,
                            ROW0: tl.constexpr, SROW0: tl.constexpr, BR0: tl.constexpr, BS0: tl.constexpr,
                            ROW1: tl.constexpr, SROW1: tl.constexpr, BR1: tl.constexpr, BS1: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Two stores at the same entries: axis 1 of the grid picks the store."""
    wait_inputs()
    if tl.program_id(1) == 0:
        _store_paged_block(val0, vscale0, pool0, pscale0, table0, entry_ptr, mask_ptr, total, n, W0, P0, trash0,
                           ROW0, SROW0, BLOCK, BR0, BS0)
    else:
        _store_paged_block(val1, vscale1, pool1, pscale1, table1, entry_ptr, mask_ptr, total, n, W1, P1, trash1,
                           ROW1, SROW1, BLOCK, BR1, BS1)


@triton.jit
def _store_paged_block(val_ptr, vscale_ptr, pool_ptr, pscale_ptr, table_ptr, entry_ptr, mask_ptr, total, n, W, P,
                       trash, ROW: tl.constexpr, SROW: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr,
                       BS: tl.constexpr):
    """Pairs ``[pid * BLOCK, (pid + 1) * BLOCK)`` of one store (``_store_paged_kernel``)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    e = tl.maximum(tl.load(entry_ptr + i, mask=ok, other=0).to(tl.int64), 0)
    page = tl.load(table_ptr + (i // n).to(tl.int64) * W + tl.minimum(e // P, W - 1), mask=ok, other=-1).to(tl.int64)
    keep = tl.load(mask_ptr + i, mask=ok, other=0) != 0
    dst = tl.where(keep & (page >= 0), page * P + e % P, trash)
    src = i.to(tl.int64)
    _copy_rows(val_ptr, vscale_ptr, pool_ptr, pscale_ptr, src, dst, ok, ROW, SROW, BR, BS)


@triton.jit
def _store_rows_kernel(val_ptr, vscale_ptr, dst_ptr, dscale_ptr, batch_ptr, slot_ptr, total, S, ROW: tl.constexpr,
                       SROW: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr):
    wait_inputs()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + i, mask=i < total, other=-1)
    ok = (i < total) & (slot >= 0)  # a negative slot: a pair not kept (store_rows' keep), not written
    dst = tl.load(batch_ptr + i, mask=ok, other=0) * S + slot
    src = i.to(tl.int64)
    _copy_rows(val_ptr, vscale_ptr, dst_ptr, dscale_ptr, src, dst, ok, ROW, SROW, BR, BS)


# the pick counts grow with the context in decode: not specialised, so no variant compiles mid-run
@triton.jit(do_not_specialize=("total", "N"))
def _resolve_paged_kernel(pick_ptr, table_ptr, out_ptr, total, N, W, P, offset, BLOCK: tl.constexpr):
    wait_inputs()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    e = tl.load(pick_ptr + i, mask=ok, other=-1).to(tl.int64)
    ec = tl.maximum(e, 0)
    page = tl.load(table_ptr + (i // N).to(tl.int64) * W + tl.minimum(ec // P, W - 1), mask=ok, other=-1).to(tl.int64)
    tl.store(out_ptr + i, tl.where((e >= 0) & (page >= 0), offset + page * P + ec % P, -1).to(tl.int32), mask=ok)


# the batch and the chunk length vary with the load, the ring layers and the window with the model
@triton.jit(do_not_specialize=("total", "B", "S", "W"))
def _window_indices_kernel(pos_ptr, start_ptr, out_ptr, total, B, S, W, BLOCK: tl.constexpr):
    wait_inputs()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    i64 = i.to(tl.int64)
    w = i64 % W
    s = (i64 // W) % S
    lb = i64 // (W * S)  # l * B + b
    b = lb % B
    first = tl.load(pos_ptr + b * S, mask=ok, other=0)
    p = tl.load(pos_ptr + b * S + s, mask=ok, other=0) - w
    ring_start = tl.load(start_ptr + lb, mask=ok, other=0)
    in_chunk = p >= first
    slot = tl.where(in_chunk, W + p - first, p % W)
    keep = in_chunk | ((p >= 0) & (p >= ring_start))
    tl.store(out_ptr + i64, tl.where(keep, slot, -1).to(tl.int32), mask=ok)


def _flat(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 4 == 0


def store_paged(pool, table, entry, mask, values, page_entries: int, trash_row: int):
    """``flashrt.ops.store_paged`` in one launch; a pool that is not contiguous, the switch
    ``store_paged.in_kernel`` off, or an empty store take the plain-torch path."""
    t = _tiles()["store_paged"]
    B, n = entry.shape
    total = B * n
    if not (t["in_kernel"] and total and _flat(pool.data) and _flat(pool.scale)):
        return refmath.store_paged(pool, table, entry, mask, values, page_entries, trash_row)
    pdata, pscale = byte_rows(pool.data), byte_rows(pool.scale)
    vdata, vscale = byte_rows(dense(values.data)), byte_rows(dense(values.scale))  # one format: the same row widths
    _store_paged_kernel[(cdiv(total, t["BLOCK"]),)](
        vdata, vscale, pdata, pscale, dense(table), dense(entry), dense(mask).view(torch.uint8), total, n,
        table.shape[1], page_entries, trash_row, ROW=pdata.shape[1], SROW=pscale.shape[1], BLOCK=t["BLOCK"],
        BR=next_pow2(pdata.shape[1]), BS=next_pow2(pscale.shape[1]), num_warps=t["num_warps"],
        **pdl.options(vdata.device))
    return pool


def store_paged_many(stores, entry, mask):
    """``flashrt.ops.store_paged_many``: two stores a launch (a compressed entry's main KV and
    index key in one); the switch ``store_paged.in_kernel`` off, a pool that is not contiguous or
    an empty store take the plain-torch path."""
    t = _tiles()["store_paged"]
    B, n = entry.shape
    flat = all(_flat(s[0].data) and _flat(s[0].scale) for s in stores)
    if not (t["in_kernel"] and B * n and flat):
        return refmath.store_paged_many(stores, entry, mask)
    for k in range(0, len(stores) - 1, 2):
        _store_two(stores[k], stores[k + 1], dense(entry), dense(mask).view(torch.uint8), t)
    if len(stores) % 2:
        pool, table, values, P, trash = stores[-1]
        store_paged(pool, table, entry, mask, values, P, trash)
    return tuple(s[0] for s in stores)


def _store_two(a, b, entry, mask, t):
    args, rows = [], {}
    for i, (pool, table, values, P, trash) in enumerate((a, b)):
        pdata, pscale = byte_rows(pool.data), byte_rows(pool.scale)
        args += [byte_rows(dense(values.data)), byte_rows(dense(values.scale)), pdata, pscale, dense(table),
                 table.shape[1], P, trash]
        rows.update({f"ROW{i}": pdata.shape[1], f"SROW{i}": pscale.shape[1], f"BR{i}": next_pow2(pdata.shape[1]),
                     f"BS{i}": next_pow2(pscale.shape[1])})
    total = entry.numel()
    _store_paged_two_kernel[(cdiv(total, t["BLOCK"]), 2)](*args, entry, mask, total, entry.shape[1], **rows,
                                                          BLOCK=t["BLOCK"], num_warps=t["num_warps"],
                                                          **pdl.options(entry.device))


def store_rows(dst, batch, slot, src, keep=None):
    """``flashrt.ops.store_rows`` in one launch (with ``keep``, one more: the pairs not kept get slot
    -1, which the kernel skips); a ``dst`` that is not contiguous, the switch ``store_rows.in_kernel``
    off, or no rows take the plain-torch path."""
    t, n = _tiles()["store_rows"], batch.shape[0]
    if not (t["in_kernel"] and n and _flat(dst.data) and _flat(dst.scale)):
        return refmath.store_rows(dst, batch, slot, src, keep)
    if keep is not None:
        slot = torch.where(keep, slot, -1)
    ddata, dscale = byte_rows(dst.data), byte_rows(dst.scale)
    vdata, vscale = byte_rows(dense(src.data)), byte_rows(dense(src.scale))
    _store_rows_kernel[(cdiv(n, t["BLOCK"]),)](
        vdata, vscale, ddata, dscale, dense(batch), dense(slot), n, dst.shape[1], ROW=ddata.shape[1],
        SROW=dscale.shape[1], BLOCK=t["BLOCK"], BR=next_pow2(ddata.shape[1]), BS=next_pow2(dscale.shape[1]),
        num_warps=t["num_warps"], **pdl.options(vdata.device))
    return dst


def resolve_paged(table, picks, page_entries: int, offset: int = 0):
    """``flashrt.ops.resolve_paged`` in one launch (the switch ``resolve_paged.in_kernel`` off: plain torch)."""
    t = _tiles()["resolve_paged"]
    if not t["in_kernel"]:
        return refmath.resolve_paged(table, picks, page_entries, offset)
    B, N = picks.shape
    out = torch.empty(B, N, dtype=torch.int32, device=picks.device)
    if out.numel():
        _resolve_paged_kernel[(cdiv(B * N, t["BLOCK"]),)](dense(picks), dense(table), out, B * N, N, table.shape[1],
                                                          page_entries, offset, BLOCK=t["BLOCK"],
                                                          num_warps=t["num_warps"], **pdl.options(picks.device))
    return out


def window_indices(positions, ring_start, window: int):
    """``flashrt.ops.window_indices`` in one launch (the switch ``window_indices.in_kernel`` off: plain torch)."""
    t = _tiles()["window_indices"]
    if not t["in_kernel"]:
        return refmath.window_indices(positions, ring_start, window)
    (B, S), L = positions.shape, ring_start.shape[0]
    out = torch.empty(L, B, S, window, dtype=torch.int32, device=positions.device)
    if out.numel():
        _window_indices_kernel[(cdiv(out.numel(), t["BLOCK"]),)](dense(positions), dense(ring_start), out, out.numel(),
                                                                 B, S, window, BLOCK=t["BLOCK"],
                                                                 num_warps=t["num_warps"],
                                                                 **pdl.options(positions.device))
    return out


def warmup_cases(device, d: dict, dtype):
    """A decode step's stores and lookup at 1 and 8 rows: one new main-KV entry each into a small
    paged pool, the pool rows of ``index_topk`` picks, one new token each into the window ring."""
    P, D = profiles.active_profile().hkcp_page_entries, d["head_dim"]
    pool = empty_qtensor(MAIN_KV_FORMAT, (1, 4 * P, D), device)
    for B in (1, 8):
        vals = empty_qtensor(MAIN_KV_FORMAT, (B, 1, D), device)
        table = torch.zeros(B, 4, dtype=torch.long, device=device)
        entry = torch.zeros(B, 1, dtype=torch.long, device=device)
        mask = torch.ones(B, 1, dtype=torch.bool, device=device)
        yield _warmup.Launch("store_paged", store_paged, (pool, table, entry, mask, vals, P, 0))
        keys = empty_qtensor("fp4_b32", (1, 4 * P, d["index_head_dim"]), device)
        key_vals = empty_qtensor("fp4_b32", (B, 1, d["index_head_dim"]), device)
        stores = ((pool, table, vals, P, 0), (keys, table, key_vals, P, 0))
        yield _warmup.Launch("store_paged_many", store_paged_many, (stores, entry, mask))
        picks = torch.full((B, d["index_topk"]), -1, dtype=torch.int32, device=device)
        yield _warmup.Launch("resolve_paged", resolve_paged, (table, picks, P))
        ring = empty_qtensor(profiles.active_profile().kv_window_dtype, (B, d["window_size"], D), device)
        rows = torch.arange(B, device=device)
        yield _warmup.Launch("store_rows", store_rows, (ring, rows, rows, empty_qtensor(ring.fmt, (B, D), device)))
        starts = torch.zeros(3, B, dtype=torch.long, device=device)  # ring layers: not specialised
        yield _warmup.Launch("window_indices", window_indices, (rows.view(B, 1), starts, d["window_size"]))


FAMILY = KernelFamily(
    "kv_store", ops={"store_paged": store_paged, "store_paged_many": store_paged_many, "store_rows": store_rows,
                     "resolve_paged": resolve_paged, "window_indices": window_indices},
    tiles=TILES,
    tile_checks={"*.in_kernel": Tile(kind=bool), "*.BLOCK": POW2},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="KV stores (paged and ring rows), the page lookup of picked rows and the window indices, "
                "each in one launch")
