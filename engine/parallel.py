"""Generation on one rank of a multi-device run, in lockstep with every other rank (docs/parallel.md).

Every rank holds the same prompts (rank 0 broadcasts them) and derives the same plan from them:
group ``g`` (the ``tp`` ranks of one expert-parallel slot) runs the sequences ``i % ep == g``;
their prompts are prefilled in rounds of one forward call each (equal lengths together, in
``prefill_chunk`` pieces, as :func:`flashrt.engine.generation.generate` does), then every group
decodes one token per sequence per step. The MoE layers of a round exchange every group's tokens,
so a group with nothing to run in a round still serves its experts (:func:`idle_step`). After each
step every rank learns every group's sampled tokens (the group leader's, through one all-gather),
so all ranks agree on what comes next and when to stop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flashrt import distributed, ops
from flashrt.kv.state import KVState

from .generation import _as_sequences, profile_kv_sizes
from .step_capture import StepCapture


@dataclass(frozen=True)
class Forward:
    """One prefill call of a group: prompt ``rows`` (all of one length), tokens ``[start, stop)``."""

    rows: tuple[int, ...]
    start: int
    stop: int
    last: bool  # the prompt's last chunk: its logits are the first decode step's

    @property
    def tokens(self) -> int:
        return len(self.rows) * (self.stop - self.start)


def group_plan(seqs: list[list[int]], rows: list[int], chunk: int | None) -> list[Forward]:
    """The prefill calls of one group's ``rows``: equal lengths together, shortest first, in chunks."""
    out = []
    for length in sorted({len(seqs[i]) for i in rows}):
        same = tuple(i for i in rows if len(seqs[i]) == length)
        step = chunk or length
        out += [Forward(same, c0, min(c0 + step, length), c0 + step >= length) for c0 in range(0, length, step)]
    return out


@dataclass
class ParallelResult:
    tokens: list[list[int]]  # new tokens of every prompt, in prompt order (the same on every rank)
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    rows: list[int] = field(default_factory=list)  # the prompts this rank's group ran, in its row order
    first_logits: torch.Tensor | None = field(repr=False, default=None)  # [len(rows), vocab] after prefill
    step_logits: list = field(repr=False, default_factory=list)  # decode steps' logits (keep_logits)
    load: list = field(default_factory=list)  # per forward round: (token, expert) pairs per ep rank
    state: KVState | None = field(repr=False, default=None)
    step_capture: dict | None = None  # captured / replayed / eager step counts (cuda_graph or static_steps)
    image_tokens: int = 0  # prompt tokens in image spans (flashrt run --image: engine/parallel_whole.py)
    speculative: dict | None = None  # SpecStats.as_dict() of a speculative run (engine/parallel_whole.py)


def idle_step(model) -> None:
    """A forward round in which this group has no tokens: serve the other groups' tokens in every
    MoE layer (the layers' collectives need every rank)."""
    empty = torch.empty(0, 1, model.cfg.dim, dtype=model.embed.dtype, device=model.device)
    for block in model.blocks:
        block.ffn.forward(empty)


def _exchange(par, tokens: torch.Tensor, orders: list[list[int]]) -> dict[int, int]:
    """Prompt index -> its new token, for every group: each group's leader's samples, gathered."""
    width = max(1, max(map(len, orders)))
    buf = torch.full((width,), -1, dtype=torch.long, device=tokens.device)
    buf[: tokens.numel()] = tokens
    every = distributed.all_gather(buf).view(-1, width).tolist()
    out = {}
    for g, order in enumerate(orders):
        out.update(zip(order, every[par.layout.leader(g)][: len(order)]))
    return out


def parallel_generate(model, prompts, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
                      eos_token_id: int | None = None, prefill_chunk: int | None = None,
                      kv_budget: int | None = None, kv_page_entries: int | None = None, keep_logits: bool = False,
                      progress=None, cuda_graph: bool | None = None, static_steps: bool = False) -> ParallelResult:
    """:func:`~flashrt.engine.generation.generate` for a model built with a
    :class:`~flashrt.graphs.parallel.Parallel` context; every rank calls it with the same arguments.
    Exact prefill only. ``kv_budget``: device bytes for this rank's share of the KV state (its
    group's sequences); ``kv_page_entries`` and ``progress(phase, done, total)`` as for generate.
    ``cuda_graph`` (default: on CUDA devices): decode steps replayed from CUDA graphs
    (:class:`~flashrt.engine.step_capture.StepCapture`, fixed-shape MoE dispatch); ``static_steps``:
    the same static-buffer steps run eagerly (on any device; how CPU tests check them)."""
    par = model.parallel
    if par is None:
        raise ValueError("model: expected a model built with a parallel context (graphs.parallel.Parallel)")
    if par.dispatch == "replicated":
        raise ValueError("model: the 'replicated' MoE dispatch is for engines that run every sequence on every "
                         "group (flashrt serve); parallel_generate spreads them: use 'gather' or 'all_to_all'")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if cuda_graph is None:
        cuda_graph = model.device.type == "cuda"
    if cuda_graph and model.device.type != "cuda":
        raise ValueError(f"cuda_graph: CUDA graphs need a CUDA device, the model is on {model.device}")
    seqs, layout = _as_sequences(prompts), par.layout
    plans = [group_plan(seqs, layout.for_rank(layout.leader(g)).sequences(len(seqs)), prefill_chunk)
             for g in range(layout.ep)]
    run = _Run(model, seqs, plans, max_new_tokens, progress or (lambda *a: None))
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    try:
        t0 = time.perf_counter()
        first = run.prefill(kv_budget, kv_page_entries)
        sync()
        t1 = time.perf_counter()
        generator = None if seed is None else torch.Generator(device=model.device).manual_seed(seed)
        steps = "graph" if cuda_graph else ("static" if static_steps else None)
        out = run.decode(first, temperature, generator, eos_token_id, keep_logits, steps)
        sync()
        t2 = time.perf_counter()
    finally:
        par.counts = None
    return ParallelResult(out, sum(map(len, seqs)), sum(map(len, out)), t1 - t0, t2 - t1, run.rows, first,
                          run.kept, run.load, run.state, run.capture_stats)


