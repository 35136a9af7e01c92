"""Tensor-parallel versions of the layers (docs/parallel.md): each rank holds its slice of the
weights (:mod:`flashrt.graphs.shard`) and sums or gathers across its tensor-parallel group.

The output projection's partial sums are added up wide and rounded once: on the CPU each rank's
partial is the reference's fp64 accumulation (an fp64 input to ``linear`` keeps it) and the group
sums it in fp64, so the result is one process's fp64 sum rounded the same way, bit for bit (up to
fp64 rounding, far below an fp32 ulp); on accelerators partials and sums are fp32 and differ from
one process by the order of fp32 additions. The vocabulary-parallel embedding and Engram lookups
are exact (one rank contributes each row, the others zeros) and the head's logits are gathered,
not summed.
"""
from __future__ import annotations

import torch

from flashrt import ops

from .attention import Attention
from .context import StepContext
from .engram import Engram


class TPAttention(Attention):
    """Attention over this rank's query heads and output groups (``n_heads / tp``, ``o_groups /
    tp``); the compressed KV, the window ring and the indexer are the whole layer's (replicated)."""

    def __init__(self, cfg, layer: int, w: dict, prefix: str, par):
        tp = par.layout.tp
        super().__init__(cfg.replace(n_heads=cfg.n_heads // tp, o_groups=cfg.o_groups // tp), layer, w, prefix)
        self.par = par

    def out_proj(self, o: torch.Tensor) -> torch.Tensor:
        """This rank's groups' share of ``wo_b`` (its input columns), summed over the group wide
        (:func:`partial_dtype`), rounded to fp32 and then to ``o.dtype`` as one process's sum is."""
        y = ops.linear(o.to(partial_dtype(o.device)), self.wo_b)
        return self.par.tp_all_reduce(y).to(torch.float32).to(o.dtype)


def partial_dtype(device: torch.device) -> torch.dtype:
    """dtype of a GEMM's partial sums that ranks add up: fp64 on the CPU (the reference accumulates
    in fp64, and an fp64 input gets that accumulation unrounded), fp32 on accelerators."""
    return torch.float64 if torch.device(device).type == "cpu" else torch.float32


class TPEngram(Engram):
    """Engram over this rank's rows of the table: rows it does not hold read as zeros and the
    group's sum fills them in."""

    def __init__(self, cfg, layer: int, w: dict, prefix: str, par):
        super().__init__(cfg, layer, w, prefix)
        self.par = par
        rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
        self.first, stop = par.layout.engram_rows(rows)
        self.local_rows = stop - self.first

    def _mine(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids >= self.first) & (ids < self.first + self.local_rows)

    def table_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids - self.first).clamp(0, max(self.local_rows - 1, 0))

    def rows(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        out = super().rows(self.table_ids(ids), ctx)
        mine = torch.where(self._mine(ids).unsqueeze(-1), out.to(torch.float32), 0.0)
        return self.par.tp_all_reduce(mine).to(out.dtype)


def vocab_embed(par, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows of ``ids`` [B, S] from this rank's vocabulary rows ``table``, summed over the group."""
    first = par.layout.tp_rank * table.shape[0]  # equal slices (Layout.check)
    local = ids - first
    mine = (local >= 0) & (local < table.shape[0])
    rows = table[local.clamp(0, table.shape[0] - 1)].to(torch.float32)
    rows = torch.where(mine.unsqueeze(-1), rows, 0.0)
    return par.tp_all_reduce(rows).to(table.dtype)


def vocab_logits(par, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """fp32 logits of this rank's vocabulary rows, gathered along the vocabulary."""
    return par.tp_all_gather(ops.linear(h, head), dim=-1)
