"""What a chunk's forward call stages for :meth:`flashrt.kv.state.KVState.commit`, and how a commit
that keeps only the first tokens of each row (speculative verification) writes it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashrt import checks
from flashrt.formats import QTensor
from .util import write_rows


@dataclass(slots=True)
class Staged:
    """The writes of the current call that wait for :meth:`KVState.commit`."""

    rings: list = field(default_factory=list)  # (layer, (row, slot), kv QTensor [B, n, D])
    partials: list = field(default_factory=list)  # (layer, kv, score fp32 [B, n, D], first int64 [B])

    def __bool__(self) -> bool:
        return bool(self.rings or self.partials)


def write_kept(ring: QTensor, slots: tuple, kv: QTensor, keep: torch.Tensor | None) -> None:
    """Write the staged ring tokens ``kv`` [B, n, D] at ``slots`` (row, slot) [B * n]; with ``keep``
    (bool [B * n], on the ring's device) only those it marks, the other slots left as they are
    (``store_rows``' ``keep``: no host-side filtering, no device sync). A row's slots are distinct:
    its chunk fits in the window."""
    write_rows(ring, *slots, kv, keep)


def commit_partial(cache, r: int, kv, score, first, ends) -> None:
    """Slots ``[0, rem)`` of the pending group of each row ending at position ``ends[b]``, taken
    from the staged compressor inputs ``kv`` / ``score`` [B, n, D] (positions ``first[b] + j``)."""
    start = ends // r * r - first  # [B] index of the pending group's first input
    if checks.values_checked() and bool((start < 0).any()):  # a device sync: only with value checks on
        raise ValueError("counts: the staged compressor inputs do not reach back to the kept group")
    slot = torch.arange(r, device=kv.device)
    idx = (start.unsqueeze(1) + slot).clamp(0, kv.shape[1] - 1)  # [B, r]
    live = (slot < (ends - ends // r * r).unsqueeze(1)).unsqueeze(-1)
    pick = lambda t: t.gather(1, idx.unsqueeze(-1).expand(-1, -1, t.shape[-1]))
    cache.kv_state.copy_(torch.where(live, pick(kv), cache.kv_state))
    cache.score_state.copy_(torch.where(live, pick(score), cache.score_state))
