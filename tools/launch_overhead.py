"""Host time per call of every CUDA launcher (``kernels_cuda``), at decode shapes of the released config.

Small decode kernels take a few microseconds on the GPU, so the Python a launcher runs per call
(planning, views, allocations, Triton's launch) can decide their speed. Per case, medians of several repeats:

- ``stub_us``: the launcher with every ``_*_kernel`` replaced by a no-op: our own Python only
  (plan lookup, views, allocations, argument lists);
- ``stub_ops_us``: the same through ``flashrt.ops`` (validation + dispatch added);
- ``host_us`` (CUDA only): the real launcher, time until it returns (Python + Triton's launch);
- ``wall_us`` (CUDA only): the same calls followed by one synchronize, per call: when it is close
  to ``host_us`` the host, not the GPU, bounds the call rate.

On a GPU:  python tools/launch_overhead.py --out /tmp/launch-overhead.json
Without a GPU it runs the stubbed columns only (TRITON_INTERPRET=1, CPU tensors).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # CPU: the launchers' host code runs on CPU tensors, kernels stubbed
    os.environ.setdefault("TRITON_INTERPRET", "1")

import flashrt  # noqa: E402
from flashrt import formats, ops  # noqa: E402
from flashrt.jit import atomic_write  # noqa: E402

GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if GPU else "cpu")


def kernel_modules() -> list:
    """(name, module) of every module of flashrt.kernels_cuda (families and helpers: their kernels get stubbed)."""
    import importlib
    import pkgutil

    import flashrt.kernels_cuda as pkg

    return [(i.name, importlib.import_module(f"{pkg.__name__}.{i.name}")) for i in pkgutil.iter_modules(pkg.__path__)]


def _r(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def _attention(g, B):
    H, D, W, K, T = 64, 512, 128, 512, 2048
    kv = (formats.quantize(_r(g, B, W, D), "fp8"), formats.quantize(_r(g, B, 1, D), "fp8"),
          formats.quantize(_r(g, B, T, D), "fp4_b16"))
    idx = torch.randint(0, W + 1 + T, (B, 1, W + K), generator=g, dtype=torch.int32).to(DEV)
    return "sparse_attention", (_r(g, B, 1, H, D, dtype=torch.bfloat16), kv, idx, _r(g, H), D ** -0.5)


def _experts(g, n, E=16, D=5120, I=2304):
    ws = [formats.quantize(_r(g, E, a, b, scale=0.05), "fp4_w") for a, b in ((I, D), (I, D), (D, I))]
    idx = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(n)]).to(torch.int32).to(DEV)
    return "moe_experts", (_r(g, n, D, dtype=torch.bfloat16), _r(g, n, 6).abs(), idx, *ws, 10.0)


def cases(g) -> dict:
    """name -> (op, args): one decode step's shapes (batch 1 unless named)."""
    bf = torch.bfloat16
    hc, D, T = 4, 5120, 8192
    fn = _r(g, (2 + hc) * hc, hc * D, scale=0.01)
    table = formats.quantize(_r(g, 4096, 256), "fp8")
    cache = formats.quantize(_r(g, 64, 512), "fp8")
    return {
        "sparse_attention b1": _attention(g, 1),
        "sparse_attention b8": _attention(g, 8),
        "linear fp8_w 1x5120->2304": ("linear", (_r(g, 1, D, dtype=bf), formats.quantize(_r(g, 2304, D, scale=0.05),
                                                                                          "fp8_w"))),
        "moe_experts n1": _experts(g, 1),
        "quantize fp8": ("quantize", (_r(g, 1, 512, dtype=bf), "fp8")),
        "dequantize fp4_b16": ("dequantize", (formats.quantize(_r(g, 1, 512), "fp4_b16"), bf)),
        "quantize_store fp8": (None, (_r(g, 1, 512, dtype=bf), "fp8", cache.data, cache.scale,
                                      torch.tensor([5], device=DEV))),
        "index_scores fp4_b32": ("index_scores", (_r(g, 1, 1, 32, 128, dtype=bf), formats.quantize(
            _r(g, 1, T, 128), "fp4_b32"), _r(g, 1, 1, 32), torch.full((1, 1), T, dtype=torch.int32, device=DEV))),
        "topk_positions 8192/512": ("topk_positions", (_r(g, 1, 1, T), 512)),
        "candidate_blocks": ("candidate_blocks", (_r(g, 1, 1, T), torch.full((1, 1), T, dtype=torch.int32,
                                                                             device=DEV), 64, 8)),
        "rms_norm": ("rms_norm", (_r(g, 1, D, dtype=bf), _r(g, D), 1e-6)),
        "rope": ("rope", (_r(g, 1, 1, 64, 64, dtype=bf), torch.polar(torch.ones(1, 32), _r(g, 1, 32).cpu()).to(DEV))),
        "hc_coefficients": ("hc_coefficients", (_r(g, 1, 1, hc, D, dtype=bf), fn, _r(g, 3), _r(g, (2 + hc) * hc),
                                                20, 1e-6, 1e-6)),
        "hc_collapse": ("hc_collapse", (_r(g, 1, 1, hc, D, dtype=bf), _r(g, 1, 1, hc))),
        "hc_expand": ("hc_expand", (_r(g, 1, 1, D, dtype=bf), _r(g, 1, 1, hc, D, dtype=bf), _r(g, 1, 1, hc),
                                    _r(g, 1, 1, hc, hc))),
        "compress_pool": ("compress_pool", (_r(g, 1, 1, 4, 512), _r(g, 1, 1, 4, 512))),
        "engram_lookup": ("engram_lookup", (table, torch.randint(0, 4096, (1, 1, 24), generator=g).to(DEV))),
        "engram_gate": ("engram_gate", (_r(g, 1, 1, hc, D, dtype=bf), _r(g, 1, 1, hc, D, dtype=bf),
                                        _r(g, 1, 1, D, dtype=bf), _r(g, hc, D, dtype=bf), 1e-6)),
    }


