"""KV-cache ops of the contract (:mod:`flashrt.ops`): the HKCP cold fetch, window-ring row stores,
the block-table lookup and scatter of a paged pool, and every ring layer's window indices of a
chunk, each with no host sync."""
from __future__ import annotations

import torch

from . import checks as c
from .checks import I32, KV_FORMATS
from .dispatch import impl as _impl
from .formats import QTensor


def gather_cold_rows(host: QTensor, host_ids, picks, index, offset: int):
    """HKCP cold fetch: the picked KV entries that live on host pages, staged on the compute device.

    ``host`` ``QTensor`` ``[pages, P, D]`` in a KV format (the host pages), ``host_ids`` int64
    ``[B, W]`` in ``[-1, pages)`` (host page of each logical page of each row, ``-1`` where the
    page is not on the host), ``picks`` int32 or int64 ``[B, N]`` logical entries in
    ``[-1, W * P)`` (``-1`` empty), ``index`` int32 ``[B, N]``, ``offset`` int >= 0 ->
    ``(staging, index)``: ``QTensor`` ``[1, B * N, D]`` in ``host``'s format and int32 ``[B, N]``.

    Pick ``i = b * N + j`` with entry ``e = picks[b, j]`` is cold when ``e >= 0`` and
    ``hp = host_ids[b, e // P] >= 0``: staging row ``i`` holds the stored bytes of host entry
    ``host[hp, e % P]`` (data and scale, exactly) and the output index is ``offset + i``. Every
    other pick keeps ``index[b, j]`` and its staging row is zero bytes.

    The compute device is that of ``picks`` (``host_ids`` and ``index`` live there too); the
    outputs live there. ``host`` lives on the CPU, page-locked (pinned) when the compute device is
    an accelerator, or on the compute device. A backend that reads pinned host memory in place,
    with no host synchronisation, declares the op zero-copy (``flashrt.dispatch.zero_copy``): a
    CUDA-graph step may then contain the call.
    """
    env: dict = {}
    if not isinstance(host, QTensor):
        raise ValueError(f"host: expected a QTensor in {list(KV_FORMATS)}, got {type(host).__name__}")
    c.maybe_quantized("host", host, "pages P D", env, KV_FORMATS)
    c.tensor("picks", picks, "B N", env, (torch.int32, torch.int64))
    device = picks.device
    c.tensor("host_ids", host_ids, "B W", env, (torch.int64,), device)
    c.tensor("index", index, "B N", env, I32, device)
    c.integer("offset", offset, 0)
    c.host_memory("host", host, device)
    c.index_range("host_ids", host_ids, -1, env["pages"])
    c.index_range("picks", picks, -1, env["W"] * env["P"])
    return _impl("gather_cold_rows", device)(host, host_ids, picks, index, offset)


def store_rows(dst: QTensor, batch, slot, src: QTensor, keep=None) -> QTensor:
    """Store KV rows at (row, slot) pairs, in place (a window ring's new tokens), with no host sync.

    ``dst`` ``QTensor`` ``[Bd, S, D]`` in a KV format, ``batch`` int64 ``[n]`` in ``[0, Bd)``,
    ``slot`` int64 ``[n]`` in ``[0, S)``, ``src`` ``QTensor`` ``[n, D]`` in ``dst``'s format,
    ``keep`` None or bool ``[n]`` -> ``dst``: ``dst[batch[i], slot[i]]`` takes the stored bytes of
    ``src[i]`` (data and scale, exactly) where ``keep[i]`` (every pair without ``keep``); the rows
    of the other pairs are left as they are. Two pairs must not name the same row.
    """
    env: dict = {}
    for name, q in (("dst", dst), ("src", src)):
        if not isinstance(q, QTensor):
            raise ValueError(f"{name}: expected a QTensor in {list(KV_FORMATS)}, got {type(q).__name__}")
    c.maybe_quantized("dst", dst, "Bd S D", env, KV_FORMATS)
    c.tensor("batch", batch, "n", env, (torch.int64,), dst.device)
    c.tensor("slot", slot, "n", env, (torch.int64,), dst.device)
    c.maybe_quantized("src", src, "n D", env, (dst.fmt,), dst.device)
    if keep is not None:
        c.tensor("keep", keep, "n", env, (torch.bool,), dst.device)
    c.index_range("batch", batch, 0, env["Bd"])
    c.index_range("slot", slot, 0, env["S"])
    return _impl("store_rows", dst.device)(dst, batch, slot, src, keep)


