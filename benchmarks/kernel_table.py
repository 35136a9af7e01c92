"""The kernel table of docs/performance.md from a ``flashrt bench kernels`` report: for every
kernel, its smallest and largest case (the suite's first and last shape of that kernel), time,
roofline fraction with the binding term, and the ratio to its baseline and to the torch reference.

    python benchmarks/kernel_table.py benchmarks/results/h200-kernels.json
"""
from __future__ import annotations

import argparse
import json


def pick(rows: list[dict]) -> list[dict]:
    """First and last row of each kernel, in the report's order."""
    by_kernel: dict[str, list[dict]] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r)
    out = []
    for group in by_kernel.values():
        out += [group[0]] + ([group[-1]] if len(group) > 1 else [])
    return out


def fmt_time(ms: float) -> str:
    us = ms * 1e3
    return f"{us:,.1f} µs" if us < 1000 else f"{ms:,.2f} ms"


def ratio(r: dict, key: str, name_key: str | None = None) -> str:
    v = r.get(key)
    if v is None:
        return "—"
    return f"{v:.2f}x" + (f" {r[name_key]}" if name_key and r.get(name_key) else "")


def table(report: dict) -> str:
    lines = ["| kernel | shape | time | of roofline (bound) | vs baseline (same GPU) | vs torch reference |",
             "|---|---|---|---|---|---|"]
    for r in pick(report["rows"]):
        if r.get("bound") == "error":
            lines.append(f"| `{r['kernel']}` | {r['shape']} | error: {r.get('error')} | | | |")
            continue
        base = ratio(r, "speedup_vs_baseline", "baseline")
        ref = ratio(r, "speedup_vs_reference")
        if ref == "—" and "reference" in (r.get("baseline") or ""):
            ref = "(the baseline)"
        lines.append(f"| `{r['kernel']}` | {r['shape']} | {fmt_time(r['ms'])} | {r['roofline_fraction']:.1%} "
                     f"({r['bound']}) | {base} | {ref} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    args = ap.parse_args()
    with open(args.report) as f:
        report = json.load(f)
    c = report["ceilings"]
    print(f"Ceilings measured in the same run: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 GEMM "
          f"{c['bf16_flops'] / 1e12:.0f} TFLOPS, FP8 `_scaled_mm` {c['fp8_flops'] / 1e12:.0f} TFLOPS.\n")
    print(table(report))


if __name__ == "__main__":
    main()
