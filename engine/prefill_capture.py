"""Prompt chunks replayed from CUDA graphs: a prefill forward whose host work bounds it.

A ``[rows, S]`` prefill forward of a few rows launches hundreds of kernels whose Python costs
more than their device time (docs/performance.md, "Prefill forwards by row count"), so it is
worth recording once and replaying. :class:`PrefillCapture` runs a chunk of a
:class:`~flashrt.kv.state.KVState` whose rows share one position from static buffers, the way
:class:`~flashrt.engine.verify_capture.VerifyCapture` runs a verify chunk (it is one, keeping
every token and returning the last position's logits):

* the token ids and Engram hash ids live in static buffers filled before the step; positions,
  block tables, rings, compressor state and index K are the state's own device tensors, brought
  up to date in place (``begin_step``, ``step_buffers``) before every call;
* the key holds the rows, the chunk length and the rows' **exact** start position (plus the
  state's buffer addresses), so every value the host derives from the position is the same at
  every replay of a key: a chunk runs the same kernels with the same arguments as the eager
  forward of that chunk, only the ids and the cache contents differ;
* the chunk's staged ring and partial-group writes are committed after the replay by a commit
  graph recorded with it; positions, pages and the Engram history are host bookkeeping outside.

A chunk whose rows are at different positions, or that reads host-tier pages without the
zero-copy gather, or a model with host-memory Engram tables runs eagerly (``Model.forward``).
Graphs are kept per key, least recently used dropped; the serving engine shares one memory pool
among its runners (:class:`PrefillStates`) and captures only chunks of at most
:data:`GRAPH_TOKENS` tokens, where the forward is bound by its host work.
"""
from __future__ import annotations

import torch

from flashrt.kv.state import KVState

from .verify_capture import VerifyCapture, cuda_record

GRAPH_TOKENS = 4096  # rows x chunk tokens of the largest chunk captured (larger ones are device-bound)
# rows of the largest reusable prefill state: each state keeps its window rings and compressor state
# for good (a fresh group state holds them only until its rows move), so their number stays small
GRAPH_ROWS = 8


class PrefillCapture(VerifyCapture):
    """Prefill chunks of ``state`` (every row at one position) through CUDA graphs keyed by
    (rows, chunk length, start position, the state's buffers). ``capture``, ``max_graphs`` and
    ``record`` as :class:`VerifyCapture`'s."""

    def __init__(self, model, state: KVState, capture: bool | None = None, max_graphs: int = 8, record=None):
        super().__init__(model, state, capture, max_graphs, record)
        self.full: dict = {}  # S -> static int64 [B] filled with S (every token kept)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[B, vocab]`` of the last position after the chunk ``ids`` [B, S] (on the
        model's device; the caller checked their values), the state advanced by ``S``. The tensor
        may be a graph's static output: read it before this runner's next call."""
        state, model = self.state, self.model
        if ids.dim() != 2 or ids.shape[0] != state.batch or ids.shape[1] < 1:
            raise ValueError(f"ids: expected a [{state.batch}, S] tensor, got {tuple(ids.shape)}")
        if len(set(state.host_positions)) != 1:
            self.stats["eager"] += 1
            return model.forward(ids, state=state)
        S = ids.shape[1]
        logits = self.verify(ids)
        if S not in self.full:
            self.full[S] = torch.full((state.batch,), S, dtype=torch.long, device=model.device)
        self.keep(ids, self.full[S], [S] * state.batch)
        return logits

    def key(self, S: int, entries: dict, buffers) -> tuple:
        return (self.state.host_positions[0],) + super().key(S, entries, buffers)

    def _entries(self, end: int) -> dict[int, int]:
        """Exactly the entries of complete groups up to ``end`` (as an eager forward reads):
        the start position is in the key, so no bucket is needed."""
        return {r: end // r for r in self.ratios}

    def _fallback(self, ids: torch.Tensor) -> torch.Tensor:
        ctx = self.model.context(ids, self.state)
        return self.model.run(ids, ctx)

    def _commit_body(self, S: int):
        return lambda: self.state.commit_kept(None)  # every token of the chunk

    def _body(self, S: int, entries: dict) -> torch.Tensor:
        state, model = self.state, self.model
        positions = state.positions.unsqueeze(1) + torch.arange(S, device=model.device)
        ctx = model.step_context(state, positions, state.host_positions[0] + S, entries=entries,
                                 engram_ids=self.engram_ids.get(S))
        return model.run(self.ids[S], ctx)


class PrefillStates:
    """The serving engine's prefill states of ``rows`` rows (one per row count, made when first
    needed, at most ``max_states`` row counts of at most ``max_rows`` rows), each with its
    :class:`PrefillCapture`; graphs of every runner in one memory pool; chunks of at most
    ``max_tokens`` (rows x length).

    A sequence prefills in a row of one of them while it is free (no prefilling sequence in it)
    and moves to the decode batch from there (``KVState.take_row`` leaves the row empty), so the
    same state, at the same addresses, serves request after request and its graphs replay.
    ``record``: the recorder for every runner (tests); default CUDA graphs on a CUDA device."""

    def __init__(self, model, pool, capacity: int, capture: bool | None = None, record=None,
                 max_tokens: int = GRAPH_TOKENS, max_states: int = 4, max_rows: int = GRAPH_ROWS):
        self.model, self.pool, self.capacity = model, pool, capacity
        self.max_tokens, self.max_states, self.max_rows = max_tokens, max_states, max_rows
        cuda = model.device.type == "cuda"
        self.capture = (cuda or record is not None) if capture is None else bool(capture)
        if self.capture and record is None and cuda:
            record = cuda_record(torch.cuda.graph_pool_handle())
        self.record = record
        self.runners: dict[int, PrefillCapture] = {}

    def wants(self, rows: int, tokens: int) -> bool:
        """Whether a chunk of ``rows`` x ``tokens`` runs in a captured state."""
        return self.capture and rows <= self.max_rows and rows * tokens <= self.max_tokens and (
            rows in self.runners or len(self.runners) < self.max_states)

    def state_for(self, rows: int, busy) -> KVState | None:
        """The prefill state of ``rows`` rows, or None while ``busy(state)`` (a sequence is in it)."""
        runner = self.runners.get(rows)
        if runner is None:
            state = self.model.new_state(rows, self.capacity, pool=self.pool)
            runner = self.runners[rows] = PrefillCapture(self.model, state, True, record=self.record)
        return None if busy(runner.state) else runner.state

    def runner(self, state: KVState) -> PrefillCapture | None:
        """The runner of ``state`` when it is one of these states."""
        runner = self.runners.get(state.batch)
        return runner if runner is not None and runner.state is state else None
