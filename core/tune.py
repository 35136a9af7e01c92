"""``flashrt tune``: sweep kernel tile spaces on this device and write a profile with the winners.

For each space of :data:`flashrt.tune_spaces.SPACES` (attention tiles and split-K settings, FP8
linear and MoE expert tiles per rule, indexer, quantize, rms_norm, top-k) every combination of its
candidate values runs the op on the ``cuda`` backend with those tiles (a copy of the active
profile with them merged in), is checked against the reference (a wrong candidate never wins) and
timed (median of ``triton.testing.do_bench`` on a GPU; a wall-clock median under the Triton
interpreter). The profile's current tiles are tried first, so the winner is never a tile that was
not measured against them. A candidate that cannot run (shared memory overflow, a compile error)
is skipped with a note, never fatal; candidates past the space's share of ``budget`` seconds are
skipped too. The output YAML is the active profile with the winning tiles, and each winner's time
and the untuned time as comments; ``--out`` must be a new file or a profile the command wrote before
(checked before the sweep, :mod:`flashrt.out_files`).
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from pathlib import Path

import torch
import yaml

from . import checks, dispatch, ops, profiles, tile_checks
from .out_files import OutFile, first_line
from .progress import Progress
from .tune_spaces import SPACES, Space

DEFAULT_BUDGET_S = 330.0  # the whole sweep, about 5.5 minutes


def _time_ms(fn, gpu: bool) -> float:
    """GPU: the median of CUDA-graph replays of ``fn`` (the kernels' time, no launcher host work or
    launch gaps: what a captured decode step sees; ``flashrt.bench``'s timing), the plain
    ``do_bench`` median where ``fn`` cannot be captured. Elsewhere: a host-clock median."""
    if gpu:
        from .timing import bench_ms

        return float(bench_ms(fn, warmup=10, rep=40).ms)
    fn()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _module_tiles(module: str) -> dict:
    """The tile defaults of the cuda backend's kernel family ``module`` (reached through dispatch)."""
    family = dispatch.family(module, "cuda")
    if family is None:
        raise ValueError(f"kernels: the cuda backend declares no kernel family {module!r}")
    return family.tiles


def rule_index(profile, sp: Space, small: bool) -> int | None:
    """For a rule-list space, the index of ``profile``'s rule that serves the space's case: the first whose
    limit covers the case's rows and whose ``max_weights`` (where set) its weight elements, as the kernels
    pick them. A profile may hold more rules than the kernels' defaults, so the space's own ``rule`` (an
    index into those) can name another rule there. None for spaces without rules."""
    if sp.rule is None:
        return None
    with profiles.using(profile):
        rules = profiles.tiles(sp.module, _module_tiles(sp.module))[sp.key]
    rows, weights = sp.case.rows[small], getattr(sp.case, "weights", {}).get(small)
    for i, (limit, tile) in enumerate(rules):
        if ((limit is None or rows <= limit)
                and (weights is None or tile.get("max_weights") is None or weights <= tile["max_weights"])):
            return i
    raise ValueError(f"tiles.{sp.module}.{sp.key}: expected a rule serving {rows} rows, got limits "
                     f"{[limit for limit, _ in rules]}")


def _current(profile, sp: Space, rule: int | None = None) -> dict:
    """The tile values ``profile`` gives the space (rule ``rule``'s tile for rule lists; None, the space's
    own index)."""
    rule = sp.rule if rule is None else rule
    with profiles.using(profile):
        current = profiles.tiles(sp.module, _module_tiles(sp.module))[sp.key]
    return dict(current[rule][1]) if rule is not None else dict(current)


def _with_tiles(base, sp: Space, values: dict, rule: int | None = None):
    """A copy of profile ``base`` with ``values`` merged into the space's tiles (rule ``rule``'s for rule lists;
    None, the space's own index)."""
    rule = sp.rule if rule is None else rule
    with profiles.using(base):
        current = profiles.tiles(sp.module, _module_tiles(sp.module))[sp.key]
    if rule is not None:  # rule lists: [[limit, tile], ...] as the YAML holds them
        new = [[limit, {**tile, **values} if i == rule else dict(tile)] for i, (limit, tile) in enumerate(current)]
    else:
        new = {**current, **values}
    tiles = {m: dict(t) for m, t in base.tiles.items()}
    tiles.setdefault(sp.module, {})[sp.key] = new
    return dataclasses.replace(base, tiles=tiles)


def _close(got, want) -> bool:
    if isinstance(got, torch.Tensor) and not torch.is_floating_point(got):
        return torch.equal(got, want)
    if hasattr(got, "data") and hasattr(got, "fmt"):
        return torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    g, w = got.double(), want.double()
    fin = torch.isfinite(w)
    return bool(torch.equal(torch.isfinite(g), fin)) and float((g[fin] - w[fin]).norm() / w[fin].norm().clamp_min(1e-30)) < 2e-2


def _current_values(base, sp: Space, rule: int | None, params: dict) -> dict | None:
    """The profile's values of every one of ``params`` (rule ``rule``'s for rule lists), or None where it
    sets not all of them."""
    current = {k: v for k, v in _current(base, sp, rule).items() if k in params}
    return current if len(current) == len(params) else None


def candidates(base, sp: Space, rule: int | None = None, params: dict | None = None) -> list[dict]:
    """The profile's current values (of rule ``rule`` for rule lists; None, the space's own index) first,
    then the grid of ``params`` (default: the space's MMA tile ``params``), without repeating them."""
    params = sp.params if params is None else params
    current = _current_values(base, sp, rule, params)
    grid = [dict(zip(params, combo)) for combo in itertools.product(*params.values())]
    return [current] + [c for c in grid if c != current] if current is not None else grid


def launch_path(base, sp: Space, case: tuple) -> str:
    """The launch the space's case (op name, args) takes under profile ``base`` on the cuda backend (the
    family's ``paths``; ``tile`` for ops without them)."""
    op, args = case
    path = dispatch.family(sp.module, "cuda").paths.get(op)
    if path is None:
        return "tile"
    with profiles.using(base), dispatch.use_backend("cuda"):
        return path(*args)


def swept(base, name: str, small: bool, case: tuple) -> tuple[Space, str, int | None, dict | None]:
    """(the space as swept, the launch its case takes, the rule swept, its parameters: None, nothing to sweep)."""
    path = launch_path(base, SPACES[name], case)
    sp = SPACES[name].for_path(path)
    return sp, path, rule_index(base, sp, small), SPACES[name].params_for(path)


def _try(fn, args, want, profile, gpu: bool) -> tuple[float, str | None]:
    """(median ms, None), or (inf, why) when the candidate is wrong or cannot run."""
    try:
        with profiles.using(profile), dispatch.use_backend("cuda"), checks.value_checks(False):
            if not _close(fn(*args), want):
                return float("inf"), "wrong"
            return _time_ms(lambda: fn(*args), gpu), None
    except Exception as exc:  # shared memory overflow, compile errors: skip the candidate, keep sweeping
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return float("inf"), f"{type(exc).__name__}: {first[:160]}"


def tune_kernel(name: str, base, dev, small: bool, step, deadline: float = float("inf")) -> dict:
    op, args = SPACES[name].case(dev, small)
    fn, gpu = getattr(ops, op), dev.type == "cuda"
    sp, path, rule, params = swept(base, name, small, (op, args))
    if params is None:
        return {"name": name, "module": sp.module, "key": sp.key, "rule": rule, "path": path, "winner": None,
                "ms": float("inf"), "untuned_ms": float("inf"), "untuned_note": None, "candidates": 0, "rejected": 0,
                "failed": 0, "skipped": 0,
                "notes": [f"the profile runs this case on the {path} launch, which reads no tile of the rule: "
                          "nothing to sweep, the tiles are kept"]}
    with dispatch.use_backend("reference"):
        want = fn(*args)
    tried, notes, skipped = [], [], 0
    for values in candidates(base, sp, rule, params):
        if time.monotonic() > deadline:
            skipped += 1
        else:
            ms, why = _try(fn, args, want, _with_tiles(base, sp, values, rule), gpu)
            tried.append((ms, values, why))
            if why:
                notes.append(f"{values}: {why}")
        step()
    if tried and tried[0][1] == _current_values(base, sp, rule, params):  # the profile's tiles, timed first
        untuned, untuned_why = tried[0][0], tried[0][2]
    else:
        untuned, untuned_why = _try(fn, args, want, base, gpu)
    ran = [(ms, values) for ms, values, why in tried if why is None]
    best_ms, best = min(ran, key=lambda r: r[0]) if ran else (float("inf"), None)
    if best is None:
        notes.append("no candidate ran correctly: the profile's tiles are kept")
    if skipped:
        notes.append(f"{skipped} candidates not tried: the time budget was spent")
    wrong = sum(why == "wrong" for _, _, why in tried)
    return {"name": name, "module": sp.module, "key": sp.key, "rule": rule, "path": path, "winner": best,
            "ms": best_ms, "untuned_ms": untuned, "untuned_note": untuned_why, "candidates": len(tried),
            "rejected": wrong, "failed": len(tried) - len(ran) - wrong, "skipped": skipped, "notes": notes}


def tune(kernels=None, small: bool | None = None, progress=None, budget: float = DEFAULT_BUDGET_S):
    """Tune ``kernels`` (default: all of SPACES) within ``budget`` seconds; returns (tuned Profile,
    per-space results). Each space gets an equal share of the time still left when it starts."""
    kernels = list(kernels or SPACES)
    unknown = sorted(set(kernels) - set(SPACES))
    if unknown:
        raise ValueError(f"kernels: expected names from {sorted(SPACES)}, got {unknown}")
    ok, why = dispatch.availability("cuda") if "cuda" in dispatch.backends() else (False, "not registered")
    if not ok:
        raise ValueError(f"kernels: the cuda backend is not available here ({why})")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = dev.type != "cuda" if small is None else small
    base = profiles.active_profile()
    total = 0
    for k in kernels:  # the candidates of the launch each case takes (its case built once more for the sweep)
        sp, _, rule, params = swept(base, k, small, SPACES[k].case(dev, small))
        total += 0 if params is None else len(candidates(base, sp, rule, params))
    done, end = [0], time.monotonic() + budget

    def step():
        done[0] += 1
        if progress:
            progress(done[0], total)

    results = []
    for i, k in enumerate(kernels):
        share = (end - time.monotonic()) / (len(kernels) - i)
        results.append(tune_kernel(k, base, dev, small, step, time.monotonic() + share))
    tuned = base
    for r in results:
        if r["winner"] is not None:  # into the tiles the winner's launch reads
            tuned = _with_tiles(tuned, SPACES[r["name"]].for_path(r["path"]), r["winner"], r["rule"])
    return tuned, results


def describe(r: dict) -> str:
    rule = f"[rule {r['rule']}]" if r["rule"] is not None else ""
    path = f", {r['path']} launch" if r.get("path", "tile") != "tile" else ""
    head = f"{r['module']}.{r['key']}{rule} ({r['name']}{path})"
    if r["winner"] is None:
        return f"{head}: no winner, tiles kept ({r['candidates']} tried)"
    return (f"{head}: {r['winner']} {r['ms'] * 1e3:.1f} us (untuned {r['untuned_ms'] * 1e3:.1f} us, "
            f"{r['untuned_ms'] / r['ms']:.2f}x; {r['candidates']} candidates, {r['rejected']} rejected as wrong, "
            f"{r['failed']} failed to run, {r['skipped']} not tried)")


def _differing_tiles(profile) -> dict:
    """The profile's tiles less what equals the cuda families' defaults: a profile holds only what
    differs on its device."""
    out = {}
    for name, given in profile.tiles.items():
        family = dispatch.family(name, "cuda")
        kept = tile_checks.differences(family.tiles, given) if family is not None else dict(given)
        if kept:
            out[name] = kept
    return out


TUNED_BY = "# tuned by `flashrt tune`"  # the first line of every profile it writes


def out_file(path: str) -> OutFile:
    """``--out`` of ``flashrt tune``: a new file or a profile it wrote before (:mod:`flashrt.out_files`)."""
    return OutFile(path, "flashrt tune", first_line(TUNED_BY))


def write_profile(profile, results: list[dict], out: str | OutFile, notes=()) -> Path:
    """Write ``profile`` (its tiles: only what differs from the defaults) with ``results`` and
    ``notes`` (lines) as comments, whole, to ``out`` (a path or :func:`out_file`); returns the path written."""
    profile = dataclasses.replace(profile, tiles=_differing_tiles(profile))
    lines = [f"{TUNED_BY} on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}"
             + (" (times: CUDA-graph replay medians)" if torch.cuda.is_available() else "")]
    lines += [f"# {describe(r)}" for r in results] + [f"# {n}" for n in notes]
    out = out if isinstance(out, OutFile) else out_file(out)
    return out.write("\n".join(lines) + "\n" + yaml.safe_dump(profile.to_dict(), sort_keys=False))


def cmd(args) -> int:
    if not 0 < args.budget < float("inf"):  # NaN fails too
        raise ValueError(f"--budget: expected seconds > 0, got {args.budget}")
    out = out_file(args.out)
    out.check()  # before the sweep: a path it may not write fails now, not after minutes of timing
    tuned, results = tune(args.kernels, progress=Progress("tuning"), budget=args.budget)
    written = write_profile(tuned, results, out)
    for r in results:
        print(describe(r))
        for note in r["notes"]:
            print(f"    {note}")
    print(f"wrote {written}")
    return 0


def add_parser(sub):
    from flashrt.argtypes import nonempty

    p = sub.add_parser("tune", help="sweep kernel tiles on this device; write a profile with the winners")
    p.add_argument("--out", required=True, type=nonempty("file name"), help="profile YAML to write")
    p.add_argument("--kernels", nargs="+", default=None, help=f"subset of {sorted(SPACES)}")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds for the whole sweep (default {DEFAULT_BUDGET_S:.0f})")
    p.set_defaults(func=cmd)
    return p
