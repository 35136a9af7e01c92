"""The whole kernel suite in one device call (``flashrt bench kernels`` as a script).

    python benchmarks/h200_kernels.py --out benchmarks/results/h200-kernels.json [--families attention gemm]

The suite lives in the package (``flashrt.bench``): ceilings first, then every family's cases, each
timed plain and as CUDA-graph replays (rates, rooflines and baseline ratios from the replays).
"""
from __future__ import annotations

import argparse

from flashrt.bench import FAMILIES, run_suite
from results_io import write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    write_json(args.out, run_suite(args.families, log=lambda line: print(line, flush=True),
                                   checkpoint=lambda report: write_json(args.out, report)))  # after each family


if __name__ == "__main__":
    main()
