"""Where a kernel's instructions and stalls go, by SASS opcode or by source line: a summary of
Nsight Compute's source page exported as CSV.

    ncu --profile-from-start off --section SourceCounters --section WarpStateStats --import-source yes \\
        -o REPORT python tools/ncu_cases.py experts1
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python tools/ncu_source.py source.csv [--top 25] [--json OUT.json]   (or a gzipped source.csv.gz)
    ncu -i REPORT.ncu-rep --page source --csv --print-source cuda > lines.csv
    python tools/ncu_source.py lines.csv --lines                          (the kernel's Python lines)

The CSV holds one table a profiled kernel (a header row naming the ``Source`` column, then one row
per SASS instruction, or per source line of the kernel for ``--print-source cuda``). For each table
this sums the executed instructions and the warp-stall samples over the instruction's opcode
(``LDG.E.U8`` counts as ``LDG``, its modifiers kept apart in ``by_instruction``) and over each row's
source text (``by_row``, with its line number where the CSV has a line column), and prints the
opcodes, or with ``--lines`` the rows, that take the most of either. ``--by-count`` prints instead
the instructions grouped by how many times each ran (``by_count``): the code every warp of every
program runs apart from the code only some run, such as a split-K launch's finish in its last
program (its rows run once a warp of one program) or one partition of a warp-specialized kernel.
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
WAVEFRONTS = "L1 Wavefronts Shared"  # shared-memory wavefronts (the MMAs' operand reads included)


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
            line = next((i for i, h in enumerate(row) if h.strip() in ("#", "Line", "# Line")), None)
            # the sampled stall reasons (all samples, not the not-issued ones) and the shared wavefronts
            reasons = {h.strip(): i for i, h in enumerate(row) if h.strip().startswith("stall_") and "(" not in h}
            wave = next((i for i, h in enumerate(row) if h.strip() == WAVEFRONTS), None)
            current = {"columns": (src, ex, st), "line": line, "reasons": reasons, "wave": wave,
                       "by_reason": defaultdict(lambda: defaultdict(float)), "wavefronts": defaultdict(float),
                       "reasons_by_count": defaultdict(lambda: defaultdict(float)),
                       "by_opcode": defaultdict(lambda: [0.0, 0.0]),
                       "by_instruction": defaultdict(lambda: [0.0, 0.0]), "by_row": defaultdict(lambda: [0.0, 0.0]),
                       "by_count": defaultdict(lambda: [0, 0.0]), "lines": 0}
            out.append(current)
            continue
        if header is None or len(row) <= current["columns"][0]:
            continue
        src, ex, st = current["columns"]
        op, full = opcode(row[src])
        executed = _number(row[ex]) if ex is not None and ex < len(row) else 0.0
        samples = _number(row[st]) if st is not None and st < len(row) else 0.0
        where = current["line"]
        text = row[src].strip() if where is None or where >= len(row) else f"{row[where].strip()}: {row[src].strip()}"
        for key, table in ((op, current["by_opcode"]), (full, current["by_instruction"]), (text, current["by_row"])):
            table[key][0] += executed
            table[key][1] += samples
        for reason, i in current["reasons"].items():
            if i < len(row):
                current["by_reason"][op][reason] += _number(row[i])
                current["reasons_by_count"][executed][reason] += _number(row[i])
        if current["wave"] is not None and current["wave"] < len(row):
            current["wavefronts"][op] += _number(row[current["wave"]])
        current["by_count"][executed][0] += 1
        current["by_count"][executed][1] += samples
        current["lines"] += 1
    return [{"lines": t["lines"],
             "executed": sum(v[0] for v in t["by_opcode"].values()),
             "samples": sum(v[1] for v in t["by_opcode"].values()),
             "by_opcode": {k: {"executed": v[0], "samples": v[1]} for k, v in t["by_opcode"].items()},
             "by_instruction": {k: {"executed": v[0], "samples": v[1]} for k, v in t["by_instruction"].items()},
             "by_row": {k: {"executed": v[0], "samples": v[1]} for k, v in t["by_row"].items()},
             "by_reason": {k: dict(v) for k, v in t["by_reason"].items()},
             "reasons_by_count": {f"{k:.0f}": dict(v) for k, v in sorted(t["reasons_by_count"].items())},
             "wavefronts": dict(t["wavefronts"]),
             "by_count": {f"{k:.0f}": {"rows": v[0], "executed": k * v[0], "samples": v[1]}
                          for k, v in sorted(t["by_count"].items())}}
            for t in out]


def report(summary: dict, top: int, by: str = "by_opcode") -> str:
    """The opcodes (``by_row``: the source rows) of one table that take the largest share of the
    executed instructions or of the stall samples, with both shares."""
    ex, st = summary["executed"] or 1.0, summary["samples"] or 1.0
    width = 16 if by == "by_opcode" else 72
    lines = [f"{summary['lines']} rows, {summary['executed']:,.0f} instructions executed, "
             f"{summary['samples']:,.0f} stall samples",
             f"{'opcode' if by == 'by_opcode' else 'source':{width}s} {'executed':>14s} {'share':>7s} "
             f"{'stall samples':>14s} {'share':>7s}"]
    ranked = sorted(summary[by].items(), key=lambda kv: -max(kv[1]["executed"] / ex, kv[1]["samples"] / st))
    for name, v in ranked[:top]:
        lines.append(f"{name[:width]:{width}s} {v['executed']:14,.0f} {100 * v['executed'] / ex:6.1f}% "
                     f"{v['samples']:14,.0f} {100 * v['samples'] / st:6.1f}%")
    return "\n".join(lines)


def count_report(summary: dict) -> str:
    """One table's instructions grouped by how many times each ran: per group the rows (SASS
    instructions), the instructions executed and the stall samples, with their shares."""
    ex, st = summary["executed"] or 1.0, summary["samples"] or 1.0
    lines = [f"{summary['lines']} rows, {summary['executed']:,.0f} instructions executed, "
             f"{summary['samples']:,.0f} stall samples",
             f"{'runs each':>12s} {'rows':>7s} {'executed':>14s} {'share':>7s} {'stall samples':>14s} {'share':>7s}"]
    for runs, v in summary["by_count"].items():
        lines.append(f"{int(runs):12,d} {v['rows']:7d} {v['executed']:14,.0f} {100 * v['executed'] / ex:6.1f}% "
                     f"{v['samples']:14,.0f} {100 * v['samples'] / st:6.1f}%")
    return "\n".join(lines)


def _worst(groups: dict, top: int) -> list[tuple]:
    """(key, samples, its three largest reasons) of the ``top`` groups ({key: {reason: samples}}) with the
    most samples, those with none left out."""
    ranked = sorted(((k, sum(r.values()), r) for k, r in groups.items()), key=lambda t: -t[1])
    return [(k, n, sorted(r.items(), key=lambda kv: -kv[1])[:3]) for k, n, r in ranked[:top] if n > 0]


def reason_report(summary: dict, top: int) -> str:
    """One table's stall samples by reason (all opcodes), then the opcodes with the most samples, each
    with its three largest reasons and its shared-memory wavefronts."""
    total = defaultdict(float)
    for reasons in summary["by_reason"].values():
        for reason, n in reasons.items():
            total[reason] += n
    st = sum(total.values()) or 1.0
    waves = summary["wavefronts"]
    lines = [f"{summary['samples']:,.0f} stall samples, {sum(waves.values()):,.0f} shared wavefronts",
             "  ".join(f"{r[6:]} {100 * n / st:.1f}%" for r, n in sorted(total.items(), key=lambda kv: -kv[1])
                       if n > 0)]
    for op, n, worst in _worst(summary["by_reason"], top):
        lines.append(f"{op:16s} {100 * n / st:5.1f}%  " + ", ".join(f"{r[6:]} {100 * v / st:.1f}%" for r, v in worst)
                     + f"  ({waves.get(op, 0.0):,.0f} wavefronts)")
    # by how many times the instructions ran: a warp-specialized kernel's partitions apart (each partition's
    # loop body runs its warps' count times the blocks)
    lines.append("by run count (the groups with the most samples):")
    for runs, n, worst in _worst(summary["reasons_by_count"], top):
        lines.append(f"{int(runs):>12,d} runs {100 * n / st:5.1f}%  "
                     + ", ".join(f"{r[6:]} {100 * v / st:.1f}%" for r, v in worst))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25, help="opcodes (or rows) printed a kernel")
    ap.add_argument("--lines", action="store_true",
                    help="rank the source rows (a --print-source cuda export: the kernel's own lines) instead of "
                         "the opcodes")
    ap.add_argument("--by-count", action="store_true",
                    help="group the instructions by how many times each ran instead (rows every warp runs apart "
                         "from those of one program or partition)")
    ap.add_argument("--reasons", action="store_true",
                    help="the stall samples by reason instead, overall and for the opcodes with the most")
    ap.add_argument("--json", default=None, help="write the summaries here")
    args = ap.parse_args()
    if args.top < 1:
        ap.error(f"--top: expected a count >= 1, got {args.top}")
    if sum((args.lines, args.by_count, args.reasons)) > 1:
        ap.error("--lines, --by-count, --reasons: expected at most one of them, got more")
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
        if args.reasons:
            text = reason_report(t, args.top)
        elif args.by_count:
            text = count_report(t)
        else:
            text = report(t, args.top, "by_row" if args.lines else "by_opcode")
        print(f"== kernel {i}\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
