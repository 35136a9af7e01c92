"""Decode-size tiles of the GEMM-like kernels (``linear`` fp8_w and plain bf16, ``moe_experts``
up / down, ``hc_coefficients``) for one model on this device: every candidate of each profile
entry the decode calls use, checked against the reference and timed at the model's decode shapes.

    python benchmarks/decode_tiles.py --model small --batches 1 8 64 --budget 200 \\
        --out benchmarks/results/h200-decode-tiles.json
    TRITON_INTERPRET=1 python benchmarks/decode_tiles.py --small --out /tmp/decode-tiles.json  # CPU smoke

Cases and candidates: ``decode_tiles_cases.py``. Each entry (a tile rule of ``linear`` /
``moe.experts`` / ``linear_plain.plain``, or ``mhc.hc_coefficients``) runs the profile's own
values first (the baseline, in the same run), then its candidates merged into them (a copy of the
active profile, as ``flashrt tune`` does); a candidate is timed on every case that uses the entry (``flashrt.timing.bench_ms``:
CUDA-graph replay medians; a host-clock sample under the interpreter) after its result is checked
against the reference backend. The score of a candidate is the sum over its cases of time x
launches per decode step; a candidate wrong or failing on any case, or cut by the budget (each
entry gets an equal share of the time left when it starts), does not compete. Writes the JSON of
every timing and, next to it (``--fragment``), a YAML fragment of ``tiles`` for the profile with
each entry's winner where it beats the baseline.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import types

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_tiles_cases import candidates, cases  # noqa: E402
from results_io import write_json  # noqa: E402

from flashrt import checks, dispatch, ops, profiles  # noqa: E402
from flashrt.graphs.config import shipped_config  # noqa: E402
from flashrt.tune import _module_tiles, _with_tiles  # noqa: E402

# rel. error vs the reference a candidate may have (the kernel tests' bounds; where the baseline's
# own error is above them, 1.5x the baseline's)
TOL = {"linear": 2e-3, "moe": 3e-3, "mhc": 1e-2, "linear_plain": 4e-3}


def rel_err(got, want) -> float:
    """Largest ||got - want|| / ||want|| over the outputs (a tuple for hc_coefficients)."""
    if isinstance(got, tuple):
        return max(rel_err(g, w) for g, w in zip(got, want))
    g, w = got.double(), want.double()
    if not torch.equal(torch.isfinite(g), torch.isfinite(w)):
        return float("inf")
    fin = torch.isfinite(w)
    return float((g[fin] - w[fin]).norm() / w[fin].norm().clamp_min(1e-30))


def time_call(fn, gpu: bool) -> dict:
    """{"ms", "plain_ms"}: graph-replay median (plain when uncapturable) on a GPU; one host sample else."""
    if gpu:
        from flashrt.timing import bench_ms

        t = bench_ms(fn, warmup=10, rep=40)
        return {"ms": float(t.ms), "plain_ms": t.plain, "note": t.note}
    t0 = time.perf_counter()
    fn()
    return {"ms": (time.perf_counter() - t0) * 1e3, "plain_ms": None, "note": "host clock (no GPU)"}


class _Grids:
    """Stands in for a Triton kernel (``kernel[grid](...)``) and records each launch's grid."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        self.seen.append([int(g) for g in grid])
        return self.kernel[grid]


@contextlib.contextmanager
def recording_grids():
    """{kernel name: [grid, ...]} of the swept kernels launched inside the block."""
    from flashrt.kernels_cuda import linear, linear_plain, mhc, moe

    seen: dict = {}
    swaps = [(linear, "_linear_kernel"), (moe, "_moe_up_kernel"), (moe, "_moe_down_kernel"),
             (mhc, "_hc_coefficients_kernel"),
             (linear_plain, "_plain_linear_kernel")]
    kept = [(mod, name, getattr(mod, name)) for mod, name in swaps]
    try:
        for mod, name, kernel in kept:
            setattr(mod, name, _Grids(kernel, seen.setdefault(name, [])))
        yield seen
    finally:
        for mod, name, kernel in kept:
            setattr(mod, name, kernel)


def run_case(case, profile, gpu: bool) -> tuple:
    """(cuda result, timing with the grids of the first call) of one case under ``profile``;
    raises what the launch raises."""
    fn = getattr(ops, case.op)
    with profiles.using(profile), dispatch.use_backend("cuda"), checks.value_checks(False):
        with recording_grids() as grids:
            got = fn(*case.args)
        t = time_call(lambda: fn(*case.args), gpu)
        return got, dict(t, grids={k: v for k, v in grids.items() if v})


