"""Whether a shipped kernel plan's entries compile under the same Triton cache keys as the variants the
kernel families' warm-up launches record: a plan entry and a warm-up case that are the same variant
(:func:`flashrt.jit_parallel.spec_key`) must give the same source hash and option hash, which with the
target make the key ``triton.compile`` files the kernel under.

    FLASHRT_PROFILE=h200 V/bin/python tools/plan_keys.py --model small [--arch sm_90] [--json FILE]

Needs the plan's Triton version (``V``: a virtual environment with it) and its NVIDIA backend; no GPU
(the hashes are computed for ``--arch`` as the compile pool computes them). Per kernel: the variants
the plan and the warm-up share with equal hashes, those whose hashes differ (with what differs), and
those the plan alone holds.
"""
from __future__ import annotations

import argparse
import collections
import json

from flashrt import dispatch, jit_parallel, jit_plans, profiles
from flashrt.engine.precompile import kernel_dims
from flashrt.graphs.config import shipped_config
from flashrt.jit_compile import answering_as, source
from flashrt.jit_targets import parse_arch


def hashes(spec: jit_parallel.Spec) -> tuple[str, str]:
    """(source hash, options hash) of ``spec`` as ``triton.compile`` computes them for its target."""
    from triton.compiler.compiler import make_backend

    fn = jit_parallel.resolve(spec)
    with answering_as(spec.cc) as target:
        return (source(fn, spec.signature, spec.constexprs, spec.attrs).hash(),
                make_backend(target).parse_options(dict(spec.options)).hash())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    arch, profile = parse_arch(args.arch, "--arch"), profiles.active_profile()
    dispatch.families()
    models = {args.model: kernel_dims(shipped_config(args.model))}
    planned = jit_plans.load(arch, jit_plans.profile_names(profile), args.model)
    cases = {jit_parallel.spec_key(c): c for c in jit_parallel.plan(arch, profile, models, plans=False)[0]}
    same, differ, plan_only = collections.Counter(), {}, collections.Counter()
    for spec in planned:
        case = cases.get(jit_parallel.spec_key(spec))
        if case is None:
            plan_only[spec.name] += 1
            continue
        (src_p, opt_p), (src_c, opt_c) = hashes(spec), hashes(case)
        if (src_p, opt_p) == (src_c, opt_c):
            same[spec.name] += 1
        else:
            differ.setdefault(spec.name, []).append({"source": src_p != src_c, "options": opt_p != opt_c})
    report = {"model": args.model, "arch": arch.name, "profile": profile.name, "planned": len(planned),
              "cases": len(cases), "same": dict(same), "differ": differ, "plan_only": dict(plan_only)}
    print(f"{len(planned)} planned, {len(cases)} warm-up cases: {sum(same.values())} shared with equal hashes, "
          f"{sum(len(v) for v in differ.values())} with different ones, {sum(plan_only.values())} in the plan alone")
    for name, rows in differ.items():
        print(f"  differ: {name} x{len(rows)} {rows[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
