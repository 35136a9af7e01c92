"""Data-parallel attention while serving: each expert-parallel group runs only its own sequences.

``flashrt serve --ep M --dp-attention`` (docs/parallel.md). Rank 0 places each new request on a
group (:class:`~flashrt.engine.parallel_place.Placer`) and the placement travels with the turn's
commands (:class:`~flashrt.engine.parallel_serve.Lockstep`). Every rank keeps every request (the
same table on every rank: ids, tokens, finished or not), but schedules, prefills and decodes only
its own group's, on its own page pool (sized for the group: ``max_running`` is divided by ``ep``).
Another group's request is a *mirror* here: it is in :attr:`StepLoop.requests` (so every rank has
the same ``has_work`` and steps together), never in this rank's scheduler.

A step: this group runs its scheduled forwards; before each forward the groups exchange their token
counts (one all-gather of one int over the expert-parallel slice) and the MoE layers ``gather``
with those counts (``Parallel.counts``), so a layer exchanges no counts itself. A group whose
forwards are done sends 0 and runs :func:`~flashrt.engine.parallel.idle_step` while another group
still runs one; when every group sent 0 the forwards are over. Then every rank learns every
group's sampled tokens and failures (the group leaders' records, one object all-gather), so the
mirrors advance exactly as their owners did and rank 0 streams every response. The same all-gather
carries each rank's digest of its group's scheduler state (checked against its leader's) and each
group's gauges (running, pages, prefix-cache counters) for :meth:`GroupedEngine.stats`.
"""
from __future__ import annotations

import hashlib
import pickle

import torch

from flashrt import distributed
from flashrt.errors import FlashrtError

from .engine import Engine
from .parallel import idle_step
from .parallel_place import Placer
from .parallel_serve import counters_repr
from .request import Sequence, Status
from .step_loop import StepLoop

# counters every rank keeps alike (the others count one group's work: checked inside the group)
SHARED_COUNTERS = ("prompt_tokens", "generation_tokens", "finished", "aborted", "failed", "steps")
GROUP_GAUGES = ("running", "prefilling", "waiting", "swapped", "kv_pages_device", "kv_pages_host", "kv_pages_index",
                "kv_spilled_pages", "kv_pool_bytes", "prefix_queries", "prefix_hits", "prefix_query_tokens",
                "prefix_hit_tokens", "preemptions", "swaps", "recomputes", "swap_bytes")


class GroupDiverged(FlashrtError):
    """A rank's group state differs from its group leader's (they run the same steps)."""


