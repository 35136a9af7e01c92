"""Merge a kernel plan a run recorded (``FLASHRT_CACHE_DIR/jit/plans/triton-<version>/<name>.json``)
into the plan shipped with flashrt (``core/jit_plans/triton-<version>/<name>.json``).

    python tools/ship_plan.py RECORDED.json [RECORDED.json ...] [--triton 3.6.0] [--drop-rest]
                              [--after | --beside] [--option NAME=JSON ...] [--drop-bits NAME=MASK ...]

The recorded entries come first, in the order the run first loaded them (the order a cold start's
compile pool compiles them in), then the shipped entries the recording lacks (variants of other
runs: other batch sizes, serving), unless ``--drop-rest``, less those the current code cannot
compile (the kernel gone, or its parameters changed since they were recorded; trailing constexpr
parameters added with a default are filled in at it: ``with_defaults``); at most
``jit_plans.MAX_ENTRIES``. ``--after`` keeps the shipped entries first, in their order, and adds
the recording's new ones after them: a server's variants (``benchmarks/serve_start.py
--keep-plans``), which a run's cold start should not compile before its own. ``--beside`` keeps the
shipped entries in their order and puts each new one right after the variant the recording launched
before it: a CPU trace's few new variants (``tools/jit_coverage.py --plan-out``) where a run meets
them, without reordering a plan recorded on the device by the trace's order. ``--option
launch_pdl=true`` sets one Triton compile option in every entry: what the launches carry after a
profile change that sets it on every launch (``tiles.pdl.enabled``), without recording again.
``--drop-bits E2M1=64`` drops the shipped entries the recording lacks whose integer constexpr ``E2M1``
has a bit of 64 set: variants a profile change made unreachable (here the experts' codes in words, after
the profile left ``expert_fp4: words``), which a cold start would otherwise compile for nothing. The
Triton version is the recorded file's folder (``triton-<version>``) unless ``--triton`` names it. A
shipped plan given as RECORDED is rewritten in place (its entries brought to the code's parameters).
Prints, per file, the entries recorded, kept from before and dropped.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path

from flashrt.jit import atomic_write
from flashrt.jit_plans import MAX_ENTRIES, SHIPPED, entry_key, plan_text, read_entries


def shipped_path(recorded: Path, triton: str | None, root: Path = SHIPPED) -> Path:
    """Where the shipped plan of the same name and Triton version as ``recorded`` lives."""
    folder = f"triton-{triton}" if triton else recorded.parent.name
    if not folder.startswith("triton-"):
        raise ValueError(f"--triton: {recorded} is not in a triton-<version> folder; expected --triton VERSION")
    return root / folder / recorded.name


def _kernel_params(entry: dict) -> list[inspect.Parameter] | None:
    """The parameters of the kernel ``entry`` names, as the code has them now; None when it is gone."""
    try:
        fn = getattr(importlib.import_module(entry["module"]), entry["name"])
    except (ImportError, AttributeError, KeyError):
        return None
    return list(inspect.signature(getattr(fn, "fn", fn)).parameters.values())


def matches_code(entry: dict) -> bool:
    """Whether the entry's kernel exists with the parameters its signature names (a kernel that
    gained or lost a parameter since the entry was recorded would compile a variant no run loads)."""
    params = _kernel_params(entry)
    try:
        names = list(json.loads(entry["data"])["signature"])
    except (KeyError, ValueError):
        return False
    return params is not None and [p.name for p in params] == names


def with_defaults(entry: dict) -> dict:
    """``entry`` with the trailing constexpr parameters its kernel gained since it was recorded, each
    with a default, filled in at that default (the variant a launch leaving them out compiles);
    ``entry`` as it is when its parameters are the code's or differ otherwise."""
    params = _kernel_params(entry)
    try:
        data = json.loads(entry["data"])
        names = list(data["signature"])
    except (KeyError, ValueError, TypeError):
        return entry
    new = params[len(names):] if params is not None else []
    if not new or [p.name for p in params[:len(names)]] != names or not all(
            "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty for p in new):
        return entry
    for num, p in enumerate(new, start=len(names)):
        data["signature"][p.name] = "constexpr"
        data["constant_keys"].append([num])
        data["constant_vals"].append(p.default)
    return {**entry, "data": json.dumps(data)}


def with_options(entry: dict, options: dict) -> dict:
    """``entry`` with ``options`` (name -> value) set among its compile options."""
    if not options:
        return entry
    data = json.loads(entry["data"])
    data["options"] = {**data["options"], **options}
    return {**entry, "data": json.dumps(data)}


def parse_bits(text: str) -> tuple[str, int]:
    """``NAME=MASK`` of ``--drop-bits``: (constexpr name, integer mask)."""
    name, sep, mask = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, int(mask, 0)
    except ValueError:
        raise ValueError(f"--drop-bits: expected NAME=MASK with an integer MASK (e.g. E2M1=64), got {text!r}") from None


def has_bits(entry: dict, bits: dict) -> bool:
    """Whether one of the entry's integer constexprs named in ``bits`` (name -> mask) has a bit of its mask."""
    try:
        data = json.loads(entry["data"])
        names = list(data["signature"])
        values = {names[k[0]]: v for k, v in zip(data["constant_keys"], data["constant_vals"])}
    except (KeyError, ValueError, TypeError, IndexError):
        return False
    return any(isinstance(values.get(n), int) and values[n] & mask for n, mask in bits.items())


def parse_option(text: str) -> tuple[str, object]:
    """``NAME=JSON`` of ``--option``: (name, value)."""
    name, sep, value = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, json.loads(value)
    except ValueError:
        raise ValueError(f"--option: expected NAME=JSON (e.g. launch_pdl=true), got {text!r}") from None


def ship(recorded: Path, target: Path, drop_rest: bool = False, options: dict | None = None,
         after: bool = False, beside: bool = False, drop_bits: dict | None = None) -> dict:
    """Write ``target`` as ``recorded``'s entries then (unless ``drop_rest``) ``target``'s others,
    each with ``options`` set (:func:`with_options`); with ``after``, ``target``'s entries first (in
    their order) and then those of ``recorded`` it lacks; with ``beside``, ``target``'s entries in their
    order and each of ``recorded``'s it lacks right after the entry of the variant recorded before it
    (:func:`_beside`). ``target``'s entries the recording lacks go where :func:`has_bits` finds
    ``drop_bits`` in them."""
    try:
        header = json.loads(recorded.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"RECORDED: expected a plan file, got {recorded} ({exc})") from None
    entries = [with_options(with_defaults(e), options) for e in read_entries(recorded)]
    if not entries or not {"arch", "profile", "model"} <= set(header):
        raise ValueError(f"RECORDED: expected a plan file with entries, got {recorded}")
    first = _once(entries)
    recorded_keys = {entry_key(e) for e in first}
    old = [with_options(with_defaults(e), options) for e in read_entries(target)]
    # (options set, two old entries may now be one)
    rest = [e for e in old if entry_key(e) in recorded_keys
            or (not drop_rest and matches_code(e) and not has_bits(e, drop_bits or {}))]
    if not (after or beside):
        rest = [e for e in rest if entry_key(e) not in recorded_keys]
    merged = (_beside(rest, first) if beside else _once(rest + first if after else first + rest))[:MAX_ENTRIES]
    kept = sum(entry_key(e) not in recorded_keys for e in merged)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, plan_text(header["arch"], header["profile"], header["model"], merged))
    return {"file": str(target), "recorded": len(first), "kept": kept,
            "dropped": len(old) - sum(entry_key(e) in recorded_keys for e in old) - kept}