def sweep_group(group, members, base, gpu: bool, deadline: float, limit, hard_end: float = float("inf")) -> dict:
    """Every candidate of one profile entry over its cases: rows of timings, scores, the winner.
    A candidate starts only before ``deadline`` (the baseline always), and stops at ``hard_end``
    (the whole sweep's end: then it does not compete)."""
    module, key, rule = group
    sp = types.SimpleNamespace(module=module, key=key, rule=rule)
    current = profiles.tiles(module, _module_tiles(module))[key]
    last_rule = rule is not None and current[rule][0] is None
    tol, rows, scores = TOL[module], [], []
    for i, values in enumerate(candidates(group, last_rule, limit)):
        if i and time.monotonic() > deadline:
            scores.append(dict(values=values, score_ms=None, why="budget spent"))
            continue
        profile = _with_tiles(base, sp, values, rule)
        total, why = 0.0, None
        for case in members:
            if i and time.monotonic() > hard_end:
                why = "budget spent"
                break
            row = dict(entry=f"{module}.{key}" + (f"[{rule}]" if rule is not None else ""), values=values,
                       case=case.name, batch=case.batch, per_step=case.per_step)
            try:
                got, t = run_case(case, profile, gpu)
                row.update(t, rel_err=rel_err(got, case.want))
                if row["rel_err"] > max(tol, 1.5 * case.base_err if i else tol):
                    row["why"] = "wrong"
            except Exception as exc:  # a tile that cannot compile or run: recorded, never fatal
                row["why"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
            if i == 0:  # a baseline that fails (wrong included) or is not finite widens no later bound
                err = row.get("rel_err", 0.0) if not row.get("why") else 0.0
                case.base_err = err if math.isfinite(err) else 0.0
            rows.append(row)
            why = why or row.get("why")
            total += row.get("ms", 0.0) * case.per_step
        scores.append(dict(values=values, score_ms=None if why else total, why=why))
    ok = [s for s in scores if s["score_ms"] is not None]
    base_score = scores[0]["score_ms"]
    # a winner only against a measured baseline: without one nothing says the profile's tiles lose
    best = min(ok, key=lambda s: s["score_ms"]) if ok and base_score is not None else None
    return dict(entry=dict(module=module, key=key, rule=rule), cases=[c.name for c in members], rows=rows,
                scores=scores, baseline_ms=base_score, winner=best["values"] if best else None,
                winner_ms=best["score_ms"] if best else None,
                speedup=base_score / best["score_ms"] if best and base_score and best["score_ms"] else None)


def fragment(results: list[dict], base) -> dict:
    """{module: {key: value}} for each entry whose winner is not the baseline: a rule list whole (the
    profile's rules with the winner merged into the swept one), a mapping's winning values."""
    out: dict = {}
    for r in results:
        e = r["entry"]
        if not r["winner"]:
            continue
        if e["rule"] is None:
            out.setdefault(e["module"], {}).setdefault(e["key"], {}).update(r["winner"])
            continue
        rules = out.get(e["module"], {}).get(e["key"])
        if rules is None:
            rules = [[limit, dict(tile)] for limit, tile in profiles.tiles(e["module"], _module_tiles(e["module"]))[e["key"]]]
        rules[e["rule"]][1].update(r["winner"])
        out.setdefault(e["module"], {})[e["key"]] = rules
    return out


def _flow(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 16).strip()


def fragment_yaml(frag: dict) -> str:
    """``tiles:`` as the profiles write it: one ``- [limit, {tile}]`` line per rule."""
    if not frag:
        return "tiles: {}  # no candidate beat the profile's tiles\n"
    lines = ["tiles:"]
    for module, entries in frag.items():
        lines.append(f"  {module}:")
        for key, value in entries.items():
            if isinstance(value, list):
                lines += [f"    {key}:"] + [f"      - {_flow(rule)}" for rule in value]
            else:
                lines.append(f"    {key}: {_flow(value)}")
    return "\n".join(lines) + "\n"


def sweep(model: str, batches, budget: float, limit=None, progress=print) -> dict:
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    cfg = shipped_config(model)
    base = profiles.active_profile()
    torch.manual_seed(0)
    all_cases = cases(cfg, batches, dev, lambda m: profiles.tiles(m, _module_tiles(m)))
    with dispatch.use_backend("reference"):
        for c in all_cases:
            c.want = getattr(ops, c.op)(*c.args)
    groups: dict = {}
    for c in all_cases:
        groups.setdefault(c.group, []).append(c)
    end, results = time.monotonic() + budget, []
    for i, (group, members) in enumerate(sorted(groups.items(), key=lambda g: str(g[0]))):
        share = (end - time.monotonic()) / (len(groups) - i)
        r = sweep_group(group, members, base, gpu, time.monotonic() + share, limit, end)
        results.append(r)
        progress(f"{r['entry']}: baseline {r['baseline_ms']} ms/step, winner {r['winner']} {r['winner_ms']} ms/step")
    import triton

    return dict(model=model, batches=list(batches), device=torch.cuda.get_device_name() if gpu else "cpu",
                torch=torch.__version__, triton=triton.__version__, profile=base.name, timing="CUDA-graph replay median (flashrt.timing.bench_ms)" if gpu else "host clock",
                budget_s=budget, results=results, fragment=fragment(results, base))


def write_fragment(path: str, report: dict) -> None:
    lines = [f"# decode tiles of {report['model']} on {report['device']} (benchmarks/decode_tiles.py), "
             f"batches {report['batches']}: merge into the profile's tiles"]
    for r in report["results"]:
        if r["winner"]:
            lines.append(f"# {r['entry']}: {r['winner']} {r['winner_ms']:.4f} ms/step (baseline "
                         f"{r['baseline_ms']:.4f}, {r['speedup']:.2f}x)")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n" + fragment_yaml(report["fragment"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", help="shipped config (default small)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the whole sweep (default 200)")
    ap.add_argument("--small", action="store_true", help="tiny shapes and two candidates an entry (CPU smoke)")
    ap.add_argument("--out", required=True, help="JSON of every timing")
    ap.add_argument("--fragment", default=None, help="YAML fragment (default: --out with .yaml)")
    args = ap.parse_args(argv)
    if not 0 < args.budget < float("inf"):
        ap.error(f"--budget: expected seconds > 0, got {args.budget}")
    if any(b < 1 for b in args.batches):
        ap.error(f"--batches: expected counts >= 1, got {args.batches}")
    model, batches, limit = ("tiny", [1], 1) if args.small else (args.model, args.batches, None)
    report = sweep(model, batches, args.budget, limit)
    write_json(args.out, report)
    frag = args.fragment or os.path.splitext(args.out)[0] + ".yaml"
    write_fragment(frag, report)
    print(f"wrote {args.out} and {frag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
