"""Window rings and compressor partial groups of a :class:`~flashrt.kv.state.KVState`: where a
call's tokens go in the rings, the writes a chunk stages (its queries read the slots its later
tokens overwrite) and their commit, whole or cut per row (speculative verification keeps part of
a chunk). A base class of ``KVState``: its methods read the state's rings, compressed caches and
staging."""
from __future__ import annotations

import torch

from flashrt import checks
from flashrt.formats import QTensor
from .staged import Staged, commit_partial, write_kept
from .util import to_device, write_rows


class StagedWrites:
    def ring_slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, slot) int64 [n] of the last ``min(S, W)`` tokens of ``positions`` [B, S] in the
        rings: where every layer of a call writes its ring (computed once per call)."""
        W = self.cfg.window_size
        positions = positions[:, -W:]  # rows of a chunk share its length: the last W tokens stay
        rows = self.row_ids.unsqueeze(1).expand_as(positions)
        return rows.reshape(-1), (positions % W).reshape(-1)

    def write_ring(self, layer: int, kv: QTensor, slots: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Store the last ``window_size`` tokens of a chunk ``kv`` [B, S, D] at ``slots``
        (:meth:`ring_slots` of its positions): now for one token per row, at :meth:`commit` for a
        chunk (its queries read the slots its later tokens overwrite)."""
        if self.is_meta:  # shape-only tracing: nothing is stored
            return
        S, W = kv.shape[1], self.cfg.window_size
        if S == 1:
            write_rows(self.rings[layer], *slots, kv)
            return
        if S > W:  # the last W tokens, copied: the chunk's KV is not kept until the commit
            tail = slice(S - W, S)
            kv = QTensor(kv.data[:, tail].clone(), kv.scale[:, tail].clone(), kv.fmt, (kv.shape[0], W, kv.shape[-1]))
        self._staged.rings.append((layer, slots, kv))

    def write_partial(self, layer: int, kv: torch.Tensor, score: torch.Tensor, first: torch.Tensor,
                      end: torch.Tensor) -> None:
        """After a chunk, the source of ``layer``'s pending group: ``kv`` / ``score`` fp32 [B, n, D]
        hold the compressor inputs of positions ``first[b] + j`` (``first`` int64 [B], a group
        start) up to ``end[b]`` (the chunk's end); :meth:`commit` moves those of the group each
        row ends in to its slots ``[0, rem)`` (the chunk read the old ones)."""
        if kv.shape[1] and not self.is_meta:  # copied: the chunk's projections are not kept until the commit
            self._staged.partials.append((layer, kv.clone(), score.clone(), first, end))

    def commit(self, counts: list[int] | None = None) -> None:
        """Write what the current call staged (a chunk's ring tokens and pending groups); with
        ``counts``, row ``b`` takes only its chunk's first ``counts[b]`` tokens."""
        if not self._staged:
            return
        L = self._chunk_len
        cut = None if counts is None or all(c == L for c in counts) else \
            to_device([L - c for c in counts], self.device)
        self._write_staged(cut)

    def commit_kept(self, counts: torch.Tensor | None) -> None:
        """:meth:`commit` of the first ``counts[b]`` tokens of each row, ``counts`` int64 [B] on the
        device (None: every token): no host value is read, so a CUDA graph can record it. Writing
        the same staged values twice leaves the caches as writing them once. The staging is left
        for :meth:`advance` (``committed=True``) to drop."""
        if self._staged:
            self._write_staged(None if counts is None else self._chunk_len - counts, drop=False)

    def _write_staged(self, cut: torch.Tensor | None, drop: bool = True) -> None:
        """The staged writes; ``cut`` [B] (device): tokens dropped from the end of each row's chunk."""
        staged, L = self._staged, self._chunk_len
        keep = None
        if cut is not None and staged.rings:
            n = staged.rings[0][2].shape[1]
            if n < L:
                raise ValueError(f"counts: keeping part of a chunk needs it in the window ({L} > {n} tokens)")
            keep = (torch.arange(n, device=cut.device).unsqueeze(0) < n - cut.unsqueeze(1)).reshape(-1)
        with checks.value_checks(False):  # once for every layer's ring write (kv.util.unchecked)
            for layer, slots, kv in staged.rings:
                write_kept(self.rings[layer], slots, kv, keep)
        for layer, kv, score, first, end in staged.partials:
            commit_partial(self.compressed[layer], self.cfg.ratio(layer), kv, score, first,
                           end if cut is None else end - cut.to(end.device))
        if drop:
            self._staged = Staged()

