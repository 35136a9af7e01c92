"""Recording op calls: what the trace backend (``flashrt.backends.trace``) emits and ``flashrt plan`` reads.

``with record() as graph:`` collects every op call the trace backend serves inside the block into
a :class:`Graph`: the op, its input and output shapes and dtypes, FLOPs, and bytes read and
written (the counting rules are the trace backend's). The recorder lives in core so that the
model layer can read a trace without importing a backend: ``flashrt.graphs.plan`` runs the model
on meta tensors (dispatch picks the trace backend for them) inside :func:`record`.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

from .formats import QTensor

_RECORDER: contextvars.ContextVar["Graph | None"] = contextvars.ContextVar("flashrt_trace", default=None)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, or the QTensor format
    nbytes: int


@dataclass(frozen=True)
class Call:
    op: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    flops: int
    bytes_read: int
    bytes_written: int


@dataclass
class Totals:
    calls: int = 0
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def add(self, call: Call) -> None:
        self.calls += 1
        self.flops += call.flops
        self.bytes_read += call.bytes_read
        self.bytes_written += call.bytes_written


@dataclass
class Graph:
    """The recorded op calls, in order, with totals per op."""

    calls: list[Call] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.calls)

    def totals(self) -> dict[str, Totals]:
        out: dict[str, Totals] = {}
        for call in self.calls:
            out.setdefault(call.op, Totals()).add(call)
        return out

    def total(self) -> Totals:
        t = Totals()
        for call in self.calls:
            t.add(call)
        return t


@contextlib.contextmanager
def record():
    """Record every trace-backend op call inside the block into the yielded :class:`Graph`."""
    graph = Graph()
    token = _RECORDER.set(graph)
    try:
        yield graph
    finally:
        _RECORDER.reset(token)


def info(t) -> TensorInfo | None:
    """Shape, dtype (or QTensor format) and stored bytes of a tensor; None for anything else."""
    if isinstance(t, QTensor):
        return TensorInfo(tuple(t.shape), t.fmt, t.nbytes)
    if isinstance(t, torch.Tensor):
        return TensorInfo(tuple(t.shape), str(t.dtype).replace("torch.", ""), t.numel() * t.element_size())
    return None


def emit(op: str, args, outputs, flops: int, read: int | None = None) -> None:
    """Append one call to the graph being recorded, if any (``read``: bytes read, default every input once)."""
    graph = _RECORDER.get()
    if graph is None:
        return
    ins = tuple(i for i in map(info, args) if i is not None)
    outs = tuple(i for i in map(info, outputs) if i is not None)
    read = sum(i.nbytes for i in ins) if read is None else read
    graph.calls.append(Call(op, ins, outs, int(flops), int(read), sum(o.nbytes for o in outs)))
