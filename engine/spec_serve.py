"""Speculative rounds over the serving engine's decode batch (``EngineConfig(speculative="dspark")``).

One round over the batch's :class:`~flashrt.kv.state.KVState` (every row at its own position, its
``next`` token not run yet): the draft layers propose ``block_size`` tokens per row (greedily: the
draft's argmax, so each draft is a point mass ``q = 1[d]``), ``k`` of them are verified in one
target forward of ``k + 1`` tokens per row, and each row keeps what its own acceptance rule
accepts (:func:`flashrt.engine.speculative.keep`).

Rows accept under their own sampling parameters. The target's distribution of a row is processed
exactly as the engine's sampler does it (``temperature``, then ``min_p``, ``top_k``, ``top_p``:
:func:`flashrt.engine.sampling.filter_logits`); with the point-mass draft, the standard rule
reads: accept ``d`` with probability ``p(d)``, at the first rejection draw from ``p`` without
``d`` (renormalized), after ``k`` acceptances draw the bonus from ``p``. Every emitted token then
follows ``p``, the distribution the plain sampler draws from (lossless), with the row's own
generator. Greedy rows keep the longest prefix equal to the target's argmax.

Rows that cannot speculate exactly (``speculative_row``: penalties, logprobs, stop ids still
banned by ``min_tokens``, a recompute feeding known tokens) and the batch's padding rows verify no
draft: they keep the chunk's first token, and the logits after it (``logits0``) are sampled by
the engine's ordinary sampler, as a plain decode step would.

When the decode batch's steps are captured (``EngineConfig.cuda_graphs``, by default on CUDA), the
draft and verify run from static buffers, one set of runners per batch bucket's state
(:class:`~flashrt.engine.spec_capture.SpecRunners`); a round with ``k = 0`` leaves the plain step
to the batch's own :class:`~flashrt.engine.step_capture.StepCapture`.
"""
from __future__ import annotations

import time

import torch

from flashrt import ops
from flashrt.kv.util import to_device

from . import accept, adaptive
from .sampling import Sampled, SamplerRow, filter_logits
from .spec_capture import COUNTS, SpecRunners
from .speculative import SpecStats, keep, verify


def speculative_row(seq, row: SamplerRow) -> bool:
    """Whether ``seq`` may take drafted tokens this step (else it decodes one token, exactly as
    without speculation)."""
    p = row.params
    return (not p.penalized and p.logprobs is None and not row.banned
            and seq.computed + 1 == len(seq.tokens))


def processed_probs(target: torch.Tensor, params) -> torch.Tensor:
    """fp32 [S, V]: the sampler's distribution for ``params`` over each row of ``target`` [S, V]."""
    S, dev = target.shape[0], target.device
    z = target.to(torch.float32) / params.temperature
    filt = filter_logits(z, torch.full((S,), max(params.top_k, 0), device=dev),
                         torch.full((S,), float(params.top_p), device=dev),
                         torch.full((S,), float(params.min_p), device=dev))
    return torch.softmax(filt, dim=-1)


def accept_sampled(drafts: torch.Tensor, target: torch.Tensor, row: SamplerRow) -> tuple[int, int]:
    """One sampling row: ``drafts`` int64 [k] (point-mass proposals), ``target`` fp32 [k + 1, V]
    -> (accepted drafts, the token after them)."""
    k = drafts.shape[0]
    p = processed_probs(target, row.params)
    gen = row.generator
    u = torch.rand(k, generator=gen, device=gen.device if gen is not None else p.device).to(p.device)
    ok = u < p[torch.arange(k, device=p.device), drafts]
    a = int(accept.leading_true(ok.unsqueeze(0))[0])
    if a < k:
        residual = p[a].clone()
        residual[drafts[a]] = 0
        dist = torch.where(residual.sum() > 0, residual, p[a])  # p a point mass on the draft: any draw from p
    else:
        dist = p[k]
    return a, int(ops.sample(dist.log().unsqueeze(0), 1.0, gen)[0])


