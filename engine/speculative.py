"""DSpark speculative decoding: draft -> verify in one forward -> accept -> keep only what was accepted.

Each round, for a batch whose rows sit at their own positions with one sampled token ``next`` not
run yet: the draft layers propose ``block_size`` tokens after ``next`` (``Drafts.draft``); the
target runs ``[next, d_1 .. d_k]`` (``k`` <= block size, fixed or chosen per round by
:mod:`flashrt.engine.adaptive`) as ONE chunk of ``k + 1`` tokens per row from each row's position;
:mod:`flashrt.engine.accept` decides per row how many drafts stand (ragged across the batch) and
the token after them. The state then keeps only the accepted tokens: ``KVState.advance`` with one
count per row commits the rings (backbone and draft), the compressor's pending group and the Engram
history up to there and gives back pages reserved past it; the compressed entries the chunk wrote
beyond are never read before they are rewritten. A round with ``k = 0`` is a plain decode step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flashrt import ops

from . import accept, adaptive

SPECULATIVE = ("dspark",)


@dataclass
class SpecStats:
    """What a speculative run did: rounds (verify steps, ``k`` >= 1), tokens drafted and accepted
    over all rows, plain decode steps (``k`` = 0), and time spent drafting and verifying."""

    rounds: int = 0
    row_rounds: int = 0  # rounds x rows in the batch
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    k_counts: dict = field(default_factory=dict)  # k -> rounds run with it

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a row gains per verify step: accepted drafts + the target's own token."""
        return (self.accepted + self.row_rounds) / self.row_rounds if self.row_rounds else 0.0

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "plain_steps": self.plain_steps, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length, "draft_seconds": self.draft_seconds,
                "verify_seconds": self.verify_seconds, "k_counts": dict(sorted(self.k_counts.items()))}


def check_options(model, speculative, draft_tokens):
    """``speculative`` / ``draft_tokens`` as given to :func:`flashrt.generate`, checked; returns
    ``draft_tokens`` as an int or ``"auto"``."""
    return check_config(model.cfg, model.drafts is not None, speculative, draft_tokens)


def check_config(cfg, has_drafts: bool, speculative, draft_tokens):
    """:func:`check_options` against a model's config (``has_drafts``: its draft layers are loaded),
    so that a multi-device run refuses bad options before any rank loads the model."""
    if speculative is None:
        return None
    if speculative not in SPECULATIVE:
        raise ValueError(f"speculative: expected one of {list(SPECULATIVE)} or None, got {speculative!r}")
    block = cfg.dspark_block_size
    if not has_drafts or not block:
        raise ValueError("speculative: the model has no DSpark draft layers (dspark_block_size = 0 or no mtp.* "
                         "weights); run it without speculative decoding (speculative=None / no --speculative)")
    if draft_tokens is None or draft_tokens == "auto":
        return "auto"
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= block:
        raise ValueError(f"draft_tokens: expected an int in [1, {block}] (the draft's block size) or 'auto', "
                         f"got {draft_tokens!r}")
    return draft_tokens


