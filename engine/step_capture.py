"""Decode steps replayed from CUDA graphs: one capture per static shape, replayed every step.

A decode step of a batch is launch-bound at small batch sizes (hundreds of small kernels).
:class:`StepCapture` captures :meth:`Model.run` over a one-token step once per *shape key* and
replays it afterwards. Everything that varies between steps lives in device tensors the graph
reads in place: the token ids and Engram hash ids (static buffers filled before each replay),
positions, window rings, compressor state, index K, the page pool and its block tables (updated
in place when a page is added). What would change a kernel's shape is made static:

* the compressed entries a layer reads follow the step's last position rounded up to a bucket
  (at most 1/8 more than needed, see :func:`step_entries`); the extra entries are not visible to any query (the indexer masks them to
  ``-inf`` and top-k never picks them), so the step computes the same function;
* the key also holds the address and shape of every state tensor, so a cache that grew (index K
  doubling, page pool growth, a wider block table) is captured afresh instead of read stale.

Host work stays outside the graph: page reservation and spills (``begin_step``), block-table
refreshes, Engram hashing, sampling, and with Engram tables in host memory the gather of the
step's rows into pinned buffers and their copy to static device buffers (issued before the
replay, which reads them). Cold main-KV pages are read by ``ops.gather_cold_rows``: where the
backend serving it reads pinned host memory in place (zero-copy, no host work; the CUDA kernel)
such steps are captured too (eager with ``CAPTURE_COLD`` False); elsewhere the cold fetch is
host-driven and the step falls back to :meth:`Model.forward`. On a non-CUDA device the
same static-buffer step runs eagerly (how CPU tests check it).

A model built with a :class:`~flashrt.graphs.parallel.Parallel` context (``--tp`` / ``--ep``) runs
its steps with the fixed-shape MoE dispatch (``Parallel.static_shapes``); its collectives are
recorded into the graph and replayed (NCCL supports capture). Every rank captures and replays the
same steps in lockstep; a step that syncs with the host cannot fall back to eager on one rank
alone (its collectives would no longer line up), so there it raises instead.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict

import torch

from flashrt import checks
from flashrt.formats import QTensor
from flashrt.kv.state import KVState, StepBuffers


log = logging.getLogger("flashrt.engine")

CAPTURE_ERROR_MODE = "global"  # torch.cuda.graph's: "relaxed" lets driver queries run during a capture
# Capture steps that read cold pages (through the zero-copy gather; attention then reads four KV
# segments; tests/engine/test_step_capture.py::test_captured_steps_with_cold_pages checks the replays
# against the eager static step); False runs such steps eagerly. Any step whose first run syncs
# with the host (checks.host_syncs_raise), or whose capture fails, is kept eager rather than captured.
CAPTURE_COLD = True


def uncapturable(exc: Exception, what: str) -> str:
    """Why a capture failed (the first line of ``exc``), logged: ``what`` runs eagerly from now on."""
    why = str(exc).splitlines()[0][:200]
    log.warning("%s could not be captured and runs eagerly: %s", what, why)
    return why


def bucket(entries: int) -> int:
    """``entries`` rounded up to a multiple of ``max(16, 2**(bits - 4))``: <= 1/8 extra."""
    if entries <= 0:
        return 0
    step = max(16, 1 << max(0, entries.bit_length() - 4))
    return -(-entries // step) * step


def step_entries(end: int, ratios) -> dict[int, int]:
    """Compressed entries each compression ratio's layers read in a step whose last position is
    ``end - 1``: every ratio's count follows one rounded position (``bucket(end) // r >= end //
    r``), so the shape key changes only when that position crosses a bucket, not whenever any one
    ratio's count does (fewer distinct keys, fewer captures while a batch's positions move)."""
    top = bucket(end)
    return {r: top // r for r in ratios}


class StepCapture:
    """One-token decode steps of ``state`` (a batch of ``state.batch`` rows) through CUDA graphs.

    ``capture``: record and replay graphs (default: on CUDA devices); False runs the same
    static-buffer step eagerly. ``max_graphs``: graphs kept (least recently used dropped).
    """

    def __init__(self, model, state: KVState, capture: bool | None = None, max_graphs: int = 16):
        if not isinstance(state, KVState) or state.is_meta:
            raise ValueError(f"state: expected a KVState on a real device, got {type(state).__name__}")
        self.model, self.state = model, state
        self.capture = model.device.type == "cuda" if capture is None else bool(capture)
        if self.capture and model.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, the model is on {model.device}")
        self.max_graphs = max_graphs
        B = state.batch
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=model.device)
        self.engram_ids = None
        self.staged: dict = {}  # Engram slot -> (pinned rows, device rows) with host-memory tables
        self.copied = None  # event after the last staged copies
        self.graphs: OrderedDict = OrderedDict()  # key -> (CUDAGraph, static logits)
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.stats = {"captured": 0, "replayed": 0, "eager": 0, "fallback": 0}
        self.ratios = sorted({model.cfg.ratio(l) for l in model.cfg.kv_source_layers})

    def fallback_reason(self, buffers: StepBuffers) -> str | None:
        """Why the next step cannot run from static ``buffers`` (None when it can)."""
        s = self.state
        picks = s.batch * self.model.cfg.index_topk
        if any(buffers.cold) and not s.pool.zero_copy(picks):
            return "main-KV pages on the host tier without the zero-copy gather (host-driven fetch)"
        return None

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[B, vocab]`` after one token per row (``ids`` [B] or [B, 1] on the model's
        device). The tensor is the graph's static output: read it before the next step."""
        state, model = self.state, self.model
        ids = ids.reshape(state.batch, 1)
        end = max(state.host_positions) + 1
        entries = step_entries(end, self.ratios)
        state.begin_step(1)
        buffers = state.step_buffers(entries)  # room for the bucket, block tables refreshed in place
        if self.fallback_reason(buffers) is not None:
            self.stats["fallback"] += 1
            with model.parallel.static_shapes() if model.parallel is not None else contextlib.nullcontext():
                return model.forward(ids, state=state)  # the same collectives as a captured step's
        self.ids.copy_(ids)
        history = None
        with checks.value_checks(False):  # the ids are sampled tokens: range checks would sync every step
            if model.hasher is not None:
                hashed, history = model.hasher.hash_ids(self.ids, state.engram_history)
                if self.engram_ids is None or self.engram_ids.shape != hashed.shape:
                    self.engram_ids = torch.empty_like(hashed)
                    self.graphs.clear()
                self.engram_ids.copy_(hashed)
                if model.prefetch is not None:
                    self._stage_engram()
            logits = self._step(entries, buffers)
        state.advance(1, history)
        return logits

    def _body(self, entries: dict) -> torch.Tensor:
        state, par = self.state, self.model.parallel
        ctx = self.model.step_context(state, state.positions.unsqueeze(1), max(state.host_positions) + 1,
                                      entries=entries, engram_ids=self.engram_ids,
                                      engram_rows={slot: (rows, None) for slot, (_, rows) in self.staged.items()})
        with par.static_shapes() if par is not None else contextlib.nullcontext():
            return self.model.run(self.ids, ctx)

    def _stage_engram(self) -> None:
        """Rows of host-memory Engram tables this step reads -> pinned buffers -> static device buffers."""
        ids = self.engram_ids.cpu()  # waits for the hashing; the tokens were on the host anyway
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies have left the pinned buffers
        u8 = torch.uint8
        for e in self.model.prefetch.engrams:
            flat = ids[:, :, e.slot].reshape(-1)
            t = e.table
            if e.slot not in self.staged:
                shape = (flat.numel(), t.shape[-1])
                host = QTensor(t.data[flat].pin_memory(), t.scale[flat].pin_memory(), t.fmt, shape)
                dev = QTensor(torch.empty_like(host.data, device=self.model.device),
                              torch.empty_like(host.scale, device=self.model.device), t.fmt, shape)
                self.staged[e.slot] = (host, dev)
            host, dev = self.staged[e.slot]
            for src, pinned, out in ((t.data, host.data, dev.data), (t.scale, host.scale, dev.scale)):
                torch.index_select(src.view(u8), 0, flat, out=pinned.view(u8))
                out.copy_(pinned, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def _step(self, entries: dict, buffers: StepBuffers) -> torch.Tensor:
        if not self.capture:
            self.stats["eager"] += 1
            return self._body(entries)
        key = (tuple(sorted(entries.items())), buffers.cold, buffers.layout(), self._layout())
        if any(buffers.cold) and not CAPTURE_COLD:  # cold pages: static buffers, run eagerly
            self.stats["eager"] += 1
            return self._body(entries)
        hit = self.graphs.get(key)
        if hit == "eager":  # this shape syncs with the host: static buffers, run eagerly
            self.stats["eager"] += 1
            return self._body(entries)
        if hit is not None:
            self.graphs.move_to_end(key)
            hit[0].replay()
            self.stats["replayed"] += 1
            return hit[1]
        try:  # this step, run eagerly (compiles what the capture records); a host sync would break the capture
            with checks.host_syncs_raise():
                logits = self._body(entries)
        except RuntimeError as exc:
            if not checks.is_host_sync_error(exc):
                raise
            if self.model.parallel is not None:  # the ranks' collectives must line up: no lone fallback
                raise RuntimeError(f"cuda_graph: a decode step of this model syncs with the host and cannot be "
                                   f"captured with --tp / --ep; pass --no-cuda-graph ({exc})") from exc
            self.graphs[key] = "eager"
            self.stats["uncapturable"] = str(exc).splitlines()[0][:200]
            self.stats["eager"] += 1
            return self._body(entries)  # again, syncs allowed: the step's cache writes land in the same slots
        graph = torch.cuda.CUDAGraph()
        # with collectives, the process group's watchdog thread queries events during the capture
        mode = CAPTURE_ERROR_MODE if self.model.parallel is None else "thread_local"
        try:
            with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode=mode):
                out = self._body(entries)  # recorded, not run: the caches are written once
        except RuntimeError as exc:  # an operation a graph cannot record: this shape runs eagerly from now on
            if self.model.parallel is not None:
                raise
            self.graphs[key], self.stats["uncapturable"] = "eager", uncapturable(exc, "a decode step")
            self.stats["eager"] += 1
            return logits
        self.graphs[key] = (graph, out)
        self.stats["captured"] += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return logits

    def _layout(self) -> tuple:
        """Address and shape of this runner's own static buffers (the state's: StepBuffers.layout)."""
        tensors = [self.ids, self.engram_ids] + [t for _, dev in self.staged.values() for t in (dev.data, dev.scale)]
        return tuple((t.data_ptr(), tuple(t.shape)) for t in tensors if t is not None)
