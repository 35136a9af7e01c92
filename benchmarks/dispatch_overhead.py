"""Per-call cost that ``flashrt.ops`` adds over calling the reference implementation directly.

Both paths run the same reference function on the same small CPU tensors, so the difference is
validation + the cached (op, device type) lookup. Medians of several repeats of many calls.

    python benchmarks/dispatch_overhead.py [--out benchmarks/results/cpu-dispatch-overhead.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from flashrt import ops
from flashrt.backends import reference


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
    sink = torch.zeros(4)
    yield "rms_norm", (x, w, 1e-6), {}
    yield "hc_collapse", (torch.randn(1, 2, 4, 64), torch.rand(1, 2, 4)), {}
    yield "sparse_attention", (q, kv, idx, sink, 0.125), {"index range checked": True}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, call_args, notes in cases():
        direct = per_call_us(getattr(reference, name), call_args, args.calls, args.repeats)
        via = per_call_us(getattr(ops, name), call_args, args.calls, args.repeats)
        rows.append({"op": name, "direct_us": round(direct, 3), "via_ops_us": round(via, 3),
                     "added_us": round(via - direct, 3), **notes})
        print(f"{name:18} direct {direct:8.2f} us   via flashrt.ops {via:8.2f} us   added {via - direct:6.2f} us")
    result = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "torch": torch.__version__, "calls": args.calls, "repeats": args.repeats, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
