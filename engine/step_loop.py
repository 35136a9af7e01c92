"""The serving engine's step loop (single-threaded): requests in, one scheduled step at a time, outputs out.

Each step runs what the :class:`~flashrt.engine.scheduler.Scheduler` planned: swapped sequences
come back, the decode batch (:class:`~flashrt.engine.slots.DecodeSlots`) runs one token per
running sequence, prefill chunks run in their sequences' own one-row states (a ``[1, S]`` forward
each: rows of one forward call share their length), then one batched sampling call covers every
sequence whose next token is due. A sequence whose prompt completes joins the decode batch; a
finished, aborted or failed one gives its pages back at once. Preempted sequences are swapped to
host memory (exact :class:`~flashrt.engine.snapshot.RowSnapshot`, up to ``swap_bytes``) or dropped
and recomputed (prompt chunks again, then the tokens they already produced fed back through
decode steps without sampling: the same computation, so the same tokens).

The prefill side lives in :mod:`~flashrt.engine.step_prefill` (a base class), the speculative
decode round in :func:`~flashrt.engine.spec_serve.decode_speculative`.
"""
from __future__ import annotations

import itertools
import logging
import random
import time

import torch

from flashrt.kv.util import to_device

from . import outputs
from .config import EngineConfig
from .errors import QueueFull, RequestError
from .limits import RequestLimits
from .request import Request, Sequence, Status
from .sampling import Sampled, SamplingParams, make_generator, sample_async
from .scheduler import Scheduler, pages_at
from .slots import DecodeSlots, MIN_ROWS
from .snapshot import PrefixStore, restore_row, snapshot_row
from .spec_serve import ServeSpeculator, decode_speculative
from .prefill_capture import PrefillStates
from .step_prefill import PrefillSteps
from .step_timing import COUNTERS, StepTimer

log = logging.getLogger("flashrt.engine")


