"""Which Triton variants a run launches that the kernel families' warm-up cases do not compile.

    python tools/jit_coverage.py --model tiny [--profile h200 --arch sm_90 --max-new-tokens 4] [--json FILE]
    python tools/jit_coverage.py --model small --max-new-tokens 16 --plan-out core/jit_plans   # ship a plan

How: the model runs on the CPU on the reference backend (its numbers decide the data-dependent
launches: routing counts, picked positions), with the profile's formats and tiles; every op the
CUDA backend serves is also called on the CUDA backend's implementation, on copies of its arguments,
with each Triton specialization it would launch on ``--arch`` recorded instead of compiled
(:func:`flashrt.jit_compile.recording`). The variants recorded are compared with those the warm-up
cases plan at the model's dims (:func:`flashrt.jit_parallel.plan`); for each one missing, the
closest planned variant of the same kernel and the fields that differ are printed (a constexpr
block size, an integer Triton specialised on, ``== 1`` or ``% 16 == 0``, a format). A run on the
device can differ where the engine takes device-only paths (CUDA graphs, memory-sized pools).

It also lists the variants no kernel plan a cold start reads has (the shipped one, or a recording in the
cache): what a cold start compiles in the run even with its plan, where a change brought a new variant.

``--plan-out DIR`` writes every variant the run launched as a plan (:mod:`flashrt.jit_plans`) under
``DIR/triton-<version>/``: with ``core/jit_plans`` it ships with flashrt, and a cold start on that
architecture, profile and Triton version compiles those variants on its pool before the run asks.
Run it with the Triton version of the target machine. A plan recorded by a run on the device
(``flashrt jit warmup --model M`` writes ``$FLASHRT_CACHE_DIR/jit/plans/...``) is exact; merge that
into the shipped one (``tools/ship_plan.py``) instead where a device is at hand.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402

from flashrt import dispatch, ops, profiles  # noqa: E402
from flashrt.formats import QTensor  # noqa: E402
from flashrt.jit_compile import Variant, recording  # noqa: E402
from flashrt.jit_parallel import Spec, plan, portable_options, spec_key  # noqa: E402
from flashrt.jit_targets import parse_arch  # noqa: E402


def _copy(a):
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, (QTensor, torch.Generator)) or hasattr(a, "__dict__"):
        return copy.deepcopy(a)
    if isinstance(a, (list, tuple)):
        items = [_copy(x) for x in a]
        return type(a)(*items) if hasattr(a, "_fields") else type(a)(items)
    return a


def key_of(module, name, signature, constexprs, attrs, options) -> tuple:
    """:func:`flashrt.jit_parallel.spec_key` of a variant."""
    return spec_key(Spec(module, name, signature, constexprs, attrs, portable_options(options), 0))


def trace(model: str, profile, arch, max_new_tokens: int, prompt: str) -> tuple[dict, dict]:
    """The variants a run of ``model`` launches on ``arch`` (key -> Variant), and the ops whose
    CUDA implementation raised on the copies (op -> error)."""
    from flashrt.engine import generate
    from flashrt.engine.run import builtin_checkpoint
    from flashrt.graphs.loader import load

    cuda, variants, errors, where = dispatch.backends()["cuda"], {}, {}, {}

    def record(fn, signature, constexprs, options, attrs):
        k = key_of(fn.__module__, fn.fn.__qualname__, signature, constexprs, attrs, options.__dict__)
        variants.setdefault(k, Variant(arch, fn, signature, constexprs, options, attrs)).launches.add(where["op"])

    real = ops._impl

    def shadowed(op, device):
        fn, kernel = real(op, device), cuda.ops.get(op)
        if kernel is None:
            return fn

        def both(*args):
            where["op"] = op
            try:
                with recording(arch, record):
                    kernel(*_copy(list(args)))
            except Exception as exc:  # the CUDA path refused these CPU copies: reported, the run goes on
                errors.setdefault(op, f"{type(exc).__name__}: {exc}")
            return fn(*args)
        return both

    path = builtin_checkpoint(model, quiet=True) if not os.path.isdir(model) else model
    m = load(path, device="cpu", profile=profile)
    modules = (ops, *ops.MODULES)  # every op group resolves through its module's own _impl
    for module in modules:
        module._impl = shadowed
    try:
        with profiles.using(profile):
            generate(m, [m.tokenizer.encode(prompt)], max_new_tokens)
    finally:
        for module in modules:
            module._impl = real
    return variants, errors


def plan_entries(variants: dict) -> list[dict]:
    """The traced variants as plan entries: Triton's own specialization data, as its
    ``jit_post_compile_hook`` gives it at a launch."""
    import inspect

    from triton.runtime import jit as triton_jit
    from triton.runtime.jit import serialize_specialization_data

    takes_target = "target" in inspect.signature(serialize_specialization_data).parameters
    full_name = getattr(triton_jit, "get_full_name", None)  # the name the hook writes (module.qualname where it has it)
    out = []
    for v in variants.values():
        options = SimpleNamespace(**portable_options(v.options.__dict__))  # no path of this machine
        name = full_name(v.fn.fn) if full_name else v.kernel
        args = (name, v.signature, v.constexprs, v.attrs, options, None)
        data = serialize_specialization_data(*args, _StandInTarget(v.arch)) if takes_target else \
            serialize_specialization_data(*args)
        out.append({"module": v.fn.__module__, "name": v.fn.fn.__qualname__, "data": data})
    return out


def not_in_plans(entries: list[dict], arch, profile, model: str) -> list[str]:
    """The kernels of the traced variants' plan entries (:func:`plan_entries`) that no plan a cold start
    of ``model`` reads lists (the cache's and the shipped, :func:`flashrt.jit_plans.entries`), told apart
    as those files tell them."""
    from flashrt import jit_plans

    have = {jit_plans.entry_key(e) for e in jit_plans.entries(arch, profile.lineage, model)}
    return [e["name"] for e in entries if jit_plans.entry_key(e) not in have]


def _StandInTarget(arch):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch.cc, 32)


def fields(fn, signature, constexprs, attrs, options) -> dict:
    names = fn.arg_names
    out = {f"constexpr {names[k[0]]}": str(v) for k, v in constexprs.items()}
    out |= {f"type {k}": v for k, v in signature.items()}
    out |= {f"attrs {names[k[0]]}": str(v) for k, v in attrs.items()}
    return out | {f"option {k}": str(v) for k, v in portable_options(options).items()}


def main() -> None:
    from flashrt.engine.precompile import kernel_dims
    from flashrt.engine.run import DEFAULT_PROMPT, model_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--plan-out", default=None, metavar="DIR", help="write the traced variants as a plan here")
    args = ap.parse_args()
    profile, arch, cfg = profiles.load_profile(args.profile), parse_arch(args.arch), model_config(args.model)
    variants, errors = trace(args.model, profile, arch, args.max_new_tokens, args.prompt)
    specs, _ = plan(arch, profile, {cfg.name: kernel_dims(cfg)}, plans=False)
    planned = {key_of(s.module, s.name, s.signature, s.constexprs, s.attrs, s.options): s for s in specs}
    missing = []
    for k, v in sorted(variants.items(), key=lambda kv: kv[1].kernel):
        if k in planned:
            continue
        mine = fields(v.fn, v.signature, v.constexprs, v.attrs, v.options.__dict__)
        best = None
        # the same kernel: its module too (two modules may name a kernel alike)
        for s in (s for s in specs if s.name == v.fn.fn.__qualname__ and s.module == v.fn.fn.__module__):
            other = fields(v.fn, s.signature, s.constexprs, s.attrs, s.options)
            diff = {f: [mine.get(f), other.get(f)] for f in sorted(set(mine) | set(other)) if mine.get(f) != other.get(f)}
            best = diff if best is None or len(diff) < len(best) else best
        missing.append({"kernel": v.kernel, "ops": sorted(v.launches), "closest_planned_differs": best})
        print(f"{v.kernel} ({', '.join(sorted(v.launches))}): " + ("no planned variant of this kernel" if best is None
              else "; ".join(f"{f} run {a} vs planned {b}" for f, (a, b) in best.items())))
    print(f"{args.model} on {arch.name} ({profile.name}): {len(variants)} variants launched, {len(missing)} not in "
          f"the warm-up cases' {len(planned)}; CUDA paths that refused the CPU copies: {errors or 'none'}")
    entries = plan_entries(variants)
    unplanned = not_in_plans(entries, arch, profile, cfg.name)
    print(f"{len(unplanned)} of them not in the kernel plans a cold start reads (jit_plans.plan_paths): "
          + (", ".join(unplanned) or "none"))
    if args.plan_out:
        from flashrt.jit_plans import plan_name

        import triton

        path = Path(args.plan_out) / f"triton-{triton.__version__}" / plan_name(arch, profile.name, cfg.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"arch": arch.name, "profile": profile.name, "model": cfg.name,
                                    "entries": entries}, indent=0) + "\n")
        print(f"plan of {len(variants)} variants written to {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "arch": arch.name, "profile": profile.name, "launched": len(variants),
                       "planned": len(planned), "missing": missing, "not_in_plans": unplanned, "errors": errors},
                      f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
