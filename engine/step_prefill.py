"""The prefill side of the serving engine's step loop: prefix lookups, prompt chunks run as one
forward per group (a ``[rows, n]`` call in a state of one row per sequence), rows moved between
states, and the ``n - 1`` forks of a request whose prompt is done.

:class:`PrefillSteps` is a base of :class:`~flashrt.engine.step_loop.StepLoop`: its methods read
the loop's model, pool, scheduler, prefix store and counters.
"""
from __future__ import annotations

import torch

from flashrt import checks
from flashrt.kv.util import to_device

from .images import chunk_spans, image_keys
from .request import Sequence, Status
from .snapshot import restore_row, snapshot_row


class PrefillSteps:
    def _prepare(self, seq: Sequence) -> None:
        """Before a waiting sequence is costed: the longest cached prefix of its prompt."""
        if not seq.looked_up and self.prefix.max_bytes > 0:
            seq.looked_up = True
            length, snap = self.prefix.lookup(seq.tokens[:seq.prompt_len], image_keys(seq.request.images))
            if snap is not None:
                seq.prefix_snap, seq.computed = snap, length

    def _prefill(self, seqs: list[Sequence], n: int) -> torch.Tensor:
        """One forward call over the next ``n`` prompt tokens of ``seqs`` (all at the same position):
        logits ``[len(seqs), vocab]``. A lone sequence continues in its own one-row state; a group
        runs in a fresh state of one row per sequence, each taking its row over (pages change owner,
        nothing is recomputed)."""
        if len(seqs) == 1 and seqs[0].state is not None and seqs[0].state.batch == 1:
            state = seqs[0].state
        else:
            state = None
            if self.prefill_states.wants(len(seqs), n):
                state = self.prefill_states.state_for(len(seqs), self._holds_sequence)
            if state is None:
                state = self.model.new_state(len(seqs), max(len(s.tokens) for s in seqs) + n, pool=self.pool)
            for row, seq in enumerate(seqs):
                self._enter(seq, state, row)
        ids = to_device([s.tokens[s.computed:s.computed + n] for s in seqs], self.model.device)
        spans = None
        if len(seqs) == 1:  # a prompt with images always runs alone (Plan.prefill_groups)
            seq = seqs[0]
            spans = chunk_spans(self.model, seq.request.images, seq.prompt_len, seq.computed, seq.computed + n)
        runner = self.prefill_states.runner(state) if spans is None else None
        with checks.value_checks(False):  # the prompt's ids were checked on the host when it was added
            if runner is not None:
                captured, replayed = runner.stats["captured"], runner.stats["replayed"]
                logits = runner.forward(ids)
                self.counters["prefill_captures"] += runner.stats["captured"] - captured
                self.counters["prefill_replays"] += runner.stats["replayed"] - replayed
            else:
                logits = self.model.forward(ids, state=state, spans=spans)
        self.counters["prefill_forwards"] += 1
        self.timer.mark("prefix")
        for seq in seqs:
            seq.computed += n
            key = self.prefix.wants(seq.tokens, seq.computed, image_keys(seq.request.images))
            if key is not None and seq.computed <= seq.prompt_len:
                self.prefix.put(key, snapshot_row(state, seq.row))
        self.timer.mark("prefill")
        return logits

    def _holds_sequence(self, state) -> bool:
        """Whether a sequence of this engine has its rows in ``state`` (a reusable prefill state is free otherwise)."""
        return any(s.state is state for req in self.requests.values() for s in req.seqs)

    def _enter(self, seq: Sequence, state, row: int) -> None:
        """``seq`` continues in ``row`` of ``state``: a new sequence starts there (from its cached
        prefix, if any), a prefilling one moves its row over."""
        if seq.status is Status.WAITING:
            snap = seq.prefix_snap
            if snap is not None:
                restore_row(snap, state, row)
                seq.prefix_snap = None
                if seq.index == 0 and not seq.n_output:
                    seq.request.prefix_hit_tokens = snap.position
            seq.status = Status.PREFILL
        else:
            state.take_row(row, seq.state, seq.row)
        seq.state, seq.row = state, row

    def _family(self, seq: Sequence) -> list[Sequence]:
        """``seq`` and the sequences forked from it in this step (they share its logits)."""
        return [s for s in seq.request.seqs if s is seq or s.forked_from is seq]

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Prompt done: the request's other ``n - 1`` sequences start from a copy of this state."""
        req, out = seq.request, [seq]
        if seq.index == 0 and len(req.seqs) == 1 and req.params.n > 1:
            snap = snapshot_row(seq.state, seq.row)
            for i in range(1, req.params.n):
                child = Sequence(req, i, self._generator(req.params, i))
                child.state = self.model.new_state(1, len(seq.tokens), pool=self.pool)
                restore_row(snap, child.state, 0)
                child.computed, child.status, child.forked_from = seq.computed, Status.PREFILL, seq
                req.seqs.append(child)
                self.scheduler.prefilling.append(child)
                out.append(child)
        return out
