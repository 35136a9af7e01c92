"""Small helpers for the KV caches: zero-filled QTensors and byte-level row writes."""
from __future__ import annotations

import torch

from flashrt import checks, ops
from flashrt.formats import QTensor, expected_layout, spec


def empty_qtensor(fmt: str, shape, device) -> QTensor:
    """A zero-filled QTensor of logical ``shape`` (scales zero too: unwritten entries read as 0)."""
    data_shape, scale_shape = expected_layout(fmt, shape)
    s = spec(fmt)
    return QTensor(_zero_bits(data_shape, s.data_dtype, device), _zero_bits(scale_shape, s.scale_dtype, device),
                   fmt, shape)


def _zero_bits(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """All-zero bits (1-byte dtypes through uint8: e8m0 has no 0.0 to convert from)."""
    if dtype.itemsize == 1:
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a list, int64 by default, or a CPU tensor) on ``device`` without a synchronous
    host->device copy: on CUDA staged in pinned memory (the caching host allocator keeps the block
    until the copy has run) and copied ``non_blocking`` (a copy from pageable memory would wait for
    the device's queue first)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def write_rows(dst: QTensor, batch: torch.Tensor, slot: torch.Tensor, src: QTensor,
               keep: torch.Tensor | None = None) -> None:
    """``dst[batch[i], slot[i]] = src[i]`` on the stored bytes (``src`` [..., D], ``n`` rows in
    all) where ``keep[i]`` (bool [n]; None: every row): the op ``store_rows``."""
    n = batch.shape[0]
    data, scale = (s.reshape(n, -1).view(torch.uint8).view(d.dtype)
                   for s, d in ((src.data, dst.data), (src.scale, dst.scale)))
    rows = QTensor(data, scale, dst.fmt, (n, src.shape[-1]))  # a caller's byte views back in the stored dtypes
    unchecked(ops.store_rows, dst, batch, slot, rows, keep)


def write_paged(pool, table: torch.Tensor, entry: torch.Tensor, mask: torch.Tensor, values: QTensor) -> None:
    """Store ``values`` [B, n, D] at logical entries ``entry`` [B, n] of a paged ``pool`` (a
    ``pages.PagePool`` or ``index.IndexPool``) whose block table ``table`` [B, max_pages] gives
    the device page of each logical page, where ``mask``; the other rows go to ``pool.trash_row``
    (no host-side filtering, no device sync): the op ``store_paged``."""
    unchecked(ops.store_paged, pool.segment(), table, entry, mask, values, pool.P, pool.trash_row)


def write_paged_many(writes, entry: torch.Tensor, mask: torch.Tensor) -> None:
    """:func:`write_paged` into several pools at the same entries in one ``store_paged_many`` call:
    ``writes`` ``((pool, table, values), ...)``."""
    stores = tuple((pool.segment(), table, values, pool.P, pool.trash_row) for pool, table, values in writes)
    unchecked(ops.store_paged_many, stores, entry, mask)


def unchecked(op, *args) -> None:
    """``op(*args)`` with the checks that read index values off: the KV writes take slots, entries
    and block tables the state computed itself, so a range check would only read them back (a host
    sync per write). A caller's step normally has them off already (``Model.forward``, the captured
    steps, :meth:`KVState.commit`'s writes), and then no context is entered here."""
    if not checks.values_checked():
        op(*args)
        return
    with checks.value_checks(False):
        op(*args)


def grown(q: QTensor, entries: int) -> QTensor:
    out = empty_qtensor(q.fmt, (q.shape[0], entries, q.shape[2]), q.device)
    n = q.shape[1]
    out.data[:, :n] = q.data
    out.scale[:, :n] = q.scale
    return out
