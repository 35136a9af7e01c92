"""Small helpers for the KV caches: zero-filled QTensors and byte-level row writes."""
from __future__ import annotations

import torch

from .formats import QTensor, expected_layout, spec


def empty_qtensor(fmt: str, shape, device) -> QTensor:
    """A zero-filled QTensor of logical ``shape`` (scales zero too: unwritten entries read as 0)."""
    data_shape, scale_shape = expected_layout(fmt, shape)
    s = spec(fmt)
    data = torch.zeros(data_shape, dtype=torch.uint8, device=device).view(s.data_dtype)
    scale = torch.zeros(scale_shape, dtype=torch.uint8, device=device).view(s.scale_dtype)
    return QTensor(data, scale, fmt, shape)


def write_rows(dst: QTensor, batch: torch.Tensor, slot: torch.Tensor, src: QTensor) -> None:
    """``dst[batch[i], slot[i]] = src[i]`` on the stored bytes (``src`` is [n, D])."""
    u8 = torch.uint8  # index_put is not implemented for the float8 dtypes: write the bytes
    dst.data.view(u8)[batch, slot] = src.data.reshape(-1, src.data.shape[-1]).view(u8)
    dst.scale.view(u8)[batch, slot] = src.scale.reshape(-1, src.scale.shape[-1]).view(u8)


def grown(q: QTensor, entries: int) -> QTensor:
    out = empty_qtensor(q.fmt, (q.shape[0], entries, q.shape[2]), q.device)
    n = q.shape[1]
    out.data[:, :n] = q.data
    out.scale[:, :n] = q.scale
    return out
