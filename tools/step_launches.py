"""GPU kernel launches one decode step makes, per layer and per op, counted on CPU.

    TRITON_INTERPRET=1 FLASHRT_BACKEND=cuda python tools/step_launches.py --model small --batch 1 --vocab 512

Runs the static-buffer decode step (engine/step_capture.py, eager) as ``step_ops.py`` does (with
``--verify K``, a speculative verify step of K + 1 tokens a row: engine/verify_capture.py, eager), and
counts what each would be on a CUDA device: every Triton kernel launch (counted at the
interpreter's launch entry, one per grid) and every aten operation outside the Triton interpreter
but views and allocations (``step_ops.FREE``). Each launch is attributed to the decoder layer
running it (``Block.forward``; ``-`` for the embedding, head and step set-up) and to the contract
op it runs in (the outermost ``flashrt.ops`` call; ``glue`` outside any op, by source line).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_ops  # noqa: E402  (the sibling tool: step driver, free-op list, source sites)

import flashrt  # noqa: E402
from flashrt import ops as _ops  # noqa: E402
from flashrt.graphs import block as _block  # noqa: E402


class Launches:
    """Counters keyed by (layer, op or ``glue``, kind, name); ``kind`` is ``triton`` or ``torch``."""

    def __init__(self):
        self.counts = collections.Counter()
        self.layer = "-"
        self.stack: list[str] = []

    def add(self, kind: str, name: str, site: str | None = None):
        op = self.stack[0] if self.stack else "glue"
        label = name if op != "glue" or site is None else f"{name} @ {site}"
        self.counts[(self.layer, op, kind, label)] += 1


class _Torch(TorchDispatchMode):
    def __init__(self, rec: Launches):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not step_ops.FREE.match(name):
            where = step_ops.site()
            if where is not None:
                self.rec.add("torch", name, where)
        return func(*args, **(kwargs or {}))


def install(rec: Launches) -> None:
    """Route the counters through the op table, the Triton interpreter and ``Block.forward``."""
    from triton.runtime.interpreter import InterpretedFunction

    real_impl, real_run, real_forward = _ops._impl, InterpretedFunction.run, _block.Block.forward

    def impl(op, device):
        fn = real_impl(op, device)

        def counted(*a, **k):
            rec.stack.append(op)
            try:
                return fn(*a, **k)
            finally:
                rec.stack.pop()
        return counted

    def run(self, *a, **k):
        if not k.get("warmup"):
            rec.add("triton", self.fn.__name__)
        return real_run(self, *a, **k)

    def forward(self, *a, **k):
        before, rec.layer = rec.layer, self.layer
        try:
            return real_forward(self, *a, **k)
        finally:
            rec.layer = before

    for module in (_ops, *_ops.MODULES):  # every op group resolves through its module's own _impl
        module._impl = impl
    InterpretedFunction.run, _block.Block.forward = run, forward


def as_device(sms: int) -> None:
    """Plan launches as on a GPU with ``sms`` SMs: the interpreter reports one, which would never
    split K (the GEMM launchers split when the output tiles do not fill the SMs)."""
    from flashrt.kernels_cuda import linear, linear_plain

    linear.num_sms = lambda: sms
    plan = linear_plain._plan
    linear_plain._plan = lambda *a, **k: plan(*a, **{**k, "sms": sms})


def measure(model, batch: int, prompt: int) -> Launches:
    """The launches of one static decode step after a ``prompt``-token prefill and one warm step."""
    from flashrt.engine.step_capture import StepCapture

    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=model.device)
    rec = Launches()
    with flashrt.value_checks(False):
        state = model.new_state(batch, prompt + 16)
        tok = model.forward(ids, state=state).argmax(-1)
        graphs = StepCapture(model, state, capture=False)
        tok = graphs.step(tok).argmax(-1)
        install(rec)
        with _Torch(rec):
            graphs.step(tok)
    return rec


def measure_verify(model, batch: int, prompt: int, k: int) -> Launches:
    """The launches of one static verify step of ``k + 1`` tokens a row (engine/verify_capture.py,
    eager: what a speculative round replays) after a ``prompt``-token prefill and one verify kept
    whole, and of its commit keeping a random count of each row's tokens (layer ``commit``)."""
    from flashrt.engine.verify_capture import VerifyCapture

    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=model.device)
    rec = Launches()
    with flashrt.value_checks(False):
        state = model.new_state(batch, prompt + 4 * (k + 1))
        model.forward(ids, state=state)
        verifier = VerifyCapture(model, state, capture=False)
        chunk = torch.randint(0, cfg.vocab_size, (batch, k + 1), device=model.device)
        verifier.verify(chunk)
        verifier.keep(chunk, torch.full((batch,), k + 1, dtype=torch.long), [k + 1] * batch)
        install(rec)
        with _Torch(rec):
            verifier.verify(chunk)
            rec.layer = "commit"
            counts = torch.randint(1, k + 2, (batch,))
            verifier.keep(chunk, counts, counts.tolist())
    return rec


