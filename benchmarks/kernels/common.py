"""Shared measurement code for the kernel benchmarks (H200: ``benchmarks/h200_kernels.py``).

Each family module ``benchmarks/kernels/<family>.py`` defines ``run(ceil: Ceilings) -> list[dict]``
returning rows made by :func:`row`. Times are ``triton.testing.do_bench`` medians (ms, events).
Bytes are the minimum the kernel must move (each input read once, each output written once) and
FLOPs the math it must do; the roofline is ``max(flops / gemm_rate, bytes / copy_bandwidth)``
with both ceilings measured in the same run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` (device events; warm-up and repeat in ms)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


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
        copy = 2 * n / (bench_ms(lambda: dst.copy_(src)) * 1e-3)
        m = 8192
        a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        bf16 = 2 * m**3 / (bench_ms(lambda: a @ b) * 1e-3)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        fp8 = 2 * m**3 / (bench_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) * 1e-3)
        return cls(copy, bf16, fp8)


def row(kernel: str, shape: str, ms: float, flops: float, nbytes: float, ceil: Ceilings,
        baseline: str | None = None, baseline_ms: float | None = None, fp8_math: bool = False, **extra) -> dict:
    """One result row: achieved rates, roofline floor, fraction of roofline, ratio to baseline."""
    rate = ceil.fp8_flops if fp8_math else ceil.bf16_flops
    t_flops, t_bytes = flops / rate, nbytes / ceil.copy_bytes_per_s
    floor_ms = max(t_flops, t_bytes) * 1e3
    out = {
        "kernel": kernel, "shape": shape, "ms": ms, "gb_per_s": nbytes / (ms * 1e-3) / 1e9,
        "tflops": flops / (ms * 1e-3) / 1e12, "floor_ms": floor_ms, "roofline_fraction": floor_ms / ms,
        "bound": "compute" if t_flops > t_bytes else "memory", "flops": flops, "bytes": nbytes,
    }
    if baseline is not None:
        out.update({"baseline": baseline, "baseline_ms": baseline_ms, "speedup_vs_baseline": baseline_ms / ms})
    out.update(extra)
    return out
