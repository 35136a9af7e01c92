"""Per-call cost that ``flashrt.ops`` adds (validation + the cached op lookup), on CPU.

Two measurements per op, medians of several repeats of many calls:

- ``added_us``: ``flashrt.ops.<op>`` routed to a no-op backend (``use_backend("null")``) minus
  calling that no-op directly: exactly what the op contract adds, free of the op's own noise.
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
from flashrt.hookspecs import Backend, hookimpl
from results_io import write_json


def _noop(*args, **kwargs):
    return None


class NullPlugin:
    @hookimpl
    def flashrt_backend(self):
        return Backend(name="null", device_types=("cpu",), priority=-100, ops={name: _noop for name in ops.OPS})


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
        with flashrt.use_backend("null"):
            added = per_call_us(op, call_args, calls, repeats) - per_call_us(_noop, call_args, calls, repeats)
        direct = per_call_us(getattr(reference, name), call_args, calls // 4, repeats)
        via = per_call_us(op, call_args, calls // 4, repeats)
    return {"op": name, "index_value_checks": checks, "added_us": round(added, 3),
            "direct_us": round(direct, 3), "via_ops_us": round(via, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=40000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dispatch.register(NullPlugin(), name="null-plugin")
    rows = []
    for name, call_args, checks in cases():
        row = measure(name, call_args, checks, args.calls, args.repeats)
        rows.append(row)
        label = name + ("" if checks else " (value checks off)")
        print(f"{label:36} added {row['added_us']:6.2f} us   reference direct {row['direct_us']:8.2f} us, "
              f"via flashrt.ops {row['via_ops_us']:8.2f} us")
    result = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "torch": torch.__version__, "calls": args.calls, "repeats": args.repeats, "rows": rows}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
