"""Capture every kernel-served op call a model forward makes (on the reference), then replay each
on the CUDA kernels and report the calls whose results differ, with their shapes and strides.

    python tools/op_capture.py --model tiny --ops linear moe_experts sparse_attention
"""
from __future__ import annotations

import argparse

import torch

import flashrt
from flashrt import ops
from flashrt.formats import QTensor


def describe(a) -> str:
    if isinstance(a, QTensor):
        return f"Q{a.fmt}{tuple(a.shape)} data{tuple(a.data.stride())}"
    if isinstance(a, torch.Tensor):
        return f"{str(a.dtype)[6:]}{tuple(a.shape)}s{tuple(a.stride())}"
    if isinstance(a, tuple):
        return "(" + ", ".join(describe(x) for x in a) + ")"
    return repr(a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--ops", nargs="+", default=["linear", "moe_experts", "sparse_attention"])
    args = ap.parse_args()
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device="cuda"))
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    calls, originals = [], {name: getattr(ops, name) for name in args.ops}

    def recorder(name):
        def wrapped(*a):
            calls.append((name, a))
            return originals[name](*a)
        return wrapped

    for name in args.ops:
        setattr(ops, name, recorder(name))
    with flashrt.use_backend("reference"):
        model.forward(ids, all_positions=True)
    for name in args.ops:
        setattr(ops, name, originals[name])
    bad = 0
    for name, a in calls:
        with flashrt.use_backend("reference"):
            want = originals[name](*a)
        try:
            got = originals[name](*a)  # automatic: the kernels where they serve the call
        except Exception as exc:
            print(f"ERROR {name}: {exc}")
            continue
        rel = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
        if rel > 1e-2:
            bad += 1
            if bad <= 12:
                print(f"BAD {name} rel {rel:.3e}: " + ", ".join(describe(x) for x in a))
    print(f"{len(calls)} calls, {bad} differ")


if __name__ == "__main__":
    main()
