"""The running sequences' decode batch: one :class:`KVState` per batch-size bucket, a row per sequence.

A sequence joins by moving its one-row prefill state into a free row (:meth:`KVState.take_row`:
rings and compressor state copied, pages change owner) and leaves by giving its pages back
(:meth:`KVState.release_row`). Rows of a bucket that no sequence holds are padding: they run token
0 at position 0 every step (rewound afterwards, so they never grow) and their logits are ignored.
The batch grows to the next bucket when a sequence finds no free row and shrinks when at most half
a smaller bucket is used; the rows move over with :meth:`KVState.take_row` again. Each bucket's
state lives on (the ``keep`` most recent; by default every bucket, so a batch size that goes back
and forth across a bucket boundary never captures again), so on CUDA its captured decode steps
(:class:`~flashrt.engine.step_capture.StepCapture`, keyed by tensor addresses) are replayed
whenever the batch comes back to that size.

``MIN_ROWS``: a decode batch has at least 4 rows. CPU fp32 GEMMs of fewer than 4 rows use another
kernel and round differently; from 4 rows up a row's logits do not depend on the other rows (on
the reference backend), so a request decodes the same tokens alone or in any batch.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from flashrt.kv.state import KVState
from flashrt.kv.util import to_device

from .step_capture import StepCapture

MIN_ROWS = 4
BUCKETS = (4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(n: int) -> int:
    """The smallest bucket with room for ``n`` rows (multiples of 64 past the table)."""
    n = max(n, MIN_ROWS)
    return next((b for b in BUCKETS if b >= n), -(-n // 64) * 64)


class DecodeSlots:
    def __init__(self, model, pool, capacity: int, cuda_graph: bool, keep: int = len(BUCKETS)):
        self.model, self.pool, self.capacity, self.cuda_graph, self.keep = model, pool, capacity, cuda_graph, keep
        self.cache: OrderedDict[int, tuple[KVState, StepCapture | None]] = OrderedDict()
        self.state, self.capture, self.owner = None, None, []
        # how the decode steps ran, over every bucket's runner (StepCapture.stats keys)
        self.graph_steps = dict.fromkeys(("captured", "replayed", "eager", "fallback"), 0)
        self.uncapturable = None  # why a shape last stayed eager (the host sync), if one did

    # ----- membership ------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self.owner)

    @property
    def active(self) -> int:
        return sum(o is not None for o in self.owner)

    def add(self, seq, src: KVState, src_row: int = 0) -> int:
        """Move ``seq``'s state (row ``src_row`` of ``src``) into a free row; returns the row."""
        if self.active == self.rows:
            self._resize(bucket_for(self.active + 1))
        slot = self.owner.index(None)
        self.state.take_row(slot, src, src_row)
        self.owner[slot] = seq
        seq.slot = slot
        return slot

    def add_many(self, moves: list[tuple]) -> None:
        """:meth:`add` of each ``(seq, src, src_row)`` in order (the same rows), the moves out of one
        source state in one :meth:`KVState.take_rows`."""
        if not moves:
            return
        self.make_room(len(moves))
        by_src: dict[int, tuple] = {}
        free = (r for r, o in enumerate(self.owner) if o is None)
        for seq, src, src_row in moves:
            slot = next(free)
            self.owner[slot] = seq
            seq.slot = slot
            _, rows, src_rows = by_src.setdefault(id(src), (src, [], []))
            rows.append(slot)
            src_rows.append(src_row)
        for src, rows, src_rows in by_src.values():
            self.state.take_rows(rows, src, src_rows)

    def make_room(self, n: int) -> None:
        """Room for ``n`` more sequences in one resize, every row staying where it is: the adds that
        follow put each sequence where adding them one by one (growing bucket by bucket, moving
        every row each time) would, in the same final bucket."""
        if self.active + n <= self.rows:
            return
        rows = bucket_for(self.active + n)
        state, capture = self._state_for(rows)
        held = [r for r, seq in enumerate(self.owner) if seq is not None]
        state.take_rows(held, self.state, held)
        self._release_padding()
        self.state, self.capture = state, capture
        self.owner = self.owner + [None] * (rows - len(self.owner))

    def remove(self, seq) -> None:
        """Give ``seq``'s pages back and free its row."""
        self.state.release_row(seq.slot)
        self.owner[seq.slot] = None
        seq.slot = None
        n = self.active
        if n == 0:
            self._release_padding()
        elif bucket_for(n) <= self.rows // 2:
            self._resize(bucket_for(n))

    def _resize(self, rows: int) -> None:
        state, capture = self._state_for(rows)
        moved = [o for o in self.owner if o is not None]
        state.take_rows(list(range(len(moved))), self.state, [seq.slot for seq in moved])
        for i, seq in enumerate(moved):
            seq.slot = i
        self._release_padding()
        self.state, self.capture = state, capture
        self.owner = moved + [None] * (rows - len(moved))

    def _state_for(self, rows: int):
        if rows in self.cache:
            self.cache.move_to_end(rows)
            return self.cache[rows]
        state = KVState(self.model.cfg, rows, self.capacity, self.model.device, pool=self.pool,
                        window_fmt=self.model.window_fmt)
        entry = (state, StepCapture(self.model, state) if self.cuda_graph else None)
        self.cache[rows] = entry
        while len(self.cache) > max(self.keep, 2):  # the oldest, never the live one or the new one
            del self.cache[next(k for k, (s, _) in self.cache.items() if s is not self.state and k != rows)]
        return entry

    def _release_padding(self) -> None:
        """Rows no sequence holds give back the pages their padding steps reserved."""
        if self.state is not None:
            for r, o in enumerate(self.owner):
                if o is None:
                    self.state.release_row(r)

    # ----- one decode step ---------------------------------------------------------------------------
    def step(self, tokens: dict[int, int], drawn: tuple | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab] after one token per row (``tokens``: row -> id; padding runs 0).
        ``drawn``: ``(device tokens, {row: index})``, rows whose token is still on the device only
        (drawn by the previous step, not yet read by the host)."""
        ids = self.ids(tokens, drawn)
        if self.capture is not None:
            before = dict(self.capture.stats)
            logits = self.capture.step(ids)
            for kind in self.graph_steps:
                self.graph_steps[kind] += self.capture.stats[kind] - before[kind]
            self.uncapturable = self.capture.stats.get("uncapturable", self.uncapturable)
        else:
            logits = self.model.forward(ids.unsqueeze(1), state=self.state)
        self.state.rewind_rows([r for r, o in enumerate(self.owner) if o is None])
        return logits

    def ids(self, tokens: dict[int, int], drawn: tuple | None = None) -> torch.Tensor:
        """int64 [rows] on the model's device: ``tokens`` (row -> id) in their rows, the tokens
        ``drawn`` names (``(device tokens, {row: index})``) in theirs, 0 elsewhere: one host->device
        copy and, with ``drawn``, one gather on the device."""
        ids = [0] * self.rows
        for r, t in tokens.items():
            ids[r] = t
        if not drawn or not drawn[1]:
            return to_device(ids, self.model.device)
        src, where = drawn
        rows, index = list(where), list(where.values())
        packed = to_device(ids + rows + index, self.model.device)
        n, k = self.rows, len(rows)
        out = packed[:n].clone()
        return out.index_copy_(0, packed[n:n + k], src.index_select(0, packed[n + k:]))

    def padding_need(self, pages_at_one: int) -> int:
        """Pages the padding rows will reserve in the next step (those holding none yet: a padding
        row keeps the pages of its one position)."""
        if self.state is None or not self.active:
            return 0
        return sum(pages_at_one for r, o in enumerate(self.owner) if o is None and not self.state.row_pages(r))
