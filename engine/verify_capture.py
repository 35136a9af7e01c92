"""Verify steps of speculative decoding replayed from CUDA graphs, one capture per (batch, k, entries).

A verify step runs ``[next, d_1 .. d_k]`` (``k + 1`` tokens per row) from each row's own position
(engine/speculative.py). :class:`VerifyCapture` runs it from static buffers so that it can be
recorded once per shape key and replayed: the token ids and Engram hash ids of each ``k`` live in
static buffers filled before the step; positions, block tables, rings, compressor state and
index K are the state's own device tensors (updated in place, as for one-token steps in
:mod:`flashrt.engine.step_capture`); the compressed entries read are rounded up to a bucket; the
compressor lays out every row's chunk from device values only (``StepContext.static_chunk``:
every row padded to ``ratio - 1 + k + 1`` inputs), so rows at different positions share one graph.

Host work stays outside the graph: page reservation (``begin_step``), Engram hashing, and the
accept / commit after the step (``speculative.keep``). What the step stages for the commit (ring
tokens, compressor inputs) is graph memory: after a replay the staged list recorded with the
graph is handed back to the state, and ``KVState.advance(counts)`` commits the kept tokens.
Steps that read host-tier pages without the zero-copy gather, and models with Engram tables in
host memory, run eagerly (:func:`flashrt.engine.speculative.verify`). On a non-CUDA device the
static-buffer step runs eagerly (how CPU tests check it); ``record`` replaces the CUDA graph
recorder (tests pass one that re-runs the body into the recorded outputs).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from flashrt import checks
from flashrt.kv.staged import Staged
from flashrt.kv.state import KVState

from . import accept
from . import speculative as spec
from .step_capture import CAPTURE_ERROR_MODE, step_entries, uncapturable


def capture_setup(model, state, capture: bool | None, record):
    """Check ``state``; return (whether steps are captured: by default on CUDA or with ``record``
    given, the recorder: ``record`` or CUDA graphs)."""
    if not isinstance(state, KVState) or state.is_meta:
        raise ValueError(f"state: expected a KVState on a real device, got {type(state).__name__}")
    cuda = model.device.type == "cuda"
    use = (cuda or record is not None) if capture is None else bool(capture)
    if use and not cuda and record is None:
        raise ValueError(f"capture: CUDA graphs need a CUDA device, the model is on {model.device}")
    return use, record or (cuda_record(torch.cuda.graph_pool_handle()) if use else None)


def cuda_record(pool):
    """A recorder of CUDA graphs in memory pool ``pool``: ``record(body) -> (replay, outputs)``."""
    def record(body):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE):
            out = body()  # recorded, not run
        return graph.replay, out
    return record


class VerifyCapture:
    """Verify steps of ``state`` (``state.batch`` rows) through CUDA graphs keyed by (k, entries).

    ``capture``: record and replay (default: on CUDA devices, or when ``record`` is given); False
    runs the same static-buffer step eagerly. ``max_graphs``: graphs kept (least recently used
    dropped). ``record``: ``record(body) -> (replay, outputs)`` (default: CUDA graphs)."""

    def __init__(self, model, state: KVState, capture: bool | None = None, max_graphs: int = 16, record=None):
        self.capture, self.record = capture_setup(model, state, capture, record)
        self.model, self.state, self.max_graphs = model, state, max_graphs
        self.ids: dict = {}  # k + 1 -> static ids [B, k + 1]
        self.engram_ids: dict = {}  # k + 1 -> static Engram hash ids
        self.graphs: OrderedDict = OrderedDict()  # key -> (replay, (logits, Staged)) or "eager"
        self.commits: dict = {}  # verify key -> replay of the commit of its staging, or "eager"
        self.counts: dict = {}  # k + 1 -> static kept counts [B] (device)
        self._replayed = None  # (key, S) when the current staging is a graph's (what keep can replay)
        self.stats = {"captured": 0, "replayed": 0, "eager": 0, "fallback": 0}
        self.ratios = sorted({model.cfg.ratio(l) for l in model.cfg.kv_source_layers})

    def key(self, S: int, entries: dict, buffers) -> tuple:
        """The shape key of a step of ``S`` tokens per row: a graph is recorded per key."""
        return (self.state.batch, S, tuple(sorted(entries.items())), buffers.cold, buffers.layout(), self._layout(S))

    def verify(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[B, k + 1, vocab]`` of ``ids`` [B, k + 1] run from each row's position;
        nothing is kept until :func:`flashrt.engine.speculative.keep`. The tensor is the graph's
        static output: read it before the next step."""
        state, model = self.state, self.model
        if ids.dim() != 2 or ids.shape[0] != state.batch or ids.shape[1] < 1:
            raise ValueError(f"ids: expected a [{state.batch}, k + 1] tensor, got {tuple(ids.shape)}")
        S = ids.shape[1]
        self._replayed = None
        entries = self._entries(max(state.host_positions) + S)
        state.begin_step(S)
        buffers = state.step_buffers(entries)
        if model.prefetch is not None or (any(buffers.cold) and not state.pool.zero_copy(
                state.batch * S * model.cfg.index_topk)):
            self.stats["fallback"] += 1
            return self._fallback(ids)
        if S not in self.ids:
            self.ids[S] = torch.zeros(state.batch, S, dtype=torch.long, device=model.device)
        self.ids[S].copy_(ids)
        with checks.value_checks(False):  # sampled tokens: range checks would sync every step
            if model.hasher is not None:
                hashed, _ = model.hasher.hash_ids(self.ids[S], state.engram_history)
                if S not in self.engram_ids or self.engram_ids[S].shape != hashed.shape:
                    self.engram_ids[S] = torch.empty_like(hashed)
                self.engram_ids[S].copy_(hashed)
            return self._step(S, entries, buffers)

    def _entries(self, end: int) -> dict[int, int]:
        """Compressed entries per ratio a step ending at position ``end - 1`` reads: a bucket."""
        return step_entries(end, self.ratios)

    def _fallback(self, ids: torch.Tensor) -> torch.Tensor:
        """The eager step of ``ids`` (cold pages without the zero-copy gather, host-memory Engram tables)."""
        return spec.verify(self.model, self.state, ids)[0]

    def _body(self, S: int, entries: dict) -> torch.Tensor:
        state = self.state
        positions = state.positions.unsqueeze(1) + torch.arange(S, device=self.model.device)
        ctx = self.model.step_context(state, positions, max(state.host_positions) + S, entries=entries,
                                      engram_ids=self.engram_ids.get(S), static_chunk=True)
        return self.model.run(self.ids[S], ctx, all_positions=True)

    def _traced(self, S: int, entries: dict):
        """The body with what it stages for the commit: (logits, Staged)."""
        self.state._staged = Staged()
        return self._body(S, entries), self.state._staged

    def _step(self, S: int, entries: dict, buffers) -> torch.Tensor:
        if not self.capture:
            self.stats["eager"] += 1
            return self._body(S, entries)
        key = self.key(S, entries, buffers)
        hit = self.graphs.get(key)
        if hit == "eager":
            self.stats["eager"] += 1
            return self._body(S, entries)
        if hit is not None:
            self.graphs.move_to_end(key)
            replay, (logits, staged) = hit
            replay()
            self.state._staged = Staged(list(staged.rings), list(staged.partials))
            self.stats["replayed"] += 1
            self._replayed = (key, S)
            return logits
        return self._first(key, S, entries)

    def _first(self, key, S: int, entries: dict) -> torch.Tensor:
        """The first step of a key: run eagerly (a host sync keeps the key eager), then record."""
        try:
            with checks.host_syncs_raise():
                logits, staged = self._traced(S, entries)
        except RuntimeError as exc:
            if not checks.is_host_sync_error(exc):
                raise
            self.graphs[key] = "eager"
            self.stats["uncapturable"] = str(exc).splitlines()[0][:200]
            self.stats["eager"] += 1
            return self._traced(S, entries)[0]  # again, syncs allowed: fresh staging, the same cache slots
        try:
            self.graphs[key] = self.record(lambda: self._traced(S, entries))  # cache writes: same slots, same values
            self.stats["captured"] += 1
        except RuntimeError as exc:  # an operation a graph cannot record: the key runs eagerly from now on
            self.graphs[key], self.stats["uncapturable"] = "eager", uncapturable(exc, f"a {S}-token step")
            self.stats["eager"] += 1
        self.state._staged = staged  # the eager run's staging is what this step commits
        while len(self.graphs) > self.max_graphs:
            self.commits.pop(self.graphs.popitem(last=False)[0], None)
        return logits

    def keep(self, ids: torch.Tensor, counts: torch.Tensor, counted: list[int] | None = None) -> None:
        """:func:`flashrt.engine.speculative.keep` after :meth:`verify` of ``ids``: row ``b`` keeps
        its first ``counts[b]`` tokens. After a replayed step the commit of its staging (a graph's
        memory, at fixed addresses) is itself replayed from a graph recorded per verify graph, with
        the counts in a static buffer; the host bookkeeping (positions, pages, Engram history) runs
        as in the eager commit. ``counted``: ``counts`` on the host when the caller knows them
        (saves reading them back)."""
        state, model, last = self.state, self.model, self._replayed
        self._replayed = None
        if last is None or self.commits.get(last[0]) == "eager":
            return spec.keep(model, state, ids, counts, counted)
        key, S = last
        counted = counts.tolist() if counted is None else counted
        if S not in self.counts:
            self.counts[S] = torch.zeros(state.batch, dtype=torch.long, device=model.device)
        self.counts[S].copy_(counts)
        replay = self.commits.get(key)
        if replay is not None:
            replay()
        elif not self._commit_and_record(key, S):
            return spec.keep(model, state, ids, counts, counted)
        state.advance(counted, accept.engram_history(model, state.engram_history, ids, counts), committed=True)

    def _commit_and_record(self, key, S: int) -> bool:
        """Run the commit of the current (graph) staging once with host syncs raising, then record
        it (a recorder that runs the body writes the same values again). False: it synced, the key's
        commits stay eager (what it wrote is written again by the eager commit)."""
        body = self._commit_body(S)
        try:
            with checks.host_syncs_raise(), checks.value_checks(False):
                body()
        except RuntimeError as exc:
            if not checks.is_host_sync_error(exc):
                raise
            self.commits[key] = "eager"
            return False
        try:
            with checks.value_checks(False):
                self.commits[key] = self.record(body)[0]
        except RuntimeError as exc:  # not recordable: this key's commits run eagerly (they rewrite the same values)
            uncapturable(exc, "a commit")
            self.commits[key] = "eager"
        return True

    def _commit_body(self, S: int):
        """The commit a recorded step's graph replays: the first ``counts[S][b]`` tokens of each row."""
        return lambda: self.state.commit_kept(self.counts[S])

    def _layout(self, S: int) -> tuple:
        tensors = [self.ids.get(S), self.engram_ids.get(S)]
        return tuple((t.data_ptr(), tuple(t.shape)) for t in tensors if t is not None)
