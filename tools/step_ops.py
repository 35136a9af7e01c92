"""Which torch operations one decode step issues, and from which source line: the step's glue (each
is a GPU kernel launch on CUDA, inside a CUDA graph too), next to the op-contract kernels.

    TRITON_INTERPRET=1 FLASHRT_BACKEND=cuda python tools/step_ops.py --model tiny --batch 8
    python tools/step_ops.py --model small --device cuda     # on a GPU

Runs the static-buffer decode step (engine/step_capture.py, eager) under a TorchDispatchMode that
counts every aten operation but views and allocations (not those inside Triton's interpreter) by
the innermost frame of the flashrt package. Costs no device time
under the interpreter (``tiny``: every layer role of V4.1); counts scale with the layers.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashrt
from flashrt.graphs.config import shipped_config
from flashrt.engine.step_capture import StepCapture
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model

PKG = os.path.dirname(os.path.dirname(os.path.abspath(flashrt.graphs.__file__)))  # the checkout
# no kernel of their own: views, metadata, allocation, host reads
FREE = re.compile(r"^(empty|empty_strided|empty_like|view|_unsafe_view|as_strided|_reshape_alias|unsqueeze|squeeze|"
                  r"expand|permute|t|transpose|select|slice|alias|detach|lift_fresh|unbind|split|split_with_sizes|"
                  r"chunk|narrow|view_as|diagonal|set_|record_stream|_local_scalar_dense|is_nonzero|item|"
                  r"unfold|_to_copy_meta|new_empty|new_empty_strided|view_as_real|view_as_complex)$")


def site() -> str | None:
    """``file:line (function)`` of the innermost frame in the flashrt checkout (not tools/);
    None inside Triton's interpreter."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if "/triton/" in path:
            return None
        if path.startswith(PKG) and "/tools/" not in path:
            return f"{os.path.relpath(path, PKG)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return None


class _Count(TorchDispatchMode):
    """Counts aten calls by source site (each call below this mode is one op; views excluded)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not FREE.match(name):
            where = site()
            if where is not None:
                self.counts[(where, name)] += 1
        return func(*args, **(kwargs or {}))


def cuda_then_reference_on_cpu() -> None:
    """Under the interpreter, ``FLASHRT_BACKEND=cuda`` on CPU tensors: the calls the CUDA backend
    declines go to the reference backend, as the automatic choice does on a GPU."""
    from flashrt import dispatch

    real = dispatch._resolve

    def resolve(choice, op, device_type):
        if choice == "cuda" and device_type == "cpu":
            found = dispatch.backends()
            return dispatch._runner(op, [b for b in (found["cuda"], found["reference"]) if op in b.ops], device_type)
        return real(choice, op, device_type)

    dispatch._resolve = resolve


def step_ops(model: Model, batch: int, prompt: int) -> tuple[list, int]:
    """(rows of (site, op, count), total) for one static decode step after a ``prompt``-token prefill."""
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=model.device)
    with flashrt.value_checks(False):
        state = model.new_state(batch, prompt + 16)
        tok = model.forward(ids, state=state).argmax(-1)
        graphs = StepCapture(model, state, capture=False)
        tok = graphs.step(tok).argmax(-1)  # warm: every launcher's plan is made
        with _Count() as mode:
            graphs.step(tok)
    counts = mode.counts
    rows = sorted(((w, op, n) for (w, op), n in counts.items()), key=lambda r: -r[2])
    return rows, sum(counts.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        cuda_then_reference_on_cpu()
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device=args.device))
    rows, total = step_ops(model, args.batch, args.prompt)
    by_file = collections.Counter()
    for w, _, n in rows:
        by_file[w.split(":")[0]] += n
    print(f"{total} torch ops per decode step ({args.model}, batch {args.batch}) outside the op kernels; by file:")
    for f, n in by_file.most_common():
        print(f"  {n:5d}  {f}")
    for w, op, n in rows[:args.top]:
        print(f"{n:5d}  {op:28} {w}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "batch": args.batch, "total": total,
                       "rows": [{"site": w, "op": op, "count": n} for w, op, n in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