def _beside(shipped: list[dict], recorded: list[dict]) -> list[dict]:
    """``shipped`` in its order with each entry of ``recorded`` it lacks inserted right after the
    latest entry ``recorded`` has before it that is in the list (first where there is none): a run's
    new variants where the run meets them, the rest of a plan recorded on the device kept as it is."""
    merged = _once(shipped)
    keys = [entry_key(e) for e in merged]
    for i, e in enumerate(recorded):
        if entry_key(e) in keys:
            continue
        before = next((entry_key(p) for p in reversed(recorded[:i]) if entry_key(p) in keys), None)
        at = keys.index(before) + 1 if before is not None else 0
        merged.insert(at, e)
        keys.insert(at, entry_key(e))
    return merged


def _once(entries: list[dict]) -> list[dict]:
    """``entries`` with each variant (:func:`flashrt.jit_plans.entry_key`) at its first place only."""
    seen, out = set(), []
    for e in entries:
        if entry_key(e) not in seen:
            seen.add(entry_key(e))
            out.append(e)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recorded", nargs="+", type=Path, metavar="RECORDED")
    ap.add_argument("--triton", default=None, help="the Triton version (default: the recorded file's folder)")
    ap.add_argument("--drop-rest", action="store_true", help="keep only what the recording has")
    ap.add_argument("--after", action="store_true",
                    help="the shipped entries first, the recording's new ones after them (a server's variants: "
                         "a run's cold start keeps compiling its own first)")
    ap.add_argument("--beside", action="store_true",
                    help="the shipped entries in their order, each new one right after the variant the recording "
                         "has before it (a CPU trace's few new variants into a plan recorded on the device)")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=JSON",
                    help="set this Triton compile option in every entry (e.g. launch_pdl=true)")
    ap.add_argument("--drop-bits", action="append", default=[], metavar="NAME=MASK",
                    help="drop the shipped entries the recording lacks whose integer constexpr NAME has a bit of MASK "
                         "(e.g. E2M1=64: the experts' words)")
    args = ap.parse_args()
    try:
        options = dict(parse_option(o) for o in args.option)
        drop_bits = dict(parse_bits(b) for b in args.drop_bits)
        for path in args.recorded:
            if args.after and args.beside:
                raise ValueError("--after and --beside: expected one of them, got both")
            print(json.dumps(ship(path, shipped_path(path, args.triton), args.drop_rest, options, args.after,
                                  args.beside, drop_bits)))
    except ValueError as exc:
        ap.error(str(exc))


if __name__ == "__main__":
    main()
