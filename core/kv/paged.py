"""Paged key views: a batch of keys ``[B, T, D]`` stored in fixed-size pages of one shared pool.

:class:`PagedKeys` is what ``ops.index_scores`` accepts as ``k`` in place of a contiguous
``[B, T, D]`` tensor (HKCP stores index K this way): logical row ``t`` of sequence ``b`` is row
``block_table[b, t // page_size] * page_size + t % page_size`` of ``pool``. Nothing is copied
to build the view; :meth:`PagedKeys.gather` makes the contiguous copy a fallback needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrt.formats import QTensor


@dataclass(frozen=True)
class PagedKeys:
    """``pool`` ``[1, pages * page_size, D]`` (plain or QTensor), ``block_table`` int32
    ``[B, max_pages]`` on the pool's device, ``page_size`` rows per page, ``length`` = T, the
    logical rows of every sequence (``length <= max_pages * page_size``)."""

    pool: QTensor | torch.Tensor
    block_table: torch.Tensor
    page_size: int
    length: int

    @property
    def shape(self) -> torch.Size:
        """The logical shape ``[B, T, D]``."""
        return torch.Size((self.block_table.shape[0], self.length, self.pool.shape[-1]))

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def fmt(self) -> str | None:
        return self.pool.fmt if isinstance(self.pool, QTensor) else None

    def rows(self) -> torch.Tensor:
        """int64 ``[B, T]``: the pool row of every logical row."""
        t = torch.arange(self.length, device=self.block_table.device)
        page = self.block_table[:, t // self.page_size].long()
        return page * self.page_size + t % self.page_size

    def gather(self) -> QTensor | torch.Tensor:
        """The keys as one contiguous ``[B, T, D]`` tensor (a copy)."""
        rows = self.rows()
        if not isinstance(self.pool, QTensor):
            return self.pool[0][rows]
        u8 = torch.uint8  # float8 scales: index the bytes
        data = self.pool.data.view(u8)[0][rows].view(self.pool.data.dtype)
        scale = self.pool.scale.view(u8)[0][rows].view(self.pool.scale.dtype)
        return QTensor(data, scale, self.pool.fmt, self.shape)