def all_gather_objects(obj) -> list:
    """Every rank's picklable ``obj``, by rank (two all-gathers: the sizes, then the padded bytes)."""
    data = pickle.dumps(obj)
    dev = distributed.collective_device()
    sizes = distributed.all_gather(torch.tensor([len(data)], dtype=torch.long, device=dev)).tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = distributed.all_gather(buf.to(dev)).view(len(sizes), -1).cpu()
    return [pickle.loads(every[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]


def pool_bytes(pool) -> int:
    """Device bytes of a page pool: its main-KV pages and its index-K pages."""
    parts = [pool.dev] + ([pool.index_pool.dev] if pool.index_pool is not None else [])
    return sum(q.data.nbytes + q.scale.nbytes for q in parts)


class GroupStepLoop(StepLoop):
    """A :class:`StepLoop` that runs its own group's sequences and mirrors the other groups'."""

    overlap_steps = False  # each step's tokens go to the other groups at its end: read them in it

    def __init__(self, model, config, tokenizer):
        super().__init__(model, config, tokenizer)
        self.par = model.parallel
        layout = self.par.layout
        self.group, self.groups = layout.ep_rank, layout.ep
        self.leader = layout.rank == layout.leader(self.group)
        self.placer = Placer(self.groups, self.config.prefill_chunk if self.config.prefix_cache_bytes else None)
        self.placement: dict[str, int] = {}  # request id -> group, from rank 0, applied by the next add
        self.placed = [0] * self.groups  # requests placed on each group so far
        self.group_stats = [self.gauges() for _ in range(self.groups)]  # every group starts alike
        self._records: list = []  # this step's samples and failures of this group's requests
        self._mirroring = False
        self._forward = model.forward
        model.forward = self._round  # every forward of this group first agrees on the groups' counts

    # ----- placement -------------------------------------------------------------------------------
    def place(self, request_id: str, prompt: list[int]) -> int:
        """Rank 0: the group of a new request (sent to the other ranks with the turn's commands)."""
        g = self.placer.choose(request_id, prompt, self._loads(), self.placed)
        self.placement[request_id] = g
        return g

    def _loads(self) -> list[int]:
        """Tokens of each group's unfinished requests (prompts and outputs so far)."""
        loads = [0] * self.groups
        for req in self.requests.values():
            loads[req.group] += sum(len(s.tokens) for s in req.seqs if not s.finished)
        return loads

    def add(self, request_id: str, prompt: list[int], params, images=None):
        group = self.placement.pop(request_id, None)
        if group is None:  # not placed by rank 0 (offline use): the same deterministic choice
            group = self.placer.choose(request_id, prompt, self._loads(), self.placed)
        try:
            req = super().add(request_id, prompt, params, images)
        finally:
            self.placer.settle(request_id)
        req.group = group
        self.placed[group] += 1
        if group != self.group:  # a mirror: its owner schedules it
            self.scheduler.waiting.remove(req.seqs[0])
        return req

    @property
    def num_waiting(self) -> int:
        """Requests with no output yet, on every group (the same count on every rank)."""
        return sum(1 for r in list(self.requests.values()) if not r.seqs or not r.seqs[0].n_output)

    # ----- one step --------------------------------------------------------------------------------
    def step(self):
        self._records = []
        touched = set(super().step())
        self._idle_rounds()
        touched |= self._share_results()
        return list(touched)

    def _counts(self, n: int) -> list[int]:
        if self.groups == 1:
            return [n]
        t = torch.tensor([n], dtype=torch.long, device=distributed.collective_device())
        return distributed.all_gather(t, group=self.par.ep_group).tolist()

    def _round(self, input_ids, *args, **kwargs):
        """One forward of this group, with every group's token count for its MoE layers."""
        self.par.counts = self._counts(torch.as_tensor(input_ids).numel())
        try:
            return self._forward(input_ids, *args, **kwargs)
        finally:
            self.par.counts = None

    def _idle_rounds(self) -> None:
        """This group's forwards are done: serve the other groups' MoE layers until theirs are too."""
        while any(counts := self._counts(0)):
            self.par.counts = counts
            try:
                idle_step(self.model)
            finally:
                self.par.counts = None

    def _emit(self, seq: Sequence, s, touched: set) -> bool:
        if not self._mirroring:
            self._records.append(("token", seq.request.id, seq.index, s, seq.request.prefix_hit_tokens))
        return super()._emit(seq, s, touched)

    def _fail(self, req, exc: Exception, touched: set) -> None:
        super()._fail(req, exc, touched)
        if not self._mirroring and getattr(req, "group", self.group) == self.group:
            self._records.append(("fail", req.id, req.error))

    def _share_results(self) -> set:
        """Every group leader's records, applied to this rank's mirrors; the groups' gauges."""
        mine = (self._records, self.gauges()) if self.leader else None
        every = all_gather_objects((mine, self.group_digest()))
        layout, touched = self.par.layout, set()
        if every[layout.leader(self.group)][1] != every[layout.rank][1]:
            raise GroupDiverged(f"rank {layout.rank}: its scheduler state differs from its group leader's (rank "
                                f"{layout.leader(self.group)}) after {self.counters['steps']} steps")
        for g in range(self.groups):
            records, self.group_stats[g] = every[layout.leader(g)][0]
            if g != self.group:
                self._mirror(records, touched)
        return touched

    def _mirror(self, records: list, touched: set) -> None:
        """Another group's samples and failures, applied to the requests mirrored here."""
        self._mirroring = True
        try:
            for kind, rid, *rest in records:  # a request's forks appear with their first tokens
                req = self.requests.get(rid)
                if kind == "token" and req is not None:
                    while len(req.seqs) <= rest[0]:
                        req.seqs.append(Sequence(req, len(req.seqs), None))
            for kind, rid, *rest in records:
                req = self.requests.get(rid)
                if req is None:
                    continue
                if kind == "token":
                    index, sampled, req.prefix_hit_tokens = rest
                    if not req.seqs[index].finished:
                        self._emit(req.seqs[index], sampled, touched)
                else:
                    super()._fail(req, FlashrtError(rest[0]), touched)
                    req.error = rest[0]
        finally:
            self._mirroring = False

    # ----- state -----------------------------------------------------------------------------------
    def gauges(self) -> dict:
        """This group's scheduler, pool and prefix-cache figures (the group leader sends them)."""
        pool, sch, prefix = self.pool, self.scheduler, self.prefix
        waiting = list(sch.waiting)
        return {"running": len(sch.running), "prefilling": len(sch.prefilling),
                "waiting": sum(1 for s in waiting if s.status is Status.WAITING),
                "swapped": sum(1 for s in waiting if s.status is Status.SWAPPED),
                "kv_pages_device": pool.device_pages - len(pool.free_dev),
                "kv_pages_host": pool.host.shape[0] - len(pool.free_host),
                "kv_pages_index": pool.index_pool.pages_in_use, "kv_spilled_pages": pool.spilled,
                "kv_pool_bytes": pool_bytes(pool), "prefix_queries": prefix.queries, "prefix_hits": prefix.hits,
                "prefix_query_tokens": prefix.query_tokens, "prefix_hit_tokens": prefix.hit_tokens,
                "preemptions": self.counters["preemptions"], "swaps": self.counters["swaps"],
                "recomputes": self.counters["recomputes"], "swap_bytes": self.swap_used}

    def group_digest(self) -> str:
        """This group's scheduler state (equal on the ranks of a group; ``*_seconds`` timers left out)."""
        h = hashlib.blake2b(digest_size=8)
        h.update(counters_repr(self.counters))
        h.update(repr((self.pool.pages_in_use, [(s.request.id, s.index, s.computed) for s in self.scheduler.running],
                       [(s.request.id, s.index, s.computed) for s in self.scheduler.prefilling])).encode())
        return h.hexdigest()

    def shared_state(self) -> tuple:
        """What every rank holds alike: every request's placement, tokens and finish, the shared counters."""
        reqs = [(rid, req.group, [(s.finished, len(s.tokens), s.tokens[-1:]) for s in req.seqs])
                for rid, req in sorted(self.requests.items())]
        return tuple(self.counters[k] for k in SHARED_COUNTERS), tuple(self.placed), reqs


class GroupedEngine(Engine):
    """An :class:`Engine` over a :class:`GroupStepLoop`; :meth:`stats` covers every group."""

    step_loop_class = GroupStepLoop

    def stats(self) -> dict:
        core = self.step_loop
        s = super().stats()
        groups = [dict(g, requests=n) for g, n in zip(core.group_stats, core.placed)]
        for key in GROUP_GAUGES:
            if key != "kv_pool_bytes":
                s[key] = sum(g[key] for g in groups)
        s["prefix_hit_rate"] = s["prefix_hit_tokens"] / s["prefix_query_tokens"] if s["prefix_query_tokens"] else 0.0
        s["groups"] = groups
        return s
