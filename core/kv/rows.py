"""Rows of a :class:`~flashrt.kv.state.KVState` (a serving engine's sequences come and go): a
sequence moved between states (pages change owner, nothing is recomputed), a row emptied,
rewound or given back to the pools. A base class of ``KVState``: its methods read the state's
rings, positions, compressed caches and pools."""
from __future__ import annotations

import torch


class RowMoves:
    def take_row(self, row: int, src: "KVState", src_row: int = 0) -> None:
        """Move sequence ``src_row`` of ``src`` (same pools) into ``row``: window rings, compressor
        state, Engram history and positions are copied; its main-KV and index-K pages change owner
        (no page copy). ``row``'s own pages go back to the pools; ``src_row`` is left empty."""
        if src.pool is not self.pool:
            raise ValueError("src: KVState.take_row needs a state drawn from the same page pool")
        u8 = torch.uint8
        if self._ring_store is not None and src._ring_store is not None:  # every layer in one copy
            q, s = self._ring_store, src._ring_store
            q.data.view(u8)[:, row].copy_(s.data.view(u8)[:, src_row])
            q.scale.view(u8)[:, row].copy_(s.scale.view(u8)[:, src_row])
            self._ring_start_store[:, row] = src._ring_start_store[:, src_row]
        else:
            for l, q in self.rings.items():
                s = src.rings[l]
                q.data.view(u8)[row].copy_(s.data.view(u8)[src_row])
                q.scale.view(u8)[row].copy_(s.scale.view(u8)[src_row])
                self.ring_start[l][row] = src.ring_start[l][src_row]
        self.positions[row] = src.positions[src_row]
        self.host_positions[row] = src.host_positions[src_row]
        self.engram_history[row] = src.engram_history[src_row]
        for l, c in self.compressed.items():
            s = src.compressed[l]
            if c.kv_state is not None:
                c.kv_state[row], c.score_state[row] = s.kv_state[src_row], s.score_state[src_row]
            c.main.adopt_row(row, s.main.detach_row(src_row))
            c.index_k.adopt_row(row, s.index_k.detach_row(src_row))
        src.reset_row(src_row)

    def reset_row(self, row: int) -> None:
        """``row`` becomes an empty sequence at position 0 (its pages, if any, stay with it)."""
        self.positions[row] = 0
        self.host_positions[row] = 0
        if self._ring_start_store is not None:
            self._ring_start_store[:, row] = 0
        else:
            for start in self.ring_start.values():
                start[row] = 0
        self.engram_history[row] = -1
        for c in self.compressed.values():
            if c.kv_state is not None:
                c.kv_state[row], c.score_state[row] = 0.0, float("-inf")

    def rewind_rows(self, rows: list[int]) -> None:
        """``rows`` restart at position 0 without clearing their caches: the idle rows of a padded
        decode batch, which run a token every step and must not grow."""
        if rows:
            idx = torch.tensor(rows, dtype=torch.long)  # staged in pinned memory on CUDA: no blocking copy
            if self.device.type == "cuda":
                idx = idx.pin_memory()
            self.positions[idx.to(self.device, non_blocking=True)] = 0
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

