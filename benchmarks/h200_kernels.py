"""The whole kernel suite in one device call: ceilings, then every family's cases.

    python benchmarks/h200_kernels.py --out benchmarks/results/h200-kernels.json [--families attention gemm]

Each family module in ``benchmarks/kernels/`` defines ``run(ceil) -> list[dict]``; a family that
fails is recorded with its error and the others still run.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernels.common import Ceilings  # noqa: E402

FAMILIES = ("elementwise", "indexer", "attention", "gemm")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ceil = Ceilings.measure()
    print(f"ceilings: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {ceil.bf16_flops / 1e12:.0f} TFLOPS, "
          f"fp8 {ceil.fp8_flops / 1e12:.0f} TFLOPS", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "ceilings": ceil.__dict__, "rows": [], "errors": {}}
    for fam in args.families:
        t0 = time.perf_counter()
        try:
            rows = importlib.import_module(f"kernels.{fam}").run(ceil)
        except Exception as exc:
            result["errors"][fam] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            print(f"{fam}: FAILED {exc}", flush=True)
            continue
        result["rows"] += [{"family": fam, **r} for r in rows]
        print(f"{fam}: {len(rows)} cases in {time.perf_counter() - t0:.1f}s", flush=True)
        for r in rows:
            base = f" x{r['speedup_vs_baseline']:.2f} vs {r['baseline']}" if "baseline" in r else ""
            print(f"  {r['kernel']:24} {r['shape']:40} {r['ms'] * 1e3:10.1f} us  {r['roofline_fraction']:6.1%} of "
                  f"{r['bound']} roofline{base}", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, default=str)
            f.write("\n")


if __name__ == "__main__":
    main()
