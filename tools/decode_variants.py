"""At which decode positions a run first meets a Triton kernel variant (one more mid-run compile).

    python tools/decode_variants.py --model small --batch 8 --prompt 500 --steps 300 [--json OUT]
    python tools/decode_variants.py --model small --batch 8 --prompt 500 --steps 300 --profile h200 --arch sm_90

How: a model of ``--model``'s shipped config (random weights) runs a prefill of ``--prompt`` random
tokens per row and then ``--steps`` decode steps, on the CPU, through the CUDA backend's launchers
with ``--profile``'s tiles; every Triton launch is recorded for ``--arch`` instead of compiled and
run (:func:`flashrt.jit_compile.recording`). A variant is Triton's cache key less the source
(signature, constexprs, specialisation attributes, options). Printed: per decode position, the
variants first met there; after the first step (the decode's own shapes), each with the fields
that differ from the closest variant of the same kernel met before (a block size, an integer
Triton specialised on, ``== 1`` or ``% 16 == 0``).

Two patches, for this process only (undone on exit from :func:`trace`):

- the CUDA backend is made available and allowed on CPU tensors (no device is needed to plan its
  launches; the kernels are never run);
- ``torch.empty`` / ``torch.empty_like`` return zeros: the launchers' outputs are never written
  (nothing runs), and uninitialised memory read back as positions, counts or indices would send
  the data flow anywhere; zeros keep it valid (every index in range), though not the model's.

Positions depend on the model's data only where a launcher branches on values (routing counts):
with zeros those are the zero-data paths. Kernels whose variants follow the entry count (the
indexer's and top-k's) are what this tool is for; see docs/performance.md.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # launches must reach Triton's compile path to be recorded
import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import dispatch, profiles  # noqa: E402
from flashrt.errors import FlashrtError  # noqa: E402
from flashrt.jit_compile import kernel_name, recording, variant_key  # noqa: E402
from flashrt.jit_parallel import portable_options  # noqa: E402
from flashrt.jit_targets import parse_arch  # noqa: E402
from jit_coverage import fields  # noqa: E402  (tools/ is on the path when a tool runs)


@contextlib.contextmanager
def cuda_on_cpu():
    """The CUDA backend chosen, available and serving CPU tensors (launches are recorded, not run)."""
    real = dispatch.backends()["cuda"]
    dispatch.reset_table()
    dispatch._STATE.backends["cuda"] = dataclasses.replace(real, explicit_device_types=("cpu",))
    dispatch._STATE.availability["cuda"] = (True, "")
    try:
        with dispatch.use_backend("cuda"):
            yield
    finally:
        dispatch._STATE.backends["cuda"] = real
        dispatch.reset_table()


@contextlib.contextmanager
def empty_as_zeros():
    """``torch.empty`` / ``torch.empty_like`` -> zeros (see the module docstring for why)."""
    empty, empty_like, zeros, zeros_like = torch.empty, torch.empty_like, torch.zeros, torch.zeros_like
    torch.empty = lambda *a, **k: zeros(*a, **{n: v for n, v in k.items() if n != "memory_format"})
    torch.empty_like = lambda *a, **k: zeros_like(*a, **k)
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def trace(cfg, batch: int, prompt: int, steps: int, profile, arch, seed: int = 0) -> list[dict]:
    """Every variant a run of the model ``cfg`` (a ``ModelConfig``, random weights) launches, in the
    order first met: ``{"kernel", "at", "fields"}`` with ``at`` ``"prefill"`` or the decode position
    (the index of the token the step reads)."""
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    seen, where = {}, {"at": "prefill"}

    def record(fn, signature, constexprs, options, attrs):
        name = kernel_name(fn)
        key = variant_key(fn.__module__, name, signature, constexprs, attrs, portable_options(options.__dict__))
        if key not in seen:
            seen[key] = {"kernel": name, "at": where["at"],
                         "fields": fields(fn, signature, constexprs, attrs, options.__dict__)}

    torch.manual_seed(seed)
    with profiles.using(profile), cuda_on_cpu(), empty_as_zeros():
        m = Model(cfg, init_weights(cfg, seed=seed, device="cpu"))
        ids = torch.randint(0, cfg.vocab_size, (batch, prompt))
        with flashrt.value_checks(False), recording(arch, record):
            state = m.new_state(batch, prompt + steps + 8)
            m.forward(ids, state=state)
            tok = torch.zeros(batch, 1, dtype=torch.long)
            for s in range(steps):
                where["at"] = prompt + s
                m.forward(tok, state=state)
    return list(seen.values())


def closest_diff(v: dict, before: list[dict]) -> dict | None:
    """The fields where ``v`` differs from the closest earlier variant of its kernel (None: none)."""
    best = None
    for o in before:
        if o["kernel"] != v["kernel"]:
            continue
        a, b = v["fields"], o["fields"]
        diff = {f: [a.get(f), b.get(f)] for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)}
        best = diff if best is None or len(diff) < len(best) else best
    return best


def report(variants: list[dict], first_step: int) -> dict:
    """{position: [{"kernel", "differs"}]} for every decode position with a variant first met."""
    out = collections.defaultdict(list)
    for i, v in enumerate(variants):
        if v["at"] == "prefill":
            continue
        differs = None if v["at"] == first_step else closest_diff(v, variants[:i])
        out[v["at"]].append({"kernel": v["kernel"], "differs": differs})
    return dict(out)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return n


def target_args(ap: argparse.ArgumentParser) -> None:
    """The options a tool of this kind shares: the model, the profile and architecture recorded for, the JSON out."""
    ap.add_argument("--model", default="small", help="a shipped config: tiny, small, v4.1-flash, tiny-vl")
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--json", default=None, metavar="OUT")


def load_target(args, tool: str):
    """(config, profile, architecture) that ``args`` name, or None after printing why to stderr."""
    from flashrt.graphs.config import shipped_config

    try:
        return shipped_config(args.model), profiles.load_profile(args.profile), parse_arch(args.arch)
    except (ValueError, FlashrtError) as exc:
        print(f"{tool}: {exc}", file=sys.stderr)
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target_args(ap)
    ap.add_argument("--batch", type=_positive, default=8)
    ap.add_argument("--prompt", type=_positive, default=500, help="prompt tokens per row")
    ap.add_argument("--steps", type=_positive, default=300, help="decode steps")
    args = ap.parse_args(argv)
    target = load_target(args, "decode_variants")
    if target is None:
        return 2
    cfg, profile, arch = target
    variants = trace(cfg, args.batch, args.prompt, args.steps, profile, arch)
    by_pos = report(variants, args.prompt)
    for pos, news in by_pos.items():
        print(f"position {pos}: {len(news)} new: {', '.join(sorted({n['kernel'] for n in news}))}")
        for n in news if pos != args.prompt else ():
            diff = n["differs"]
            print(f"    {n['kernel']}: " + ("no earlier variant of this kernel" if diff is None else
                                            "; ".join(f"{f} {a} (was {b})" for f, (a, b) in diff.items())))
    later = [p for p in by_pos if p != args.prompt]
    n_pre = sum(v["at"] == "prefill" for v in variants)
    print(f"{args.model}, batch {args.batch}, prompt {args.prompt}, {args.steps} steps on {arch.name} ({profile.name}): "
          f"{n_pre} variants in the prefill, {len(by_pos.get(args.prompt, []))} at the first step; "
          f"positions with new variants after it: {later or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "batch": args.batch, "prompt": args.prompt, "steps": args.steps,
                       "profile": profile.name, "arch": arch.name, "prefill_variants": n_pre,
                       "positions": {str(p): news for p, news in by_pos.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
