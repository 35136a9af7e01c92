"""Where a kernel's instructions and stalls go, by SASS opcode: a summary of Nsight Compute's source
page exported as CSV.

    ncu --profile-from-start off --section SourceCounters --section WarpStateStats --import-source yes \\
        -o REPORT python tools/ncu_cases.py experts1
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python tools/ncu_source.py source.csv [--top 25] [--json OUT.json]   (or a gzipped source.csv.gz)

The CSV holds one table a profiled kernel (a header row naming the ``Source`` column, then one row
per SASS instruction). For each table this sums the executed instructions and the warp-stall
samples over the instruction's opcode (``LDG.E.U8`` counts as ``LDG``, its modifiers kept apart in
``by_instruction``) and prints the opcodes that take the most of either.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import sys
from collections import defaultdict

SOURCE = "Source"
EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    """A CSV cell as a number (thousands separators dropped; empty or text: 0)."""
    try:
        return float(text.replace(",", "").strip() or 0)
    except ValueError:
        return 0.0


def _column(header: list[str], name: str) -> int | None:
    """The index of the first column whose name starts with ``name``, else None."""
    return next((i for i, h in enumerate(header) if h.strip().startswith(name)), None)


def opcode(sass: str) -> tuple[str, str]:
    """(opcode, opcode with modifiers) of one SASS line: the predicate (``@P0``, ``@!PT``) dropped."""
    words = sass.strip().split()
    if words and words[0].startswith("@"):
        words = words[1:]
    full = words[0].rstrip(";") if words else "?"
    return full.split(".")[0], full


def tables(rows: list[list[str]]) -> list[dict]:
    """One summary a table: rows between a header holding ``Source`` and the next header."""
    out, header, current = [], None, None
    for row in rows:
        if _column(row, SOURCE) is not None and any(EXECUTED in c or SAMPLES in c for c in row):
            header = row
            src, ex, st = _column(row, SOURCE), _column(row, EXECUTED), _column(row, SAMPLES)
            current = {"columns": (src, ex, st), "by_opcode": defaultdict(lambda: [0.0, 0.0]),
                       "by_instruction": defaultdict(lambda: [0.0, 0.0]), "lines": 0}
            out.append(current)
            continue
        if header is None or len(row) <= current["columns"][0]:
            continue
        src, ex, st = current["columns"]
        op, full = opcode(row[src])
        executed = _number(row[ex]) if ex is not None and ex < len(row) else 0.0
        samples = _number(row[st]) if st is not None and st < len(row) else 0.0
        for key, table in ((op, current["by_opcode"]), (full, current["by_instruction"])):
            table[key][0] += executed
            table[key][1] += samples
        current["lines"] += 1
    return [{"lines": t["lines"],
             "executed": sum(v[0] for v in t["by_opcode"].values()),
             "samples": sum(v[1] for v in t["by_opcode"].values()),
             "by_opcode": {k: {"executed": v[0], "samples": v[1]} for k, v in t["by_opcode"].items()},
             "by_instruction": {k: {"executed": v[0], "samples": v[1]} for k, v in t["by_instruction"].items()}}
            for t in out]


def report(summary: dict, top: int) -> str:
    """The opcodes of one table by executed instructions, with their share of the stall samples."""
    ex, st = summary["executed"] or 1.0, summary["samples"] or 1.0
    lines = [f"{summary['lines']} SASS lines, {summary['executed']:,.0f} instructions executed, "
             f"{summary['samples']:,.0f} stall samples",
             f"{'opcode':16s} {'executed':>14s} {'share':>7s} {'stall samples':>14s} {'share':>7s}"]
    ranked = sorted(summary["by_opcode"].items(), key=lambda kv: -max(kv[1]["executed"] / ex, kv[1]["samples"] / st))
    for name, v in ranked[:top]:
        lines.append(f"{name:16s} {v['executed']:14,.0f} {100 * v['executed'] / ex:6.1f}% "
                     f"{v['samples']:14,.0f} {100 * v['samples'] / st:6.1f}%")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25, help="opcodes printed a kernel")
    ap.add_argument("--json", default=None, help="write the summaries here")
    args = ap.parse_args()
    if args.top < 1:
        ap.error(f"--top: expected a count >= 1, got {args.top}")
    try:
        with (gzip.open(args.csv, "rt", newline="") if args.csv.endswith(".gz") else open(args.csv, newline="")) as f:
            rows = list(csv.reader(f))
    except OSError as e:
        sys.exit(f"ncu_source: cannot read {args.csv!r}: {e.strerror}")
    found = tables(rows)
    if not found:
        sys.exit(f"ncu_source: no source table in {args.csv!r} (expected a header with a {SOURCE!r} column and "
                 f"{EXECUTED!r} or {SAMPLES!r})")
    for i, t in enumerate(found):
        print(f"== kernel {i}\n{report(t, args.top)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
