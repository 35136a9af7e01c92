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

from dataclasses import dataclass

import torch

from flashrt.timing import Timing, bench_ms, graph_ms  # noqa: F401 (the suite's timing, re-exported)


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
