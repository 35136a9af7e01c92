"""Continuous batching: which sequences run in the next step, and who makes room when pages run out.

Every step has a token budget (``max_step_tokens``). Running sequences decode first, one token
each. The rest of the budget goes to prefill chunks, in arrival order: sequences already
prefilling, then swapped-out ones coming back, then new ones (admitted while fewer than
``max_running`` sequences hold state). A chunk ends at the next multiple of ``chunk`` tokens (or
the prompt's end) and is never split to fit the budget, so a prompt is always cut at the same
positions, whatever else runs: its logits do not depend on the load. A long prompt therefore
takes several steps, each with every running decode in it.

Pages: ``max_pages`` main-KV pages may be held at once (None: no limit). The step's growth is
counted exactly (:func:`pages_at`); when the decodes alone do not fit, the latest-arrived running
or prefilling sequence is preempted (the engine swaps its state to the host or drops it for an
exact recompute) until they do; prefill chunks and admissions wait for free pages. The oldest
sequence is never preempted, so something always progresses (``max_pages`` is a scheduling limit:
the pool itself spills to its cold tier beyond its device pages).
"""
from __future__ import annotations

import collections
import functools
import operator
from collections import deque
from dataclasses import dataclass, field

from .request import Sequence, Status


ORDER = operator.attrgetter("order")  # the sort key of sequences (scheduling priority)


@functools.lru_cache(maxsize=None)
def _ratio_counts(ratios: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted(collections.Counter(ratios).items()))


