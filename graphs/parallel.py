"""Which rank owns what when one model runs on several devices (docs/parallel.md).

``world = tp * ep`` ranks, ``rank = ep_rank * tp + tp_rank``: ``ep`` groups of ``tp`` consecutive
ranks. Inside a group (tensor parallelism) the query heads, the output groups (``o_groups``) and
the vocabulary rows of the embedding and the head, and the Engram table rows are split ``tp``
ways. The sequences are split across the ``ep`` groups (data-parallel attention): a group runs
attention for its own sequences and each of its ranks keeps their compressed KV in full (one latent
is shared by all heads, so it cannot be split by heads). The routed experts are split across all
``tp * ep`` ranks, whole experts per rank (expert parallelism); a layer's shared expert lives on
one rank of each group (``layer % tp``). Everything else (norms, mHC, the query / KV latents,
compressor, indexer, the gate, Engram projections, draft layers) is replicated.

No weight is cut inside a dot product whose result the published model rounds to bf16, so a rank
computes the same values as one process; only the order of the sums across ranks changes (on the
CPU not even that shows: the output projection's partials are summed in fp64, graphs/tp_layers.py).

:class:`Layout` is the static answer (a frozen dataclass, no process group needed: the loader and
``flashrt plan`` use it); :class:`Parallel` adds the process groups and the collectives the
layers call, through :mod:`flashrt.distributed`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from flashrt import distributed


def span(n: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of part ``index`` when ``n`` rows are cut into ``parts`` equal parts
    (the last one shorter when ``n`` does not divide)."""
    size = -(-n // parts)
    return min(n, index * size), min(n, (index + 1) * size)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    rank: int = 0

    def __post_init__(self):
        for name in ("tp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"rank: expected an int in [0, {self.world}) for tp={self.tp} x ep={self.ep}, "
                             f"got {self.rank!r}")

    @property
    def world(self) -> int:
        return self.tp * self.ep

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp

    def for_rank(self, rank: int) -> "Layout":
        return Layout(self.tp, self.ep, rank)

    def tp_ranks(self, ep_rank: int | None = None) -> list[int]:
        """The global ranks of one tensor-parallel group (default: this rank's)."""
        e = self.ep_rank if ep_rank is None else ep_rank
        return [e * self.tp + t for t in range(self.tp)]

    def ep_ranks(self, tp_rank: int | None = None) -> list[int]:
        """The global ranks holding the same tensor-parallel slice in every group (default: this rank's)."""
        t = self.tp_rank if tp_rank is None else tp_rank
        return [e * self.tp + t for e in range(self.ep)]

    def leader(self, ep_rank: int) -> int:
        """The first rank of group ``ep_rank`` (whose sampled tokens the group follows)."""
        return ep_rank * self.tp

    # ----- what this rank owns -------------------------------------------------------------------
    def heads(self, cfg) -> tuple[int, int]:
        return span(cfg.n_heads, self.tp, self.tp_rank)

    def groups(self, cfg) -> tuple[int, int]:
        return span(cfg.o_groups, self.tp, self.tp_rank)

    def vocab(self, cfg) -> tuple[int, int]:
        return span(cfg.vocab_size, self.tp, self.tp_rank)

    def experts(self, n_routed: int) -> tuple[int, int]:
        """This rank's routed experts (whole experts, split across every rank)."""
        return span(n_routed, self.world, self.rank)

    def holds_shared(self, layer: int) -> bool:
        """Whether this rank computes ``layer``'s shared expert for its group's tokens."""
        return layer % self.tp == self.tp_rank

    def engram_rows(self, rows: int) -> tuple[int, int]:
        return span(rows, self.tp, self.tp_rank)

    def sequences(self, n: int) -> list[int]:
        """The sequences (of ``n``, in order) whose attention group ``ep_rank`` runs: round robin."""
        return list(range(self.ep_rank, n, self.ep))

    def check(self, cfg) -> None:
        """ValueError naming ``tp`` / ``ep`` when ``cfg`` cannot be split this way (every split must
        be even, and quantized weights split on whole 32-wide scale blocks)."""
        def need(ok: bool, name: str, what: str):
            if not ok:
                raise ValueError(f"{name}: expected {what} for model {cfg.name!r}, got {getattr(self, name)}")

        need(cfg.n_heads % self.tp == 0 and cfg.o_groups % self.tp == 0, "tp",
             f"a divisor of n_heads={cfg.n_heads} and o_groups={cfg.o_groups}")
        need(cfg.vocab_size % self.tp == 0, "tp", f"a divisor of vocab_size={cfg.vocab_size}")
        o_cols = cfg.o_groups // self.tp * cfg.o_lora_rank if cfg.o_groups % self.tp == 0 else 0
        need(cfg.dtype != "fp8" or o_cols % 32 == 0, "tp", "whole 32-wide blocks of wo_b's input per rank")
        need(cfg.n_routed_experts % self.world == 0, "ep",
             f"tp * ep (here {self.world}) to divide n_routed_experts={cfg.n_routed_experts}")


# how MoE tokens reach the experts' ranks (graphs/ep_dispatch.py); ``replicated``: every group runs
# the same tokens (the serving engine's lockstep, engine/parallel_serve.py), nothing is exchanged
DISPATCHES = ("gather", "all_to_all", "replicated")


class Parallel:
    """A :class:`Layout` inside a running process group: the groups and collectives the layers use.

    Build it on every rank after :func:`flashrt.distributed.init` (it creates one process group per
    tensor-parallel group and per expert-parallel slice, in the same order on every rank)."""

    def __init__(self, layout: Layout, dispatch: str = "gather"):
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch: expected one of {list(DISPATCHES)}, got {dispatch!r}")
        if distributed.world_size() != layout.world:
            raise ValueError(f"layout: tp={layout.tp} x ep={layout.ep} needs {layout.world} ranks, "
                             f"the process group has {distributed.world_size()}")
        self.layout, self.dispatch = layout, dispatch  # how MoE tokens reach the experts (graphs/ep_dispatch.py)
        self.tp_group = self.ep_group = None
        for e in range(layout.ep):
            g = distributed.new_group(layout.tp_ranks(e)) if layout.tp > 1 else None
            self.tp_group = g if e == layout.ep_rank else self.tp_group
        for t in range(layout.tp):
            g = distributed.new_group(layout.ep_ranks(t)) if layout.ep > 1 else None
            self.ep_group = g if t == layout.tp_rank else self.ep_group
        self.counts: list[int] | None = None  # tokens per group in the coming forward (set by the runner)
        self.load: torch.Tensor | None = None  # (token, expert) pairs per rank, summed over layers
        # MoE layers take the fixed-shape dispatch (ep_dispatch.routed_static): no host sync, no
        # data-dependent shape, what a CUDA-graph-captured decode step needs (static_shapes())
        self.static = False

    @contextlib.contextmanager
    def static_shapes(self, on: bool = True):
        """Inside the block the MoE layers dispatch with fixed shapes (:func:`routed_static`)."""
        old, self.static = self.static, bool(on)
        try:
            yield
        finally:
            self.static = old

    # ----- layer construction (this rank's shards) -------------------------------------------------
    def attention(self, cfg, layer: int, w: dict, prefix: str):
        from .tp_layers import Attention, TPAttention

        return Attention(cfg, layer, w, prefix) if self.layout.tp == 1 else TPAttention(cfg, layer, w, prefix, self)

    def engram(self, cfg, layer: int, w: dict, prefix: str):
        from .tp_layers import Engram, TPEngram

        return Engram(cfg, layer, w, prefix) if self.layout.tp == 1 else TPEngram(cfg, layer, w, prefix, self)

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from .tp_layers import vocab_embed

        return vocab_embed(self, table, ids) if self.layout.tp > 1 else table[ids]

    def head_logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        from .tp_layers import vocab_logits

        return vocab_logits(self, h, head)

    # ----- collectives ---------------------------------------------------------------------------
    def tp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce(t, group=self.tp_group) if self.layout.tp > 1 else t

    def tp_all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return distributed.all_gather(t, dim, group=self.tp_group) if self.layout.tp > 1 else t

    def token_counts(self, n: int, device) -> list[int]:
        """Tokens each group brings to this forward's MoE layers: from the runner's plan when it set
        one, else exchanged (one small all-gather)."""
        if self.counts is not None:
            if self.counts[self.layout.ep_rank] != n:
                raise AssertionError(f"rank {self.layout.rank}: plan says {self.counts[self.layout.ep_rank]} "
                                     f"tokens, the forward has {n}")
            return list(self.counts)
        if self.layout.ep == 1:
            return [n]
        got = distributed.all_gather(torch.tensor([n], dtype=torch.long, device=device), group=self.ep_group)
        return got.tolist()

    def gather_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Every group's tokens ``[ep * m, D]`` (group blocks padded to ``m`` rows), and the counts."""
        counts = self.token_counts(x.shape[0], x.device)
        if self.layout.ep == 1:
            return x, counts
        m = max(counts)
        padded = torch.zeros(m, x.shape[1], dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        return distributed.all_gather(padded, 0, group=self.ep_group), counts

    def record_load(self, indices: torch.Tensor, n_routed: int, valid: torch.Tensor | None = None) -> None:
        """Count the (token, expert) pairs each rank's experts serve (load balance); ``valid`` (bool
        per row of ``indices``): only those rows count. Added in place into one buffer, with fixed
        shapes (no host sync), so a captured step counts on every replay."""
        per = n_routed // self.layout.world
        owner = (indices.long() // per).reshape(-1)
        ones = (torch.ones_like(owner) if valid is None
                else valid.reshape(-1, 1).expand(indices.shape).reshape(-1).to(torch.long))
        if self.load is None:
            self.load = torch.zeros(self.layout.world, dtype=torch.long, device=indices.device)
        self.load.index_add_(0, owner, ones)

    def take_load(self) -> list[int]:
        """The (token, expert) pairs per rank since the last call (every MoE layer summed). With
        ``all_to_all`` each group counted its own tokens' pairs: the groups' counts are summed."""
        return self.take_load_tensor().tolist()

    def take_load_tensor(self) -> torch.Tensor:
        """:meth:`take_load` as a device tensor, queued after the work launched so far (no host sync)."""
        if self.load is None:
            load = torch.zeros(self.layout.world, dtype=torch.long, device=distributed.collective_device())
        else:  # the buffer stays (a captured step adds into it): read and zeroed in place
            load = self.load.clone()
            self.load.zero_()
        if self.dispatch == "all_to_all" and self.layout.ep > 1:
            load = distributed.all_reduce(load, group=self.ep_group)
        return load
