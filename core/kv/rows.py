"""Rows of a :class:`~flashrt.kv.state.KVState` (a serving engine's sequences come and go): a
sequence moved between states (pages change owner, nothing is recomputed), a row emptied,
rewound or given back to the pools. A base class of ``KVState``: its methods read the state's
rings, positions, compressed caches and pools."""
from __future__ import annotations

import torch

from .util import to_device


def _fill(t: torch.Tensor, dim: int, index, value) -> None:
    """``t``'s rows ``index`` (an int, or a device tensor of rows) along ``dim`` set to ``value``.
    ``index_fill_``, not ``t[index] = value``: an advanced-index assignment of a Python number
    waits for the device's queue on CUDA (tools/blocking_ops.py), index_fill_ does not."""
    if isinstance(index, int):
        t.select(dim, index).fill_(value)
    else:
        t.index_fill_(dim, index, value)


class RowMoves:
    def take_row(self, row: int, src: "KVState", src_row: int = 0) -> None:
        """Move sequence ``src_row`` of ``src`` (same pools) into ``row``: window rings, compressor
        state, Engram history and positions are copied; its main-KV and index-K pages change owner
        (no page copy). ``row``'s own pages go back to the pools; ``src_row`` is left empty."""
        self.take_rows([row], src, [src_row])

    def take_rows(self, rows: list[int], src: "KVState", src_rows: list[int]) -> None:
        """:meth:`take_row` of each pair ``(rows[i], src_rows[i])``, the copies of all of them in one
        launch per tensor (a decode batch that grows moves every row: per-row copies would cost a
        few dozen launches a row)."""
        if len(rows) != len(src_rows) or len(set(rows)) != len(rows) or len(set(src_rows)) != len(src_rows):
            raise ValueError(f"rows, src_rows: expected two lists of distinct rows of one length, got {rows} and "
                             f"{src_rows}")
        if not rows:
            return
        if src.pool is not self.pool:
            raise ValueError("src: KVState.take_rows needs a state drawn from the same page pool")
        if src is self and len(rows) > 1:  # moves within one state overlap: one at a time
            for row, src_row in zip(rows, src_rows):
                self.take_rows([row], src, [src_row])
            return
        dst, at = self._row_index(rows), src._row_index(src_rows)
        u8 = torch.uint8
        if self._ring_store is not None and src._ring_store is not None:  # every layer in one copy
            q, s = self._ring_store, src._ring_store
            q.data.view(u8)[:, dst] = s.data.view(u8)[:, at]
            q.scale.view(u8)[:, dst] = s.scale.view(u8)[:, at]
            self._ring_start_store[:, dst] = src._ring_start_store[:, at]
        else:
            for l, q in self.rings.items():
                s = src.rings[l]
                q.data.view(u8)[dst] = s.data.view(u8)[at]
                q.scale.view(u8)[dst] = s.scale.view(u8)[at]
                self.ring_start[l][dst] = src.ring_start[l][at]
        self.positions[dst] = src.positions[at]
        self.engram_history[dst] = src.engram_history[at]
        for row, src_row in zip(rows, src_rows):
            self.host_positions[row] = src.host_positions[src_row]
        for l, c in self.compressed.items():
            s = src.compressed[l]
            if c.kv_state is not None:
                c.kv_state[dst], c.score_state[dst] = s.kv_state[at], s.score_state[at]
            for row, src_row in zip(rows, src_rows):
                c.main.adopt_row(row, s.main.detach_row(src_row))
                c.index_k.adopt_row(row, s.index_k.detach_row(src_row))
        src._reset_rows(at, src_rows)

    def _row_index(self, rows: list[int]):
        """An index of ``rows``: the row itself for one (a plain copy), else a device tensor (one
        gather or scatter; staged through pinned memory on CUDA, no blocking copy)."""
        return rows[0] if len(rows) == 1 else to_device(rows, self.device)

    def reset_row(self, row: int) -> None:
        """``row`` becomes an empty sequence at position 0 (its pages, if any, stay with it)."""
        self._reset_rows(row, [row])

    def _reset_rows(self, index, rows: list[int]) -> None:
        """:meth:`reset_row` of ``rows`` (``index``: their :meth:`_row_index`)."""
        _fill(self.positions, 0, index, 0)
        for r in rows:
            self.host_positions[r] = 0
        if self._ring_start_store is not None:
            _fill(self._ring_start_store, 1, index, 0)
        else:
            for start in self.ring_start.values():
                _fill(start, 0, index, 0)
        _fill(self.engram_history, 0, index, -1)
        for c in self.compressed.values():
            if c.kv_state is not None:
                _fill(c.kv_state, 0, index, 0.0)
                _fill(c.score_state, 0, index, float("-inf"))

    def rewind_rows(self, rows: list[int]) -> None:
        """``rows`` restart at position 0 without clearing their caches: the idle rows of a padded
        decode batch, which run a token every step and must not grow."""
        if rows:
            _fill(self.positions, 0, self._row_index(rows), 0)
            for r in rows:
                self.host_positions[r] = 0

    def release_row(self, row: int) -> None:
        """Give ``row``'s main-KV and index-K pages back to the pools and empty it."""
        if not self.is_meta:
            for c in self.compressed.values():
                c.main.clear_row(row)
                c.index_k.clear_row(row)
        self.reset_row(row)

    def row_pages(self, row: int) -> int:
        """Main-KV pages ``row`` holds (both tiers, every source layer)."""
        return 0 if self.is_meta else sum(len(c.main.tables[row].pages) for c in self.compressed.values())

