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
from .sampling import Sampled, SamplingParams, make_generator, sample
from .scheduler import Scheduler, pages_at
from .slots import DecodeSlots, MIN_ROWS
from .snapshot import PrefixStore, restore_row, snapshot_row
from .spec_serve import ServeSpeculator, decode_speculative
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
        self.prefix = PrefixStore(config.prefill_chunk, config.prefix_cache_bytes, config.salt(model),
                                  config.prefix_disk(model))
        self.requests: dict[str, Request] = {}
        self.arrivals = itertools.count()
        self.rng = random.Random(config.seed)
        self.swap_used = 0
        self.counters = dict.fromkeys(("prompt_tokens", "generation_tokens", "preemptions", "swaps",
                                       "recomputes", "finished", "aborted", "failed", "steps", "decode_captures",
                                       "decode_replays", "decode_eager", "decode_fallbacks",
                                       *COUNTERS), 0)
        self.timer = StepTimer(model.device, config.device_timing)
        self.finish_hooks = []  # called with each finished Request
        self.limits = RequestLimits(model.cfg, self.config.max_model_len, self.P, self.max_pages)

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
        """Run one scheduled step; returns the requests with new output."""
        sch = self.scheduler
        padding = self.slots.padding_need(pages_at(self.cfg, self.P, self.decode_tokens))
        plan = sch.schedule(self.pool.pages_in_use, padding, self._preempt, self._prepare)
        self.counters["steps"] += 1
        touched, due = set(), []  # due: (sequence, logits [rows, vocab], its row) to sample
        timer = self.timer.start()
        for seq in plan.swap_in:
            self._swap_in(seq)
        if plan.decode:
            timer.mark("decode")
            self._decode(plan.decode, due, touched)
        joins = []
        timer.mark("prefill")
        for group in plan.prefill_groups(MIN_ROWS):
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
        if due:
            self._sample(due, touched)
        if joins:  # one resize of the decode batch for every sequence joining it
            self.slots.make_room(sum(1 for s in joins if s.status is Status.PREFILL))
        for seq in joins:
            self._join(seq, touched)
        timer.stop(self.counters, len(plan.decode), sum(n for _, n in plan.prefill))
        return list(touched)

    def _decode(self, seqs: list[Sequence], due: list, touched: set) -> None:
        if self.spec is not None and decode_speculative(self, seqs, due, touched):
            return
        try:
            logits = self.slots.step({s.slot: s.tokens[s.computed] for s in seqs})
            g = self.slots.graph_steps
            self.counters.update(decode_captures=g["captured"], decode_replays=g["replayed"], decode_eager=g["eager"],
                                 decode_fallbacks=g["fallback"])
        except Exception as exc:  # noqa: BLE001 - the batch's state is suspect: its requests fail
            for req in {s.request for s in seqs}:
                self._fail(req, exc, touched)
            return
        for seq in seqs:
            seq.computed += 1
            if seq.computed == len(seq.tokens):
                due.append((seq, logits, seq.slot))

    def _sample(self, due: list, touched: set) -> None:
        eos = self.config.eos_token_id
        logits = gather_rows(due)
        for (seq, _, _), s in zip(due, sample(logits, [seq.sampler_row(eos) for seq, _, _ in due])):
            if not seq.finished:  # else its request failed earlier in this step
                self._emit(seq, s, touched)

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

    def _join(self, seq: Sequence, touched: set) -> None:
        """A prefilled sequence (unless it already finished) becomes a row of the decode batch."""
        seq.forked_from = None
        if seq.status is not Status.PREFILL:
            return
        self.slots.add(seq, seq.state, seq.row)
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