def verify(model, state, ids: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Run ``ids`` [B, k + 1] as one chunk from each row's position; nothing is kept until
    :func:`keep`. Returns (fp32 logits [B, k + 1, V], the step context)."""
    ctx = model.context(ids, state)
    return model.run(ids, ctx, all_positions=True), ctx


def keep(model, state, ids: torch.Tensor, counts: torch.Tensor, counted: list[int] | None = None) -> None:
    """After :func:`verify` of ``ids``: row ``b`` keeps its first ``counts[b]`` tokens
    (``counted``: the same counts on the host, when the caller has them)."""
    history = accept.engram_history(model, state.engram_history, ids, counts)
    state.advance(counts.tolist() if counted is None else counted, history)


class Decoder:
    """The speculative decode loop over one batch (a :class:`~flashrt.kv.state.KVState` after
    prefill). ``draft_tokens``: ``k`` per round (int) or ``"auto"``; ``force_accept``: accept every
    draft (benchmarks only: the output is then not the target's); ``verifier``: runs the verify
    forward and commits its kept tokens (``verifier.verify(ids)``, ``verifier.keep(ids, counts)``,
    e.g. :class:`~flashrt.engine.verify_capture.VerifyCapture`; default: eager :func:`verify` and
    :func:`keep`); ``drafter``: runs the draft (``drafter.draft(next_ids, state,
    temperature, generator)``, e.g. :class:`~flashrt.engine.draft_capture.DraftCapture`);
    ``plain``: runs the one-token step of a round with ``k = 0`` (``plain.step(next_ids)`` ->
    logits, the state advanced; e.g. :class:`~flashrt.engine.step_capture.StepCapture`)."""

    def __init__(self, model, state, temperature: float = 0.0, generator=None, draft_tokens="auto",
                 force_accept: bool = False, costs=None, verifier=None, drafter=None, plain=None):
        self.model, self.state, self.temperature, self.generator = model, state, temperature, generator
        self.plain = plain  # e.g. engine/step_capture.StepCapture: k = 0 rounds from CUDA graphs
        self.verifier = verifier  # e.g. engine/verify_capture.VerifyCapture: verify steps from CUDA graphs
        self.drafter = drafter  # e.g. engine/draft_capture.DraftCapture (default: model.drafts)
        self.draft_tokens, self.force_accept = draft_tokens, force_accept
        self.block = model.cfg.dspark_block_size
        self.costs = costs or adaptive.CostCurve.for_model(model)
        self.stats = SpecStats()
        self._sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def step(self, next_ids: torch.Tensor, limit: int) -> tuple[list[list[int]], torch.Tensor]:
        """One round after ``next_ids`` [B] (sampled, not run yet) emitting at most ``limit`` tokens
        per row: (per row the new tokens after ``next_ids``, ending with the next ``next_ids``)."""
        if limit <= 1:
            return self._plain(next_ids)
        t0 = time.perf_counter()
        drafts, logits, confidence = (self.drafter or self.model.drafts).draft(next_ids, self.state, self.temperature,
                                                                          self.generator)
        k = self._choose(confidence, limit - 1)
        self._sync()
        t1 = time.perf_counter()
        self.stats.draft_seconds += t1 - t0
        if k == 0:
            return self._plain(next_ids)
        ids = drafts[:, :k + 1]
        target = self.verifier.verify(ids) if self.verifier is not None else verify(self.model, self.state, ids)[0]
        accepted, after = self._accept(drafts[:, 1:k + 1], logits[:, :k], target)
        if self.verifier is not None:  # the captured verifier commits from graphs too
            self.verifier.keep(ids, accepted + 1)
        else:
            keep(self.model, self.state, ids, accepted + 1)
        self._sync()
        s = self.stats
        s.verify_seconds += time.perf_counter() - t1
        s.rounds, s.row_rounds, s.drafted = s.rounds + 1, s.row_rounds + ids.shape[0], s.drafted + k * ids.shape[0]
        s.accepted += int(accepted.sum())
        s.k_counts[k] = s.k_counts.get(k, 0) + 1
        rows = ids[:, 1:].tolist()
        emitted = [row[:a] + [t] for row, a, t in zip(rows, accepted.tolist(), after.tolist())]
        return emitted, after

    def _choose(self, confidence: torch.Tensor, most: int) -> int:
        if self.draft_tokens != "auto":
            return min(self.draft_tokens, most)
        return adaptive.agreed(self.model, adaptive.choose_k(confidence[:, :most], self.costs, confidence.shape[0]))

    def _accept(self, drafts, draft_logits, target):
        if self.force_accept:
            return accept.forced(drafts, target, self.temperature, self.generator)
        if self.temperature == 0:
            return accept.greedy(drafts, target)
        return accept.rejection(drafts, draft_logits, target, self.temperature, self.generator)

    def _plain(self, next_ids: torch.Tensor):
        """A plain decode step (``k`` = 0): run ``next_ids`` and sample the token after it."""
        t0 = time.perf_counter()
        if self.plain is not None:
            logits = self.plain.step(next_ids)
        else:
            logits = self.model.forward(next_ids.unsqueeze(1), state=self.state)
        after = ops.sample(logits, self.temperature, self.generator)
        self._sync()
        self.stats.verify_seconds += time.perf_counter() - t0
        self.stats.plain_steps += 1
        return [[t] for t in after.tolist()], after


def decode(model, state, first_logits: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
           generator=None, eos_token_id: int | None = None, draft_tokens="auto", progress=None,
           force_accept: bool = False, costs=None, cuda_graph: bool = False,
           runners=None) -> tuple[list[list[int]], SpecStats]:
    """Decode up to ``max_new_tokens`` tokens per row of ``state`` (prefilled; ``first_logits``
    [B, V] the logits after it) with speculation; rows stop at ``eos_token_id``. Returns (new
    tokens per row, stats). The state must have room for ``max_new_tokens + block_size`` more
    positions per row (it grows on demand otherwise). ``cuda_graph``: draft, verify and ``k = 0``
    steps from static buffers (:class:`~flashrt.engine.spec_capture.SpecRunners`), CUDA-graph
    replays on a GPU; ``runners``: those runners, built by the caller (implies ``cuda_graph``)."""
    if cuda_graph and runners is None:
        from .spec_capture import SpecRunners

        runners = SpecRunners(model, state)
    steps = {} if runners is None else {"verifier": runners.verifier, "drafter": runners.drafter,
                                        "plain": runners.plain}
    dec = Decoder(model, state, temperature, generator, draft_tokens, force_accept, costs, **steps)
    report = progress or (lambda phase, done, total: None)
    next_ids = ops.sample(first_logits, temperature, generator)
    out = [[t] for t in next_ids.tolist()]
    done = [eos_token_id is not None and t == eos_token_id for t in next_ids.tolist()]
    while True:
        need = [max_new_tokens - len(o) for o, d in zip(out, done) if not d]
        report("decode", max_new_tokens - max(need, default=0), max_new_tokens)
        if not need or max(need) <= 0:
            return out, dec.stats
        emitted, next_ids = dec.step(next_ids, max(need))
        for row, new in enumerate(emitted):
            for t in new:
                if done[row] or len(out[row]) >= max_new_tokens:
                    break
                out[row].append(t)
                done[row] = eos_token_id is not None and t == eos_token_id
