"""Reference math of the KV paging ops: ``gather_cold_rows`` (HKCP cold fetch), ``store_rows``,
``resolve_paged`` and ``store_paged``, with the page lookups that backend kernels fall back to.
Stored bytes are moved as bytes (data and scale, exactly)."""
from __future__ import annotations

import torch

from .formats import QTensor


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` as uint8 ``[rows, n * itemsize]`` (stored bytes, any dtype)."""
    return t.reshape(-1, t.shape[-1]).view(torch.uint8)


def cold_picks(host_ids, picks, pages_per_row: int, page_entries: int):
    """(cold mask [B, N], flat host row of each pick [B, N], 0 where not cold) of ``gather_cold_rows``."""
    e = picks.long()
    page = (e.clamp_min(0) // page_entries).clamp_max(pages_per_row - 1)
    hp = host_ids.gather(1, page)
    cold = (e >= 0) & (hp >= 0)
    return cold, torch.where(cold, hp * page_entries + e.clamp_min(0) % page_entries, 0)


def gather_cold_rows(host, host_ids, picks, index, offset):
    B, N = picks.shape
    dev, at = picks.device, host.data.device
    cold, src = cold_picks(host_ids, picks, host_ids.shape[1], host.shape[1])
    keep, src = cold.reshape(-1, 1).to(at), src.reshape(-1).to(at)
    staged = []
    for part in (host.data, host.scale):
        rows = torch.where(keep, _byte_rows(part)[src], 0)
        staged.append(rows.to(dev).view(part.dtype).view(1, B * N, part.shape[-1]))
    slots = offset + torch.arange(B * N, device=dev, dtype=torch.int64).view(B, N)
    out = torch.where(cold, slots, index.long()).to(torch.int32)
    return QTensor(staged[0], staged[1], host.fmt, (1, B * N, host.shape[-1])), out


def paged_rows(table, entry, mask, page_entries: int, trash_row: int):
    """int64 [B * n]: the pool row of each (row, entry) pair of ``store_paged``; pairs not stored
    (``mask`` false, or a page id < 0) point at ``trash_row``."""
    P, e = page_entries, entry.long().clamp_min(0)
    page = table.gather(1, (e // P).clamp_max(table.shape[1] - 1)).long()
    return torch.where(mask & (page >= 0), page * P + e % P, trash_row).reshape(-1)


def store_rows(dst, batch, slot, src, keep=None):
    for d, v in ((dst.data, src.data), (dst.scale, src.scale)):
        d, v = d.view(torch.uint8), v.view(torch.uint8)  # float8 has no index_put
        if keep is not None:  # the pairs not kept write back what their row holds (their rows are distinct)
            v = torch.where(keep.view(-1, *[1] * (v.dim() - 1)), v, d[batch, slot])
        d[batch, slot] = v
    return dst


def resolve_paged(table, picks, page_entries, offset=0):
    P, e = page_entries, picks.long()
    page = table.gather(1, (e.clamp_min(0) // P).clamp_max(table.shape[1] - 1)).long()
    return torch.where((e >= 0) & (page >= 0), page * P + e.clamp_min(0) % P + offset, -1).to(torch.int32)


def store_paged_many(stores, entry, mask):
    return tuple(store_paged(pool, table, entry, mask, values, P, trash) for pool, table, values, P, trash in stores)


def store_paged(pool, table, entry, mask, values, page_entries, trash_row):
    B, n = entry.shape
    rows = paged_rows(table, entry, mask, page_entries, trash_row)
    for dst, src in ((pool.data, values.data), (pool.scale, values.scale)):
        dst.view(torch.uint8)[0, rows] = src.reshape(B * n, -1).view(torch.uint8)  # float8 has no index_put
    return pool


def window_indices(positions, ring_start, window):
    start = positions[:, :1].unsqueeze(-1)  # [B, 1, 1]
    pos = positions.unsqueeze(-1) - torch.arange(window, device=positions.device)  # [B, S, W]
    in_chunk = pos >= start
    slot = torch.where(in_chunk, window + pos - start, pos % window)
    in_ring = (pos >= 0) & (pos >= ring_start.view(*ring_start.shape, 1, 1))  # [L, B, S, W]
    return torch.where(in_chunk | in_ring, slot, -1).to(torch.int32)
