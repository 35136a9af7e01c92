"""``flashrt inspect PATH``: argument wiring and printing (the report is ``flashrt.graphs.inspect``)."""
from __future__ import annotations

import json
import sys


def add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="what a checkpoint directory holds, what a load ignores, whether it fits")
    p.add_argument("path", help="checkpoint directory (as saved by flashrt or as published)")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence for the fit estimate (default 4096)")
    p.add_argument("--device", default=None, help="device to fit (default: cuda when available, else cpu)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args) -> int:
    from flashrt.graphs.inspect import inspect

    report = inspect(args.path, device=args.device, context=args.context)
    if args.json:
        json.dump({k: v for k, v in report.items() if k != "lines"}, sys.stdout, indent=2, default=str)
        print()
    else:
        print("\n".join(report["lines"]))
    return 0 if report["ok"] else 1