def gather_rows(due: list) -> torch.Tensor:
    """The logits rows of ``due`` ``[(sequence, logits [rows, vocab], row)]`` as one ``[len(due),
    vocab]`` tensor: one gather per source tensor (the decode batch, each prefill group)."""
    parts, i = [], 0
    while i < len(due):
        src, j = due[i][1], i
        while j < len(due) and due[j][1] is src:
            j += 1
        rows = [r for _, _, r in due[i:j]]
        parts.append(src.index_select(0, to_device(rows, src.device)))
        i = j
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class StepLoop(PrefillSteps):
    """Requests, the scheduler, the decode batch and the prefix store of one engine; :meth:`step` runs one step."""

    overlap_steps = True  # a subclass whose steps must read their own tokens sets False

    def __init__(self, model, config: EngineConfig, tokenizer):
        self.model, self.cfg, self.config, self.tokenizer = model, model.cfg, config.resolve(model), tokenizer
        self.pool, self.max_pages = config.make_pool(model)
        self.P = self.pool.P
        self.spec = ServeSpeculator(model, config.draft_tokens) if config.speculative else None
        # positions a decode row may run in one step: the verify chunk's with speculation
        self.decode_tokens = model.cfg.dspark_block_size + 1 if self.spec else 1
        row_positions = config.reserve_pools(model, self.pool, config.max_model_len + self.decode_tokens)
        self.slots = DecodeSlots(model, self.pool, row_positions, config.graphs_on(model))
        self.scheduler = Scheduler(model.cfg, self.P, config.max_running, config.max_step_tokens,
                                   config.prefill_chunk, self.max_pages, self.decode_tokens)
        # prompt chunks of a few rows replayed from CUDA graphs in states reused request after request
        self.prefill_states = PrefillStates(model, self.pool, config.prefill_chunk,
                                            capture=None if config.prefill_graphs_on(model) else False)
        self.prefix = PrefixStore(config.prefill_chunk, config.prefix_cache_bytes, config.salt(model),
                                  config.prefix_disk(model))
        self.requests: dict[str, Request] = {}
        self.arrivals = itertools.count()
        self.rng = random.Random(config.seed)
        self.swap_used = 0
        self.counters = dict.fromkeys(("prompt_tokens", "generation_tokens", "preemptions", "swaps",
                                       "recomputes", "finished", "aborted", "failed", "steps", "decode_captures",
                                       "decode_replays", "decode_eager", "decode_fallbacks", "prefill_captures",
                                       "prefill_replays",
                                       *COUNTERS), 0)
        self.timer = StepTimer(model.device, config.device_timing)
        self.finish_hooks = []  # called with each finished Request
        self.limits = RequestLimits(model.cfg, self.config.max_model_len, self.P, self.max_pages)
        # drawn tokens read by the host one step late (step()); never with speculation (its rounds
        # read the tokens they verify) or in a subclass that shares each step's tokens (overlap_steps)
        self.overlap = self.config.overlap and self.spec is None and self.overlap_steps
        self.pending: tuple[list[Sequence], object] | None = None  # (sequences, SampleJob) not read yet
        self.trace = None  # a StepTrace (engine/step_trace.py) while FLASHRT_STEP_TRACE is set
        self.arrived = 0  # requests added since the last step (for the trace)

    # ----- requests --------------------------------------------------------------------------------
    def check(self, prompt: list[int], params: SamplingParams) -> int:
        """Validate a request; returns the tokens it may generate (:class:`RequestLimits`)."""
        return self.limits.check(prompt, params)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, images=None) -> Request:
        max_tokens = self.check(prompt, params)
        if request_id in self.requests:
            raise RequestError("request_id", f"expected a new id, got {request_id!r} (in use)")
        if self.config.max_waiting is not None and self.num_waiting >= self.config.max_waiting:
            raise QueueFull(f"the queue is full ({self.config.max_waiting} requests waiting)")
        req = Request(request_id, list(prompt), params, next(self.arrivals), max_tokens, images)
        req.seqs.append(Sequence(req, 0, self._generator(params, 0)))
        self.requests[request_id] = req
        self.scheduler.waiting.append(req.seqs[0])
        self.counters["prompt_tokens"] += len(prompt)
        self.arrived += 1
        return req

    def _generator(self, params: SamplingParams, index: int):
        if params.greedy:
            return None
        seed = params.seed + index if params.seed is not None else self.rng.getrandbits(63)
        return make_generator(seed, self.model.device)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            for seq in req.seqs:
                self._release(seq, "abort")
            self._finished(req, "aborted")
        return req

    @property
    def num_waiting(self) -> int:
        waiting = list(self.scheduler.waiting)  # one copy: the loop thread may change it meanwhile
        return sum(1 for s in waiting if s.status is Status.WAITING and s.index == 0 and not s.n_output)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # ----- one step ---------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduled step; returns the requests with new output.

        With ``overlap``, the tokens a step draws are read by the host in the next step, after that
        step's decode was launched from them on the device: the host work of step N (finish
        checks, text, outputs, scheduling N + 1) runs while the device runs step N + 1. A sequence
        that turns out to end with its token has had one more row computed for nothing. The
        pending tokens are read first instead when the next step could need a preemption (page
        limit) or none of their sequences can go on after them (they all end by length)."""
        sch = self.scheduler
        began = time.perf_counter()
        touched, due = set(), []  # due: (sequence, logits [rows, vocab], its row) to sample
        padding = self.slots.padding_need(pages_at(self.cfg, self.P, self.decode_tokens))
        if self.pending is not None and not self._may_run_ahead(padding):
            self._take_pending(touched)
            padding = self.slots.padding_need(pages_at(self.cfg, self.P, self.decode_tokens))
        plan = sch.schedule(self.pool.pages_in_use, padding, self._preempt, self._prepare)
        self.counters["steps"] += 1
        if plan.prefill:
            now = time.monotonic()
            for seq, _ in plan.prefill:
                if seq.request.scheduled_time is None:
                    seq.request.scheduled_time = now
        timer = self.timer.start()
        for seq in plan.swap_in:
            self._swap_in(seq)
        launched = None
        if plan.decode:
            timer.mark("decode")
            launched = self._decode(plan.decode, due, touched)
        if self.pending is not None:
            timer.mark("sample")  # the previous step's tokens: wait for them, then their host work
            self._take_pending(touched)
        if launched is not None:
            self._decoded(*launched, due)
        joins = []
        timer.mark("prefill")
        groups = plan.prefill_groups(MIN_ROWS)
        for group in groups:
            seqs = [s for s, _ in group if not s.finished]  # a request may have failed earlier in this step
            if not seqs:
                continue
            try:
                logits = self._prefill(seqs, group[0][1])
            except Exception as exc:  # noqa: BLE001 - the group's requests fail, the engine goes on
                for seq in seqs:
                    self._fail(seq.request, exc, touched)
                continue
            for i, seq in enumerate(seqs):
                if seq.computed == seq.prompt_len:
                    joins += self._fork(seq)
                    if seq.computed == len(seq.tokens):
                        due += [(s, logits, i) for s in self._family(seq)]
        timer.mark("sample")
        due = [d for d in due if not d[0].finished]  # a request may have failed or ended in this step
        if due:
            self._sample(due, touched)
        timer.mark("join")
        if joins:
            self._join(joins)
        host_ms, device_ms = timer.stop(self.counters, len(plan.decode), sum(n for _, n in plan.prefill))
        if self.trace is not None:
            self.trace.record(began, time.perf_counter(), len(plan.decode), [(len(g), g[0][1]) for g in groups],
                              len(sch.waiting), self.arrived, host_ms, device_ms, self.timer.allocs)
        self.arrived = 0
        return list(touched)

    def _decode(self, seqs: list[Sequence], due: list, touched: set):
        """Launch the decode batch's step: ``(logits, [(sequence, row)])``, or None when nothing is
        left to sample from it (a speculative round emitted its tokens, or the step failed)."""
        if self.spec is not None and decode_speculative(self, seqs, due, touched):
            return None
        drawn = None
        if self.pending is not None:  # rows whose token the previous step drew: read on the device
            index = {seq: i for i, seq in enumerate(self.pending[0])}
            drawn = (self.pending[1].tokens, {s.slot: index[s] for s in seqs if s in index})
        host = {s.slot: s.tokens[s.computed] for s in seqs if drawn is None or s.slot not in drawn[1]}
        try:
            logits = self.slots.step(host, drawn)
            g = self.slots.graph_steps
            self.counters.update(decode_captures=g["captured"], decode_replays=g["replayed"], decode_eager=g["eager"],
                                 decode_fallbacks=g["fallback"])
        except Exception as exc:  # noqa: BLE001 - the batch's state is suspect: its requests fail
            for req in {s.request for s in seqs}:
                self._fail(req, exc, touched)
            return None
        return logits, [(s, s.slot) for s in seqs]  # rows now: a sequence ending later may move the others

    def _decoded(self, logits: torch.Tensor, placed: list, due: list) -> None:
        """After the decode step (and the previous step's tokens, which may end sequences): who samples."""
        for seq, row in placed:
            seq.computed += 1
            if not seq.finished and seq.computed == len(seq.tokens):
                due.append((seq, logits, row))

    def _sample(self, due: list, touched: set) -> None:
        eos = self.config.eos_token_id
        job = sample_async(gather_rows(due), [seq.sampler_row(eos) for seq, _, _ in due])
        self.pending = ([seq for seq, _, _ in due], job)
        if not self.overlap:
            self._take_pending(touched)

    def _take_pending(self, touched: set) -> None:
        """The previous step's drawn tokens, read on the host and appended."""
        seqs, job = self.pending
        self.pending = None
        for seq, s in zip(seqs, job.result()):
            if not seq.finished:  # else its request failed or was aborted since
                self._emit(seq, s, touched)

    def _may_run_ahead(self, padding: int) -> bool:
        """Whether the next step may launch before the pending tokens are read: no preemption can
        be needed, and some pending sequence may go on after its token (not ending by length)."""
        seqs = [s for s in self.pending[0] if not s.finished]
        if not seqs or not self.scheduler.decode_fits(self.pool.pages_in_use, padding):
            return False
        limit = self.config.max_model_len
        return any(s.n_output + 1 < s.request.max_tokens and len(s.tokens) + 1 < limit for s in seqs)

    def _emit(self, seq: Sequence, s: Sampled, touched: set) -> bool:
        """Append a new token to ``seq``; True when the sequence ended with it."""
        seq.append(s)
        self.counters["generation_tokens"] += 1
        req = seq.request
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        outputs.check_finish(seq, self.tokenizer, self.config.eos_token_id, self.config.max_model_len)
        touched.add(req)
        if seq.finish_reason is None:
            return False
        self._release(seq, seq.finish_reason)
        if req.finished:
            self._finished(req, "finished")
        return True

    def _join(self, seqs: list[Sequence]) -> None:
        """Prefilled sequences (but those that already finished) become rows of the decode batch:
        one resize of the batch for all of them, their rows moved over together."""
        joining = []
        for seq in seqs:
            seq.forked_from = None
            if seq.status is Status.PREFILL:
                joining.append(seq)
        self.slots.add_many([(seq, seq.state, seq.row) for seq in joining])
        for seq in joining:
            seq.state, seq.status = None, Status.RUNNING
            self.scheduler.prefilling.remove(seq)
            self.scheduler.running.append(seq)

    # ----- preemption and release ------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.counters["preemptions"] += 1
        if seq.status is Status.RUNNING and self.swap_used < self.config.swap_bytes:
            seq.snapshot = snapshot_row(self.slots.state, seq.slot)
            self.swap_used += seq.snapshot.nbytes
            self.slots.remove(seq)
            seq.status = Status.SWAPPED
            self.counters["swaps"] += 1
            return
        if seq.status is Status.RUNNING:
            self.slots.remove(seq)
        else:
            seq.state.release_row(seq.row)
            seq.state = None
        seq.computed, seq.status, seq.prefix_snap, seq.looked_up = 0, Status.WAITING, None, False
        self.counters["recomputes"] += 1

    def _swap_in(self, seq: Sequence) -> None:
        state = self.model.new_state(1, len(seq.tokens) + self.decode_tokens, pool=self.pool)
        restore_row(seq.snapshot, state, 0)
        self.swap_used -= seq.snapshot.nbytes
        seq.snapshot = None
        self.slots.add(seq, state)
        seq.status = Status.RUNNING

    def _release(self, seq: Sequence, reason: str) -> None:
        """``seq`` ends: its pages, row and host snapshot go back, wherever it was."""
        if seq.status is Status.RUNNING:
            self.slots.remove(seq)
        if seq.state is not None:  # prefilling (or failed while starting)
            seq.state.release_row(seq.row)
            seq.state = None
        if seq.snapshot is not None:
            self.swap_used -= seq.snapshot.nbytes
            seq.snapshot = None
        self.scheduler.remove(seq)
        outputs.finish(seq, reason)

    def _fail(self, req: Request, exc: Exception, touched: set) -> None:
        log.error("request %s failed: %s", req.id, exc)
        req.error = f"{type(exc).__name__}: {exc}"
        for seq in req.seqs:
            self._release(seq, "error")
        self.requests.pop(req.id, None)
        self._finished(req, "failed")
        touched.add(req)

    def _finished(self, req: Request, counter: str) -> None:
        self.requests.pop(req.id, None)
        req.finish_time = time.monotonic()
        self.counters[counter] += 1
        for hook in self.finish_hooks:
            hook(req)
