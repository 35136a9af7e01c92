"""Shared measurement code for the kernel benchmark suite (``flashrt bench kernels``).

Each family module ``flashrt/bench/<family>.py`` defines ``run(ceil: Ceilings) -> list[dict]``
returning rows made by :func:`row`. Every call is timed two ways (:func:`bench_ms`):

- ``plain``: ``triton.testing.do_bench`` median (device events, L2 flushed before each call); for a
  short kernel this includes the host's launch cost (Python, Triton's launcher) whenever the GPU
  waits for it;
- ``graph``: the call captured ``n`` times in a CUDA graph, each preceded by an L2 flush (a 256 MB
  memset), the graph replayed under ``do_bench``, minus a graph of the ``n`` flushes alone, over
  ``n``: the device time of the call without launch gaps, L2 cold as in ``plain``.

Rates, roofline fractions and baseline ratios use the graph time (``timing: graph`` in the row),
or the plain time when the call cannot be captured (a host sync, say: ``timing: plain`` and the
reason in ``graph_note``). Bytes are the minimum the kernel must move (each input read once, each
output written once) and FLOPs the math it must do; the roofline is
``max(flops / gemm_rate, bytes / copy_bandwidth)`` with both ceilings measured in the same run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashrt import checks

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


def _graph(fn, calls: int, with_fn: bool) -> "torch.cuda.CUDAGraph":
    flush = _flush_buffer()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
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
    return max(t_both - t_flush, 0.0) / calls, calls


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


@dataclass
class Ceilings:
    copy_bytes_per_s: float  # device-to-device copy, read + write bytes
    bf16_flops: float  # dense bf16 GEMM
    fp8_flops: float  # torch._scaled_mm e4m3

    @classmethod
    def measure(cls) -> "Ceilings":
        n = 1 << 30  # 1 GiB each way
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        copy = 2 * n / (bench_ms(lambda: dst.copy_(src), graph=False).plain * 1e-3)
        m = 8192
        a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        bf16 = 2 * m**3 / (bench_ms(lambda: a @ b, graph=False).plain * 1e-3)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        fp8 = 2 * m**3 / (bench_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), graph=False).plain
                       * 1e-3)
        return cls(copy, bf16, fp8)


def nbytes(*tensors) -> int:
    """Bytes held by tensors (QTensors count data and scale)."""
    return sum(t.nbytes if hasattr(t, "fmt") else t.numel() * t.element_size() for t in tensors)


def row(kernel: str, shape: str, ms, flops: float, nbytes: float, ceil: Ceilings,
        baseline: str | None = None, baseline_ms=None, fp8_math: bool = False, **extra) -> dict:
    """One result row: achieved rates, roofline floor, fraction of roofline, ratio to baseline, from
    the graph-replay times (``ms``, ``baseline_ms``: :class:`Timing` or plain floats)."""
    t = ms if isinstance(ms, Timing) else Timing(float(ms), note="timed by the caller")
    rate = ceil.fp8_flops if fp8_math else ceil.bf16_flops
    t_flops, t_bytes = flops / rate, nbytes / ceil.copy_bytes_per_s
    floor_ms, used = max(t_flops, t_bytes) * 1e3, t.ms
    out = {
        "kernel": kernel, "shape": shape, "ms": used, "timing": "graph" if t.graph is not None else "plain",
        "plain_ms": t.plain, "graph_ms": t.graph, "graph_calls": t.calls, "graph_note": t.note,
        "gb_per_s": nbytes / (used * 1e-3) / 1e9, "tflops": flops / (used * 1e-3) / 1e12, "floor_ms": floor_ms,
        "roofline_fraction": floor_ms / used, "bound": "compute" if t_flops > t_bytes else "memory",
        "flops": flops, "bytes": nbytes,
    }
    if baseline is not None:
        b = baseline_ms if isinstance(baseline_ms, Timing) else Timing(float(baseline_ms), note="timed by the caller")
        out.update({"baseline": baseline, "baseline_ms": b.ms, "baseline_timing": "graph" if b.graph is not None
                    else "plain", "baseline_plain_ms": b.plain, "baseline_graph_note": b.note,
                    "speedup_vs_baseline": b.ms / used, "speedup_vs_baseline_plain": b.plain / t.plain})
    for k, v in extra.items():
        out[k] = v.ms if isinstance(v, Timing) else v
        if isinstance(v, Timing):
            out[f"{k}_plain"] = v.plain
    return out
