"""The DSpark draft (``Drafts.draft``) replayed from CUDA graphs, one capture per state layout.

The draft reads only device tensors: the row positions and the draft layers' window rings; its
input is ``next_ids`` (a static buffer filled before the step). Greedy drafting (temperature 0)
samples by argmax on the device, so the whole call, Markov-biased token loop and confidence head
included, is one graph. Sampled drafting draws from a host-seeded generator and runs eagerly. On
a non-CUDA device the static-buffer draft runs eagerly; ``record`` replaces the CUDA graph
recorder (see :mod:`flashrt.engine.verify_capture`).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from flashrt import checks
from flashrt.kv.state import KVState

from .verify_capture import capture_setup


class DraftCapture:
    """``Drafts.draft`` of ``state`` through CUDA graphs keyed by the state's buffer layout;
    ``capture`` / ``record`` / ``max_graphs`` as in :class:`~flashrt.engine.verify_capture.VerifyCapture`."""

    def __init__(self, model, state: KVState, capture: bool | None = None, max_graphs: int = 4, record=None):
        if model.drafts is None:
            raise ValueError("model: expected a model with DSpark draft layers (dspark_block_size > 0)")
        self.capture, self.record = capture_setup(model, state, capture, record)
        self.model, self.state, self.max_graphs = model, state, max_graphs
        self.next_ids = torch.zeros(state.batch, dtype=torch.long, device=model.device)
        self.graphs: OrderedDict = OrderedDict()  # key -> (replay, outputs) or "eager"
        self.stats = {"captured": 0, "replayed": 0, "eager": 0}

    def key(self) -> tuple:
        """A graph reads the positions and rings in place: recorded afresh when they move."""
        s = self.state
        tensors = [s.positions, self.next_ids] + [t for ring in s.rings.values() for t in (ring.data, ring.scale)]
        return tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)

    def draft(self, next_ids: torch.Tensor, state=None, temperature: float = 0.0, generator=None):
        """What ``Drafts.draft(next_ids, state, temperature, generator)`` returns (ids, logits,
        confidence); with ``temperature == 0`` the graph's static outputs (read them before the
        next call). ``state``: this runner's state (accepted so the method replaces ``Drafts.draft``)."""
        if state is not None and state is not self.state:
            raise ValueError("state: expected the state this DraftCapture was built for")
        if next_ids.shape != self.next_ids.shape:
            raise ValueError(f"next_ids: expected a [{self.state.batch}] tensor, got {tuple(next_ids.shape)}")
        drafts = self.model.drafts
        if temperature != 0 or not self.capture:
            self.stats["eager"] += 1
            return drafts.draft(next_ids, self.state, temperature, generator)
        self.next_ids.copy_(next_ids)
        with checks.value_checks(False):  # sampled tokens: range checks would sync (and stay eager) every call
            return self._captured()

    def _captured(self):
        drafts = self.model.drafts
        key = self.key()
        hit = self.graphs.get(key)
        body = lambda: drafts.draft(self.next_ids, self.state)
        if hit == "eager":
            self.stats["eager"] += 1
            return body()
        if hit is not None:
            self.graphs.move_to_end(key)
            hit[0]()
            self.stats["replayed"] += 1
            return hit[1]
        try:
            with checks.host_syncs_raise():
                out = body()
        except RuntimeError as exc:
            if not checks.is_host_sync_error(exc):
                raise
            self.graphs[key] = "eager"
            self.stats["eager"] += 1
            return body()
        self.graphs[key] = self.record(body)
        self.stats["captured"] += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return out
