"""Device time of one call: the plain ``triton.testing.do_bench`` median and, where the call can be
captured, the median of CUDA-graph replays (launch gaps removed, L2 flushed before each call; a call
too short to show above the flush's own spread is timed replayed without the flush).

Used by ``flashrt tune`` (the winner of a tile sweep) and the kernel benchmark suite
(:mod:`flashrt.bench.common`, whose docstring describes the two timings).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import checks

_FLUSH: list = []  # the L2 flush buffer, made once


@dataclass
class Timing:
    """Median ms of one call, plain and graph-replayed (None when not captured, ``note`` says why)."""
    plain: float
    graph: float | None = None
    calls: int = 0  # calls per captured graph
    note: str | None = None

    @property
    def ms(self) -> float:
        """The time rates and ratios are computed from: graph replay when captured, else plain."""
        return self.graph if self.graph is not None else self.plain

    def __float__(self) -> float:
        return float(self.ms)

    def __add__(self, other):  # sums of sub-calls (a reference run in chunks)
        if isinstance(other, (int, float)) and other == 0:
            return self
        graph = self.graph + other.graph if self.graph is not None and other.graph is not None else None
        return Timing(self.plain + other.plain, graph, min(self.calls, other.calls), self.note or other.note)

    __radd__ = __add__

    def __truediv__(self, other) -> float:  # a speedup: baseline / ours, from the times used
        return float(self) / float(other)


def _flush_buffer() -> torch.Tensor:
    """256 MB (more than the L2) to zero between calls; made outside any capture, then reused."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(1 << 26, dtype=torch.int32, device="cuda"))
    return _FLUSH[0]


def _graph(fn, calls: int, with_fn: bool, with_flush: bool = True) -> "torch.cuda.CUDAGraph":
    flush = _flush_buffer()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            if with_flush:
                flush.zero_()
            if with_fn:
                fn()
    return g


def graph_ms(fn, plain_ms: float, warmup: int = 10, rep: int = 50) -> tuple[float, int]:
    """(median device ms of one ``fn()`` from graph replays, calls per graph); raises if uncapturable."""
    import triton.testing

    calls = max(1, min(50, math.ceil(0.5 / max(plain_ms, 1e-3))))  # about half a ms of the call per replay
    _flush_buffer()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), checks.host_syncs_raise():  # warm up off the default stream; a call
        fn()  # that syncs raises here, before a capture (a failed one leaves torch mid-capture)
    torch.cuda.current_stream().wait_stream(side)
    both, flush = _graph(fn, calls, True), _graph(fn, calls, False)
    t_both = triton.testing.do_bench(both.replay, warmup=warmup, rep=rep, return_mode="median")
    t_flush = triton.testing.do_bench(flush.replay, warmup=warmup, rep=rep, return_mode="median")
    if t_both > t_flush:
        return (t_both - t_flush) / calls, calls
    # the call is shorter than the flush's own spread (a GPU shared with other work): no L2 flush,
    # the replayed calls alone (a warm-L2 time, never a zero that would win a tile sweep)
    warm = _graph(fn, calls, True, with_flush=False)
    return triton.testing.do_bench(warm.replay, warmup=warmup, rep=rep, return_mode="median") / calls, calls


def bench_ms(fn, warmup: int = 25, rep: int = 100, graph: bool = True) -> Timing:
    """Plain ``do_bench`` median of ``fn()`` and, unless ``graph=False``, its graph-replay median;
    a call that cannot be captured keeps the plain time and a note."""
    import triton.testing

    plain = float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    if not graph:
        return Timing(plain, note="not captured (graph=False)")
    try:
        ms, calls = graph_ms(fn, plain)
    except Exception as exc:  # noqa: BLE001 - host syncs, uncapturable ops: fall back, say why
        torch.cuda.synchronize()
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        return Timing(plain, note=f"not captured: {type(exc).__name__}: {first}")
    return Timing(plain, ms, calls)