def summary(rec: Launches, roles: dict) -> dict:
    """Totals per layer, per layer role (mean over its layers) and per (op, kind, name)."""
    per_layer, per_op = collections.Counter(), collections.Counter()
    for (layer, op, kind, name), n in rec.counts.items():
        per_layer[layer] += n
        per_op[(op, kind, name)] += n
    layers = [l for l in per_layer if l not in ("-", "commit")]
    by_role = collections.defaultdict(list)
    for l in layers:
        by_role[roles[l]].append(per_layer[l])
    return {"total": sum(per_layer.values()), "outside_layers": per_layer.get("-", 0),
            "commit": per_layer.get("commit", 0),
            "per_layer": {str(l): per_layer[l] for l in sorted(layers)},
            "mean_per_layer": sum(per_layer[l] for l in layers) / max(1, len(layers)),
            "per_role": {r: sum(v) / len(v) for r, v in by_role.items()},
            "rows": [{"op": op, "kind": kind, "name": name, "count": n}
                     for (op, kind, name), n in per_op.most_common()]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--top", type=int, default=80)
    ap.add_argument("--sms", type=int, default=132, help="SMs the launchers plan for (H200: 132)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="a smaller vocabulary (the head's launches sit outside the layers; the interpreter runs it slowly)")
    ap.add_argument("--verify", type=int, default=None, metavar="K",
                    help="count a speculative verify step of K + 1 tokens a row instead of a decode step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.verify is not None and args.verify < 0:
        ap.error(f"--verify: expected K >= 0 drafted tokens, got {args.verify}")
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("step_launches.py counts interpreted launches: run it with TRITON_INTERPRET=1 FLASHRT_BACKEND=cuda")
    step_ops.cuda_then_reference_on_cpu()
    as_device(args.sms)
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    cfg = shipped_config(args.model)
    if args.vocab:
        cfg = cfg.replace(vocab_size=args.vocab)
    model = Model(cfg, init_weights(cfg, seed=0, device="cpu"))
    if args.verify is None:
        rec = measure(model, args.batch, args.prompt)
    else:
        rec = measure_verify(model, args.batch, args.prompt, args.verify)
    out = summary(rec, {l: cfg.role(l) for l in range(cfg.n_layers)})
    out.update(model=args.model, batch=args.batch, verify=args.verify)
    step = "a decode step" if args.verify is None else f"a verify step of {args.verify + 1} tokens a row"
    print(f"{out['total']} launches {step} ({args.model}, batch {args.batch}); "
          f"{out['mean_per_layer']:.1f} a layer on average, {out['outside_layers']} outside the layers"
          + ("" if args.verify is None else f", {out['commit']} in the commit keeping part of each row"))
    print("per layer:", out["per_layer"])
    print("per role (mean):", {r: round(v, 1) for r, v in out["per_role"].items()})
    for r in out["rows"][:args.top]:
        print(f"{r['count']:5d}  {r['op']:18} {r['kind']:6} {r['name']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
