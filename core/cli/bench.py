"""``flashrt bench kernels``: the kernel benchmark suite (:mod:`flashrt.bench`) on this device."""
from __future__ import annotations

import json
import sys

from flashrt.out_files import OutFile, json_report


def cmd_kernels(args) -> int:
    from flashrt.bench import cuda_missing, run_suite

    why = cuda_missing()
    if why:
        raise ValueError(f"kernels: {why}; the suite times the CUDA kernels and their baselines on the device")
    out = (OutFile(args.out, "flashrt bench kernels", json_report("device", "ceilings", "rows", "errors"))
           if args.out else None)
    if out:
        out.check()  # before the suite: a path it may not write fails now
    stream = sys.stderr if args.json else sys.stdout  # --json: stdout holds only the report

    def log(line: str) -> None:
        print(line, file=stream, flush=True)

    def write(report: dict) -> None:  # after every family, atomically: a killed run keeps what it measured
        out.write(json.dumps(report, indent=2, default=str) + "\n")

    result = run_suite(args.families, log=log, checkpoint=write if out else None)
    if out:
        log(f"wrote {out.path}")
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=str)
        print()
    return 1 if result["errors"] else 0


def add_bench(sub) -> None:
    from flashrt.bench import FAMILIES

    from flashrt.argtypes import nonempty

    bench = sub.add_parser("bench", help="benchmarks on this device")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("kernels", help="time every kernel family against its ceilings and baselines "
                        "(plain and CUDA-graph replay)")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES, metavar="FAMILY",
                   help=f"subset of {', '.join(FAMILIES)} (default: all)")
    p.add_argument("--out", default=None, metavar="FILE", type=nonempty("file name"), help="write the JSON report here")
    p.add_argument("--json", action="store_true", help="print the JSON report (progress goes to stderr)")
    p.set_defaults(func=cmd_kernels)
    from flashrt.bench.serve import add_parser as add_serve_bench

    add_serve_bench(bsub)