def resolve_paged(table, picks, page_entries: int, offset: int = 0) -> torch.Tensor:
    """Pool rows of logical KV entries through a block table (the page lookup before a paged
    attention read), with no host sync.

    ``table`` int32 or int64 ``[B, W]`` (the pool page of each logical page of each row, ``< 0``
    where none), ``picks`` int32 or int64 ``[B, N]`` logical entries in ``[-1, W * P)`` (``-1``
    empty), ``page_entries`` P >= 1, ``offset`` >= 0 (where the pool's rows start among the
    attention's KV rows) -> int32 ``[B, N]``: for ``e = picks[b, j]`` and ``page = table[b,
    min(max(e, 0) // P, W - 1)]``, ``offset + page * P + e % P`` where ``e >= 0`` and
    ``page >= 0``, else ``-1``. Rows must fit in int32 (``offset + page * P + P <= 2**31``).
    """
    env: dict = {}
    c.tensor("picks", picks, "B N", env, (torch.int32, torch.int64))
    c.tensor("table", table, "B W", env, (torch.int32, torch.int64), picks.device)
    c.integer("page_entries", page_entries, 1)
    c.integer("offset", offset, 0, 2 ** 31 - 1)
    c.index_range("picks", picks, -1, env["W"] * page_entries)
    c.index_range("table", table, -(2 ** 31), (2 ** 31 - offset) // page_entries)
    return _impl("resolve_paged", picks.device)(table, picks, page_entries, offset)


def store_paged(pool: QTensor, table, entry, mask, values: QTensor, page_entries: int, trash_row: int) -> QTensor:
    """Store KV rows into a paged pool, in place: the block-table lookup and the scatter of a
    decode step's new entries, with no host sync (a CUDA-graph step may hold the call).

    ``pool`` ``QTensor`` ``[1, R, D]`` in a KV format (pages of ``page_entries`` rows, one after
    another), ``table`` int32 or int64 ``[B, W]`` (the pool page of each logical page of each row,
    ``< 0`` where none), ``entry`` int32 or int64 ``[B, n]`` logical entries in ``[-1, W * P)``,
    ``mask`` bool ``[B, n]``, ``values`` ``QTensor`` ``[B, n, D]`` in ``pool``'s format,
    ``page_entries`` P >= 1 with ``R % P == 0``, ``trash_row`` in ``[0, R)`` -> ``pool``.

    Pair ``(b, j)`` with ``e = max(entry[b, j], 0)`` and ``page = table[b, min(e // P, W - 1)]``
    is stored when ``mask[b, j]`` and ``page >= 0``: pool row ``page * P + e % P`` takes the stored
    bytes of ``values[b, j]`` (data and scale, exactly). Every other pair is written to
    ``trash_row``, whose content afterwards is one of theirs (which one is unspecified). Two
    stored pairs must not share a pool row.
    """
    _check_store("", pool, table, entry, mask, values, page_entries, trash_row)
    return _impl("store_paged", pool.device)(pool, table, entry, mask, values, page_entries, trash_row)


def store_paged_many(stores, entry, mask) -> tuple:
    """Several :func:`store_paged` at the same entries in one call: ``stores`` a non-empty tuple of
    ``(pool, table, values, page_entries, trash_row)``, each stored as ``store_paged(pool, table,
    entry, mask, values, page_entries, trash_row)`` -> the tuple of pools. A compressed entry's main
    KV and its index key (two pools, formats and block tables) in one launch."""
    if not isinstance(stores, (tuple, list)) or not stores:
        raise ValueError(f"stores: expected a non-empty tuple of (pool, table, values, page_entries, trash_row), "
                         f"got {type(stores).__name__} {stores!r:.60}")
    for i, store in enumerate(stores):
        if not isinstance(store, (tuple, list)) or len(store) != 5:
            raise ValueError(f"stores[{i}]: expected (pool, table, values, page_entries, trash_row), got "
                             f"{type(store).__name__} of {len(store) if isinstance(store, (tuple, list)) else 1}")
        pool, table, values, page_entries, trash_row = store
        _check_store(f"stores[{i}].", pool, table, entry, mask, values, page_entries, trash_row)
        if pool.device != stores[0][0].device:
            raise ValueError(f"stores[{i}].pool: expected a tensor on {stores[0][0].device}, got {pool.device}")
    return _impl("store_paged_many", entry.device)(tuple(map(tuple, stores)), entry, mask)


def _check_store(at: str, pool, table, entry, mask, values, page_entries, trash_row) -> None:
    """The checks of one ``store_paged``; ``at`` prefixes the argument names of a store in a tuple."""
    env: dict = {}
    for name, q in (("pool", pool), ("values", values)):
        if not isinstance(q, QTensor):
            raise ValueError(f"{at}{name}: expected a QTensor in {list(KV_FORMATS)}, got {type(q).__name__}")
    c.maybe_quantized(at + "pool", pool, "one R D", env, KV_FORMATS)
    device = pool.device
    if env["one"] != 1:
        raise ValueError(f"{at}pool: expected shape [1, R, D], got {list(pool.shape)}")
    c.tensor(at + "table", table, "B W", env, (torch.int32, torch.int64), device)
    c.tensor("entry", entry, "B n", env, (torch.int32, torch.int64), device)
    c.tensor("mask", mask, "B n", env, (torch.bool,), device)
    c.maybe_quantized(at + "values", values, "B n D", env, (pool.fmt,), device)
    c.integer(at + "page_entries", page_entries, 1)
    if env["R"] % page_entries:
        raise ValueError(f"{at}page_entries: expected a divisor of the pool's {env['R']} rows, got {page_entries}")
    c.integer(at + "trash_row", trash_row, 0, env["R"] - 1)
    c.index_range("entry", entry, -1, env["W"] * page_entries)
    c.index_range(at + "table", table, -(2 ** 31), env["R"] // page_entries)


def window_indices(positions, ring_start, window: int) -> torch.Tensor:
    """Every ring layer's sliding-window indices of a chunk, with no host sync: int32 ``[L, B, S, W]``
    into ``[ring (W slots) ‖ chunk (S rows)]`` of the ``W`` most recent positions of each query.

    ``positions`` int64 ``[B, S]`` >= 0, each row consecutive from ``positions[b, 0]`` (the chunk
    start); ``ring_start`` int64 ``[L, B]`` (positions below it are not in layer ``l``'s ring);
    ``window`` W >= 1. With ``p = positions[b, s] - w``: ``W + p - positions[b, 0]`` when ``p`` is
    in the chunk, else ring slot ``p % W`` when ``p >= 0`` and ``p >= ring_start[l, b]``, else ``-1``.
    """
    env: dict = {}
    c.tensor("positions", positions, "B S", env, (torch.int64,))
    c.tensor("ring_start", ring_start, "L B", env, (torch.int64,), positions.device)
    c.integer("window", window, 1, 2 ** 31 - 1 - env["S"])
    c.index_range("positions", positions, 0, 2 ** 62)
    return _impl("window_indices", positions.device)(positions, ring_start, window)