class ServeSpeculator:
    """Speculative rounds for one engine; ``stats`` (:class:`SpecStats`) sums over its rounds.

    With static steps (``round(..., graphs=True)``) the draft and verify run through
    :class:`~flashrt.engine.spec_capture.SpecRunners` of the batch state, one set per batch bucket
    (the decode batch keeps a state per bucket: its graphs replay whenever the batch returns to that
    size). ``capture`` / ``record``: passed to the runners (None: CUDA graphs on a GPU)."""

    def __init__(self, model, draft_tokens):
        self.model, self.draft_tokens = model, draft_tokens
        self.block = model.cfg.dspark_block_size
        self.costs = adaptive.CostCurve.for_model(model)
        self.stats = SpecStats()
        self.capture, self.record = None, None
        self.runners: dict = {}  # batch rows -> SpecRunners of that bucket's state
        self._sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def runners_for(self, state):
        """The static draft and verify steps of ``state`` (made afresh when the bucket's state changed)."""
        r = self.runners.get(state.batch)
        if r is None or r.state is not state:
            r = self.runners[state.batch] = SpecRunners(self.model, state, self.capture, self.record, plain=False)
        return r

    def capture_stats(self) -> dict:
        """Draft and verify steps captured / replayed / eager / unbuffered, over every bucket."""
        out = dict.fromkeys(COUNTS, 0)
        for r in self.runners.values():
            for k, v in r.stats().items():
                if k in out:
                    out[k] += v
        return out

    def round(self, state, next_ids: torch.Tensor, rows: dict[int, SamplerRow], most: int, graphs: bool = False):
        """Draft and verify up to ``most`` tokens for the batch rows in ``rows`` (row -> its
        sampler row); every other row verifies none. Returns None when the round chose ``k = 0``
        (nothing ran on the target: the caller runs a plain step), else (kept tokens per row,
        ``logits0`` [rows, V] after each row's first token, {row: tokens emitted after ``next``}).
        ``graphs``: draft and verify from static buffers (:meth:`runners_for`)."""
        t0 = time.perf_counter()
        run = self.runners_for(state) if graphs else None
        ids, _, confidence = (run.drafter if run else self.model.drafts).draft(next_ids, state, 0.0, None)
        spec = sorted(rows)
        k = self._choose(confidence[spec], min(most, self.block), state.batch)
        self._sync()
        t1 = time.perf_counter()
        self.stats.draft_seconds += t1 - t0
        if k == 0:
            self.stats.plain_steps += 1
            return None
        chunk = ids[:, :k + 1]
        target = run.verifier.verify(chunk) if run else verify(self.model, state, chunk)[0]
        drafts = chunk[:, 1:]
        counts = [1] * state.batch
        emitted = {}
        draft_rows = drafts.tolist()  # one device->host copy for every row
        greedy = [r for r in spec if rows[r].params.greedy]
        if greedy:
            idx = to_device(greedy, target.device)
            acc, after = accept.greedy(drafts[idx], target[idx])
            for r, a, t in zip(greedy, acc.tolist(), after.tolist()):
                counts[r], emitted[r] = a + 1, draft_rows[r][:a] + [t]
        for r in spec:
            if r not in emitted:
                a, t = accept_sampled(drafts[r], target[r], rows[r])
                counts[r], emitted[r] = a + 1, draft_rows[r][:a] + [t]
        kept = to_device(counts, chunk.device)
        if run is not None:  # the captured verifier commits from graphs too
            run.verifier.keep(chunk, kept)
        else:
            keep(self.model, state, chunk, kept)
        self._sync()
        s = self.stats
        s.verify_seconds += time.perf_counter() - t1
        s.rounds, s.row_rounds, s.drafted = s.rounds + 1, s.row_rounds + len(spec), s.drafted + k * len(spec)
        s.accepted += sum(counts[r] - 1 for r in spec)
        s.k_counts[k] = s.k_counts.get(k, 0) + 1
        return counts, target[:, 0], emitted

    def _choose(self, confidence: torch.Tensor, most: int, batch: int) -> int:
        if most <= 0:
            return 0
        if self.draft_tokens != "auto":
            return min(self.draft_tokens, most)
        return adaptive.agreed(self.model, adaptive.choose_k(confidence[:, :most], self.costs, batch))


def decode_speculative(loop, seqs: list, due: list, touched: set) -> bool:
    """One speculative round over the decode batch of ``loop`` (a
    :class:`~flashrt.engine.step_loop.StepLoop`); False when it ran nothing on the target (no row
    may speculate, or ``k = 0``): a plain step follows. Rows that took no drafts go to ``due``
    with the logits after their first token, as a plain step's would."""
    eos, limit, slots = loop.config.eos_token_id, loop.config.max_model_len, loop.slots
    rows = {s.slot: s.sampler_row(eos) for s in seqs}
    rows = {s.slot: rows[s.slot] for s in seqs if speculative_row(s, rows[s.slot])}
    if not rows:
        return False
    # drafts no row can use are not verified; no row's chunk may run past the context
    want = max(s.request.max_tokens - s.n_output for s in seqs if s.slot in rows) - 1
    most = min([want] + [limit - 1 - s.computed for s in seqs])
    if most <= 0:
        return False
    state = slots.state
    try:
        out = loop.spec.round(state, slots.ids({s.slot: s.tokens[s.computed] for s in seqs}), rows, most,
                              slots.cuda_graph)
    except Exception as exc:  # noqa: BLE001 - the batch's state is suspect: its requests fail
        for req in {s.request for s in seqs}:
            loop._fail(req, exc, touched)
        return True
    if out is None:
        return False
    counts, logits0, emitted = out
    state.rewind_rows([r for r, o in enumerate(slots.owner) if o is None])
    placed = [(seq, seq.slot) for seq in seqs]  # a sequence ending below may move the others' rows
    for seq, row in placed:
        seq.computed += counts[row]
    for seq, row in placed:
        if row in emitted:
            for t in emitted[row]:  # tokens past a stop are dropped: the sequence ends there
                if seq.finished or loop._emit(seq, Sampled(t), touched):
                    break
        elif seq.computed == len(seq.tokens):
            due.append((seq, logits0, row))
    return True
