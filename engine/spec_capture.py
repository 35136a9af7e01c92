"""Which path speculative decode steps take, and the static-buffer runners of one batch state.

Speculative decoding runs its steps from static buffers (CUDA-graph replays on a GPU) wherever plain
decoding does: :func:`graphs_on` is the one switch, ``cuda_graph`` when given (``generate(...,
cuda_graph=)``, ``flashrt run --[no-]cuda-graph``, ``EngineConfig.cuda_graphs``), else on CUDA
devices. :class:`SpecRunners` holds the three steps a round can take on one
:class:`~flashrt.kv.state.KVState`: the draft (:class:`~flashrt.engine.draft_capture.DraftCapture`),
the verify chunk (:class:`~flashrt.engine.verify_capture.VerifyCapture`) and, for rounds that
verify nothing (``k = 0``), the one-token step (:class:`~flashrt.engine.step_capture.StepCapture`).
Each keeps its own eager fallbacks (host-tier pages without the zero-copy gather, Engram tables in
host memory, sampled drafts, a step that syncs with the host).
"""
from __future__ import annotations

from .draft_capture import DraftCapture
from .step_capture import StepCapture
from .verify_capture import VerifyCapture

COUNTS = ("captured", "replayed", "eager", "fallback")


def graphs_on(model, cuda_graph: bool | None) -> bool:
    """Whether decode steps (plain and speculative) run from static buffers, captured as CUDA
    graphs on a CUDA device: ``cuda_graph`` when given, else whether the model is on CUDA."""
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph: expected True, False or None, got {cuda_graph!r}")
    return model.device.type == "cuda" if cuda_graph is None else cuda_graph


class SpecRunners:
    """The draft, verify and (``plain=True``) one-token steps of ``state`` from static buffers.

    ``capture``: record and replay (default: on CUDA, or for the draft and verify steps when
    ``record`` is given); False runs the same static-buffer steps eagerly. ``record``:
    ``record(body) -> (replay, outputs)`` in place of CUDA graphs for the draft and verify steps
    (tests); the one-token step captures CUDA graphs only (off the GPU its static step runs eagerly)."""

    def __init__(self, model, state, capture: bool | None = None, record=None, plain: bool = True):
        self.state = state
        self.verifier = VerifyCapture(model, state, capture, record=record)
        self.drafter = DraftCapture(model, state, capture, record=record)
        cuda = model.device.type == "cuda"
        self.plain = StepCapture(model, state, capture if cuda else False) if plain else None

    def stats(self) -> dict:
        """Steps captured / replayed / run eagerly from static buffers / run unbuffered (``fallback``)
        over every runner, and per runner (``verify``, ``draft``, ``plain``)."""
        parts = {"verify": self.verifier.stats, "draft": self.drafter.stats}
        if self.plain is not None:
            parts["plain"] = self.plain.stats
        total = {k: sum(int(p.get(k, 0)) for p in parts.values()) for k in COUNTS}
        return {**total, **{name: dict(p) for name, p in parts.items()}}
