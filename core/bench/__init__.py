"""The kernel benchmark suite (``flashrt bench kernels``; ``benchmarks/h200_kernels.py`` runs it in
one device call and writes ``benchmarks/results/h200-kernels.json``).

The ceilings (device-to-device copy, bf16 GEMM, FP8 ``torch._scaled_mm``) are measured first, then
each family module's ``run(ceil)`` (:data:`FAMILIES`) gives rows; a family that fails is recorded
with its error and the others still run. Timing, rooflines and baseline ratios: :mod:`.common`.
"""
from __future__ import annotations

import importlib
import time
import traceback

FAMILIES = ("elementwise", "indexer", "attention", "gemm")
TIMING_NOTE = ("ms, roofline_fraction and speedup_vs_baseline come from CUDA-graph replays (L2 flushed before "
               "each call, launch gaps removed) when a row's timing is 'graph', else from plain do_bench medians; "
               "plain_ms and baseline_plain_ms keep the plain medians")


def cuda_missing() -> str | None:
    """Why the suite cannot run here, or None."""
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA device (torch sees none)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "needs triton (pip install 'flashrt[cuda]')"
    return None


def run_suite(families=FAMILIES, log=print, progress=None, checkpoint=None) -> dict:
    """Measure the ceilings, then every family's cases; returns the report dict (JSON-ready).
    ``checkpoint(report)`` is called after each family (a run killed later keeps what it measured)."""
    import torch

    from .common import Ceilings

    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"families: expected names from {list(FAMILIES)}, got {unknown}")
    why = cuda_missing()
    if why:
        raise ValueError(f"bench kernels: {why}")
    ceil = Ceilings.measure()
    log(f"ceilings: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {ceil.bf16_flops / 1e12:.0f} TFLOPS, "
        f"fp8 {ceil.fp8_flops / 1e12:.0f} TFLOPS")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil.__dict__,
              "timing": TIMING_NOTE, "rows": [], "errors": {}}
    for done, fam in enumerate(families, 1):
        t0 = time.perf_counter()
        try:
            rows = importlib.import_module(f"{__name__}.{fam}").run(ceil)
        except Exception as exc:  # noqa: BLE001 - recorded in the report; the other families still run
            result["errors"][fam] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            log(f"{fam}: FAILED {exc}")
            rows = []
        finally:
            if progress:
                progress(done, len(families))
        result["rows"] += [{"family": fam, **r} for r in rows]
        log(f"{fam}: {len(rows)} cases in {time.perf_counter() - t0:.1f}s")
        for r in rows:
            log(describe(r))
        if checkpoint:
            checkpoint(result)
        torch.cuda.empty_cache()
    return result


def describe(r: dict) -> str:
    """One line per row: time (graph or plain), roofline fraction, ratio to the baseline."""
    if r.get("bound") == "error":
        return f"  {r['kernel']:24} ERROR {r.get('error')}"
    base = f" x{r['speedup_vs_baseline']:.2f} vs {r['baseline']}" if r.get("baseline") else ""
    return (f"  {r['kernel']:24} {r['shape']:40} {r['ms'] * 1e3:10.1f} us ({r['timing']}; plain "
            f"{r['plain_ms'] * 1e3:.1f})  {r['roofline_fraction']:6.1%} of {r['bound']} roofline{base}")