def pages_at(cfg, page_entries: int, position: int, counts=None) -> int:
    """Main-KV pages a sequence holds after ``position`` positions (every source layer).
    ``counts``: :func:`ratio_counts` of ``cfg``, when the caller keeps it."""
    counts = counts if counts is not None else ratio_counts(cfg)
    return sum(n * -(-(position // r) // page_entries) for r, n in counts)


def ratio_counts(cfg) -> tuple[tuple[int, int], ...]:
    """(compression ratio, KV source layers with it) of ``cfg``."""
    return _ratio_counts(tuple(cfg.ratio(l) for l in cfg.kv_source_layers))


@dataclass
class Plan:
    decode: list[Sequence] = field(default_factory=list)  # one token each (running, swapped in)
    swap_in: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens)

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill)

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    def prefill_groups(self, min_len: int = 4) -> list[list[tuple[Sequence, int]]]:
        """The prefill chunks that run as one forward call each: chunks starting at the same
        position with the same length (a ``[rows, n]`` call needs both), in plan order. A forward's
        host work hardly grows with its rows, so a group is never split (the launchers' constexprs
        follow the token count's tile rule, so new row counts add few kernel variants). Chunks of fewer than ``min_len`` tokens run alone: a CPU
        fp32 GEMM of fewer than 4 rows rounds differently from a larger one, and a prompt's logits
        must not depend on the load. A prompt with images runs alone (its spans are one row's)."""
        groups: dict = {}
        for seq, n in self.prefill:
            alone = n < min_len or seq.request.images is not None
            key = id(seq) if alone else (seq.computed, n)
            groups.setdefault(key, []).append((seq, n))
        return list(groups.values())


class Scheduler:
    def __init__(self, cfg, page_entries: int, max_running: int, max_step_tokens: int, chunk: int,
                 max_pages: int | None, decode_tokens: int = 1):
        self.cfg, self.P = cfg, page_entries
        self.decode_tokens = decode_tokens  # positions a running sequence may add in one step (speculation: k + 1)
        self.counts = ratio_counts(cfg)  # pages_at runs for every sequence every step
        self.max_running, self.max_step_tokens, self.chunk, self.max_pages = max_running, max_step_tokens, chunk, max_pages
        self.waiting: deque[Sequence] = deque()  # WAITING or SWAPPED; the front goes first
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0

    def pages(self, position: int) -> int:
        return pages_at(self.cfg, self.P, position, self.counts)

    def growth(self, seq: Sequence, tokens: int) -> int:
        """Pages ``seq`` adds by running ``tokens`` more positions (every running sequence, every step)."""
        a, P, g = seq.computed, self.P, 0
        b = a + tokens
        for r, n in self.counts:
            g += n * (-(-(b // r) // P) + (a // r) // -P)  # ceil(b // r / P) - ceil(a // r / P)
        return g

    def chunk_len(self, seq: Sequence) -> int:
        return min(self.chunk - seq.computed % self.chunk, seq.prompt_len - seq.computed)

    @property
    def holding(self) -> int:
        """Sequences with state on the device (running or prefilling)."""
        return len(self.running) + len(self.prefilling)

    def requeue(self, seq: Sequence) -> None:
        """A preempted sequence goes back to the front of the queue (by arrival order)."""
        i = next((k for k, s in enumerate(self.waiting) if s.order > seq.order), len(self.waiting))
        self.waiting.insert(i, seq)

    def schedule(self, used_pages: int, padding_pages: int, preempt, prepare) -> Plan:
        """The next step. ``used_pages``: pages held now; ``padding_pages``: what the decode batch's
        padding rows may reserve. ``preempt(seq)`` frees a sequence's pages (it is then swapped or
        waiting); ``prepare(seq)`` readies a waiting sequence (prefix lookup) before it is costed."""
        free = float("inf") if self.max_pages is None else self.max_pages - used_pages - padding_pages
        plan = Plan()
        d = self.decode_tokens
        need = self._decode_need()
        if need > free:
            holders = sorted(self.running + self.prefilling, key=ORDER)
            while need > free and len(holders) > 1:  # the oldest always goes on: no livelock
                victim = holders.pop()
                free += self.pages(victim.computed)
                if victim.status is Status.RUNNING:
                    need -= self.growth(victim, d)
                self._preempt(victim, preempt)
        free -= need
        plan.decode = sorted(self.running, key=ORDER)
        budget = self.max_step_tokens - len(plan.decode)
        for seq in sorted(self.prefilling, key=ORDER):
            n = self.chunk_len(seq)
            g = self.growth(seq, n) + self._fork_pages(seq, n)
            if n > budget or g > free:
                break
            plan.prefill.append((seq, n))
            budget, free = budget - n, free - g
        else:
            free, budget = self._admit(plan, free, budget, prepare)
        holders = self.running + self.prefilling
        if plan.empty and len(holders) > 1 and self.max_pages is not None:  # stuck: make room
            self._preempt(max(holders, key=ORDER), preempt)
        return plan

    def _decode_need(self) -> int:
        """Pages the running sequences' next decode adds (0 without a page limit: not counted)."""
        return 0 if self.max_pages is None else sum(self.growth(s, self.decode_tokens) for s in self.running)

    def decode_fits(self, used_pages: int, padding_pages: int) -> bool:
        """Whether the running sequences' next decode fits the free pages (no preemption needed)."""
        return self.max_pages is None or self._decode_need() <= self.max_pages - used_pages - padding_pages

    def _admit(self, plan: Plan, free, budget: int, prepare):
        holding = self.holding
        while self.waiting and holding < self.max_running:
            seq = self.waiting[0]
            if seq.status is Status.SWAPPED:
                n, g = 1, self.pages(seq.computed + self.decode_tokens)
            else:
                prepare(seq)
                n = self.chunk_len(seq)
                g = self.pages(seq.computed + n) + self._fork_pages(seq, n)
            if n > budget or g > free:
                break
            self.waiting.popleft()
            if seq.status is Status.SWAPPED:
                plan.swap_in.append(seq)
                plan.decode.append(seq)
                self.running.append(seq)
            else:
                plan.prefill.append((seq, n))
                self.prefilling.append(seq)
            holding += 1 + self._forks(seq)
            budget, free = budget - n, free - g
        return free, budget

    def _forks(self, seq: Sequence) -> int:
        req = seq.request
        return req.params.n - 1 if seq.index == 0 and len(req.seqs) == 1 else 0

    def _fork_pages(self, seq: Sequence, n: int) -> int:
        """Pages the other ``n - 1`` sequences of a request take when its prompt completes."""
        forks = self._forks(seq)
        return forks * self.pages(seq.prompt_len) if forks and seq.computed + n == seq.prompt_len else 0

    def _preempt(self, seq: Sequence, preempt) -> None:
        (self.running if seq.status is Status.RUNNING else self.prefilling).remove(seq)
        preempt(seq)
        self.requeue(seq)
        self.preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """``seq`` leaves the scheduler (finished or aborted), wherever it is."""
        for q in (self.running, self.prefilling, self.waiting):
            if seq in q:
                q.remove(seq)