def _noop(*args, **kwargs):
    return None


class _Stub:
    """Stands for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return _noop


@contextlib.contextmanager
def stubbed_kernels():
    """Every module-level ``*_kernel`` of flashrt.kernels_cuda replaced by a no-op launch."""
    from triton.runtime.jit import KernelInterface

    saved = [(mod, name, val) for _, mod in kernel_modules() if not isinstance(mod, BaseException)
             for name, val in list(vars(mod).items()) if name.endswith("_kernel") and isinstance(val, KernelInterface)]
    for mod, name, _ in saved:
        setattr(mod, name, _Stub())
    try:
        yield len(saved)
    finally:
        for mod, name, val in saved:
            setattr(mod, name, val)


def launchers() -> dict:
    from flashrt.families import family_tables
    from flashrt.kernels_cuda import FAMILIES
    from flashrt.kernels_cuda.quant import quantize_store

    return {**family_tables(FAMILIES)["ops"], None: quantize_store}


def per_call_us(fn, calls: int, repeats: int, sync=lambda: None) -> tuple[float, float]:
    """(median host us per call, median us per call including one final synchronize)."""
    fn()
    sync()
    host, wall = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


def measure(name, op, args, impl, calls, repeats) -> dict:
    via_ops = getattr(ops, op) if op else None
    row = {"case": name, "op": op or "quantize_store"}
    with stubbed_kernels(), flashrt.use_backend("cuda"):
        row["stub_us"] = per_call_us(lambda: impl(*args), calls, repeats)[0]
        if via_ops is not None:
            row["stub_ops_us"] = per_call_us(lambda: via_ops(*args), calls, repeats)[0]
    if GPU:
        with flashrt.use_backend("cuda"):
            row["host_us"], row["wall_us"] = per_call_us(lambda: impl(*args), calls, repeats, torch.cuda.synchronize)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default=None, help="cases whose name contains this")
    a = ap.parse_args()
    impls = launchers()
    rows = []
    for name, (op, args) in cases(torch.Generator().manual_seed(0)).items():
        if a.only and a.only not in name:
            continue
        rows.append(measure(name, op, args, impls[op], a.calls, a.repeats))
        r = rows[-1]
        cols = "  ".join(f"{k} {r[k]:8.1f}" for k in ("stub_us", "stub_ops_us", "host_us", "wall_us") if k in r)
        print(f"{name:28} {cols}", flush=True)
    device = torch.cuda.get_device_name() if GPU else f"cpu ({platform.processor() or platform.machine()})"
    if a.out:  # atomically: a run killed while writing leaves the previous file whole
        report = {"device": device, "torch": torch.__version__, "calls": a.calls, "rows": rows}
        atomic_write(Path(a.out), (json.dumps(report, indent=2) + "\n").encode())


if __name__ == "__main__":
    main()
