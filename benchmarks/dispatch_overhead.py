"""Per-call cost that ``flashrt.ops`` adds (validation + the cached op lookup), on CPU.

Two measurements per op, medians of several repeats of many calls:

- ``added_us``: ``flashrt.ops.<op>`` routed to a no-op backend (``use_backend("null")``) minus
  calling that no-op directly: exactly what the op contract adds, free of the op's own noise;
- ``added_declared_us``: the same through a no-op backend that declares its support (a
  ``Support`` per op, as the kernel families do): plus the call key and the verdict lookup;
- ``direct_us`` / ``via_ops_us``: the reference implementation called directly vs through
  ``flashrt.ops`` (the end-to-end view; its difference is noisy for slower ops).

    python benchmarks/dispatch_overhead.py [--out benchmarks/results/cpu-dispatch-overhead.json]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import flashrt
from flashrt import dispatch, ops
from flashrt.backends import reference
from flashrt.hookspecs import Backend, Dim, Support, hookimpl
from results_io import write_json


def _noop(*args, **kwargs):
    return None


class NullPlugin:
    def __init__(self, name: str, declared: bool):
        # declared: what a kernel family says of sparse_attention (dtypes, formats, a dim range, an extra
        # predicate); every other op excludes float64
        attention = Support(inputs={"q": (torch.float32,), "kv": (torch.float32, "fp8")}, dims={"q[-1]": Dim(32, 512, 32)},
                            extra=lambda *args: True)
        supports = {name: attention if name == "sparse_attention" else Support(excluded_dtypes=(torch.float64,))
                    for name in ops.OPS} if declared else {}
        self.backend = Backend(name=name, device_types=("cpu",), priority=-100, ops={n: _noop for n in ops.OPS},
                               supports=supports)

    @hookimpl
    def flashrt_backend(self):
        return self.backend


def per_call_us(fn, args, calls: int, repeats: int) -> float:
    for _ in range(calls // 10):
        fn(*args)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def cases():
    x, w = torch.randn(4, 64), torch.ones(64)
    q = torch.randn(1, 1, 4, 64)
    kv = torch.randn(1, 16, 64)
    idx = torch.randint(0, 16, (1, 1, 8), dtype=torch.int32)
    yield "rms_norm", (x, w, 1e-6), True
    yield "hc_collapse", (torch.randn(1, 2, 4, 64), torch.rand(1, 2, 4)), True
    yield "sparse_attention", (q, kv, idx, torch.zeros(4), 0.125), True
    yield "sparse_attention", (q, kv, idx, torch.zeros(4), 0.125), False


def measure(name, call_args, checks, calls, repeats) -> dict:
    op = getattr(ops, name)
    with flashrt.value_checks(checks):
        noop = per_call_us(_noop, call_args, calls, repeats)
        with flashrt.use_backend("null"):
            added = per_call_us(op, call_args, calls, repeats) - noop
        with flashrt.use_backend("null-declared"):
            declared = per_call_us(op, call_args, calls, repeats) - noop
        direct = per_call_us(getattr(reference, name), call_args, calls // 4, repeats)
        via = per_call_us(op, call_args, calls // 4, repeats)
    return {"op": name, "index_value_checks": checks, "added_us": round(added, 3),
            "added_declared_us": round(declared, 3),
            "direct_us": round(direct, 3), "via_ops_us": round(via, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=40000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dispatch.register(NullPlugin("null", False), name="null-plugin")
    dispatch.register(NullPlugin("null-declared", True), name="null-declared-plugin")
    rows = []
    for name, call_args, checks in cases():
        row = measure(name, call_args, checks, args.calls, args.repeats)
        rows.append(row)
        label = name + ("" if checks else " (value checks off)")
        print(f"{label:36} added {row['added_us']:6.2f} us (declared {row['added_declared_us']:6.2f})   "
              f"reference direct {row['direct_us']:8.2f} us, "
              f"via flashrt.ops {row['via_ops_us']:8.2f} us")
    result = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "torch": torch.__version__, "calls": args.calls, "repeats": args.repeats, "rows": rows}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