class _Run:
    """One rank's part of :func:`parallel_generate`: its group's states and the rounds it takes part in."""

    def __init__(self, model, seqs, plans, max_new_tokens: int, report):
        self.model, self.par, self.seqs, self.plans, self.report = model, model.parallel, seqs, plans, report
        self.orders = [[i for f in plan if f.last for i in f.rows] for plan in plans]
        self.rows = self.orders[self.par.layout.ep_rank]
        self.capacity = max(map(len, seqs)) + max_new_tokens
        self.max_new_tokens = max_new_tokens
        self.load, self.kept, self.state, self.capture_stats = [], [], None, None

    def prefill(self, kv_budget, kv_page_entries) -> torch.Tensor | None:
        """Every group's prefill calls, one per round; this group's last-position logits in row order."""
        model, mine = self.model, self.plans[self.par.layout.ep_rank]
        budget, page_entries, cold = profile_kv_sizes(model, kv_budget, kv_page_entries)
        pool = (KVState.pool_for(model.cfg, len(self.rows), self.capacity, model.device, budget, page_entries, cold)
                if self.rows else None)
        rounds, states, logits = max(map(len, self.plans)), [], []
        for r in range(rounds):
            self.par.counts = [plan[r].tokens if r < len(plan) else 0 for plan in self.plans]
            if r < len(mine):
                f = mine[r]
                if f.start == 0:
                    states.append(model.new_state(len(f.rows), self.capacity, pool=pool))
                ids = torch.tensor([self.seqs[i][f.start:f.stop] for i in f.rows], dtype=torch.long)
                out = model.forward(ids, state=states[-1])
                if f.last:
                    logits.append(out)
            else:
                idle_step(model)
            self.load.append(self.par.take_load())
            self.report("prefill", r + 1, rounds)
        self.state = (KVState.cat(states) if len(states) > 1 else states[0]) if states else None
        return torch.cat(logits) if logits else None

    def decode(self, logits, temperature, generator, eos_token_id, keep_logits: bool, steps=None) -> list[list[int]]:
        """One token per sequence per step, every group together, until the last step or every EOS.
        ``steps``: "graph" (CUDA graphs) or "static" (the same static-buffer steps, eager): every rank,
        idle groups too, then runs the fixed-shape MoE dispatch, so the collectives line up."""
        if steps is None:
            return self._decode(logits, temperature, generator, eos_token_id, keep_logits, None)
        capture = StepCapture(self.model, self.state, capture=steps == "graph") if self.rows else None
        with self.par.static_shapes():
            out = self._decode(logits, temperature, generator, eos_token_id, keep_logits, capture)
        self.capture_stats = dict(capture.stats) if capture is not None else {}
        return out

    def _decode(self, logits, temperature, generator, eos_token_id, keep_logits: bool, capture) -> list[list[int]]:
        model, n = self.model, self.max_new_tokens
        out, done = [[] for _ in self.seqs], [False] * len(self.seqs)
        for step in range(n):
            tokens = (ops.sample(logits, temperature, generator) if self.rows
                      else torch.empty(0, dtype=torch.long, device=model.device))
            for i, tok in sorted(_exchange(self.par, tokens, self.orders).items()):
                if not done[i]:
                    out[i].append(tok)
                    done[i] = eos_token_id is not None and tok == eos_token_id
            self.report("decode", n if all(done) else step + 1, n)
            if step + 1 == n or all(done):
                break
            self.par.counts = [len(o) for o in self.orders]
            if self.rows:
                logits = (model.forward(tokens.unsqueeze(1), state=self.state) if capture is None
                          else capture.step(tokens))  # a captured step's logits: its static output
                if keep_logits:
                    self.kept.append(logits.clone())
            else:
                idle_step(model)
            self.load.append(self.par.take_load())
        return out
