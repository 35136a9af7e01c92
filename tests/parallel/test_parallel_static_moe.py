"""The fixed-shape MoE dispatch (graphs/ep_dispatch.py: routed_static), on CPU processes over gloo.

It must give the dynamic dispatches' sums (fresh random weights and tokens, worlds of 2 and 4,
every dispatch), and be capturable: traced at the aten level, its ops and their shapes do not
depend on the routing, and none of them reads a value back to the host (``.item()`` /
``.tolist()`` are ``_local_scalar_dense``) or sizes its output by the data (``nonzero``, ``unique``,
``bincount``...). The ``moe_route`` / ``moe_experts`` ops are left out of the trace: those are the
backends' kernels, the same ones a captured one-device step runs (their reference versions loop
over the experts used)."""
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashrt import checks, ops
from flashrt.engine.launch import launch
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.graphs.parallel import Layout, Parallel
from flashrt.graphs.shard import shard_weights

DATA_DEPENDENT = ("nonzero", "_local_scalar_dense", "unique", "bincount", "masked_select", "repeat_interleave",
                  "argwhere", "item")


class _Trace(TorchDispatchMode):
    """Every aten op run outside the paused kernels: (name, output shapes)."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            flat = out if isinstance(out, (tuple, list)) else (out,)
            self.ops.append((str(func), tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))))
        return out


def _traced(moe, x, monkey):
    """fp32 output of the static dispatch and its trace."""
    trace = _Trace()
    for name in ("moe_route", "moe_experts"):
        real = getattr(ops, name)

        def paused(*a, _real=real, **k):
            trace.paused += 1
            try:
                return _real(*a, **k)
            finally:
                trace.paused -= 1
        monkey[name] = real
        setattr(ops, name, paused)
    try:
        with trace, moe.par.static_shapes():
            out = moe._forward_parallel(x)
    finally:
        for name, real in monkey.items():
            setattr(ops, name, real)
    return out, trace.ops


def _rank(rank, device, cfg, cases, seed, report):
    torch.set_num_threads(1)
    full = init_weights(cfg, seed=seed)
    single = Model(cfg, dict(full))
    out = {}
    for name, tp, ep, dispatch, counts in cases:
        layout = Layout(tp, ep, rank)
        par = Parallel(layout, dispatch)
        model = Model(cfg, shard_weights(dict(full), cfg, layout), parallel=par)
        g = layout.ep_rank if dispatch != "replicated" else 0
        errors, traces = [], []
        # fresh draws; the trace must not depend on the routing. The first call may allocate the load
        # count's buffer (once per process, as a captured step's warm-up run does): traces 2 and 3 compare
        for trial in range(3):
            gen = torch.Generator().manual_seed(seed + 1000 * trial + 17 * g)
            x = torch.randn(counts[g], cfg.dim, generator=gen).to(single.embed.dtype)
            par.counts = None if dispatch == "replicated" else list(counts)
            for layer in range(cfg.n_layers):
                moe = model.blocks[layer].ffn
                with checks.value_checks(False):
                    dynamic = moe._forward_parallel(x)
                    static, ops_seen = _traced(moe, x, {})
                par.take_load()
                one = single.blocks[layer].ffn.forward(x.unsqueeze(0)).squeeze(0).to(torch.float32)
                errors.append(((static - dynamic).abs().max().item() if x.shape[0] else 0.0,
                               (static.to(x.dtype).float() - one).abs().max().item() if x.shape[0] else 0.0,
                               one.abs().max().item() if x.shape[0] else 0.0))
                if layer == 0 and trial:
                    traces.append(ops_seen)
        out[name] = (errors, traces)
    return out


def _check(results, names):
    for rank, by_case in enumerate(results):
        for name in names:
            errors, (first, second) = by_case[name]
            for static_vs_dynamic, static_vs_one, scale in errors:
                assert static_vs_dynamic <= 1e-5 * max(scale, 1.0), f"{name} rank {rank}: {static_vs_dynamic}"
                assert static_vs_one <= 2e-2 * max(scale, 1.0), f"{name} rank {rank}: vs one process {static_vs_one}"
            assert first == second, f"{name} rank {rank}: the ops or their shapes depend on the routing"
            bad = [op for op, _ in first if any(word in op for word in DATA_DEPENDENT)]
            assert not bad, f"{name} rank {rank}: data-dependent ops on the static path: {bad}"
            assert any(op.startswith("c10d.") for op, _ in first), f"{name}: the trace saw no collective"


def test_static_dispatch_two_ranks(rng):
    cfg = shipped_config("tiny")
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    cases = [("tp2", 2, 1, "gather", [5]), ("ep2", 1, 2, "gather", [4, 1]),
             ("ep2-a2a", 1, 2, "all_to_all", [2, 6]), ("ep2-idle", 1, 2, "gather", [3, 0]),
             ("ep2-replicated", 1, 2, "replicated", [4, 4])]
    results = launch(_rank, 2, (cfg, cases, seed), timeout_s=180)
    _check(results, [c[0] for c in cases])


def test_static_dispatch_four_ranks(rng):
    cfg = dataclasses.replace(shipped_config("tiny"), n_routed_experts=16, n_activated_experts=4, name="tiny-16e")
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    cases = [("tp2ep2", 2, 2, "gather", [3, 2]), ("ep4-a2a", 1, 4, "all_to_all", [1, 0, 4, 2])]
    results = launch(_rank, 4, (cfg, cases, seed), timeout_s=240)
    _check(results, [c[0] for c in cases])


def _vl_rank(rank, device, cfg, cases, seed, report):
    """Image-span tokens route with bias_vl on every dispatch that sees them: max error against one process."""
    torch.set_num_threads(1)
    full = init_weights(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for name in [k for k in full if k.endswith("gate.bias_vl")]:  # a bias that picks other experts
        full[name] = torch.randn(full[name].shape, generator=gen).to(full[name].dtype)
    single = Model(cfg, dict(full))
    x = torch.randn(6, cfg.dim, generator=gen).to(single.embed.dtype)
    vl = torch.rand(6, generator=gen) < 0.5
    out = {}
    for name, tp, ep, dispatch in cases:
        layout = Layout(tp, ep, rank)
        par = Parallel(layout, dispatch)
        model = Model(cfg, shard_weights(dict(full), cfg, layout), parallel=par)
        errors = []
        for layer in range(cfg.n_layers):
            moe, ref = model.blocks[layer].ffn, single.blocks[layer].ffn
            one = ref.forward(x.unsqueeze(0), vl_mask=vl.unsqueeze(0)).squeeze(0).float()
            plain = ref.forward(x.unsqueeze(0)).squeeze(0).float()
            for static in (False, True):
                with checks.value_checks(False), par.static_shapes(static):
                    got = moe.forward(x.unsqueeze(0), vl_mask=vl.unsqueeze(0)).squeeze(0).float()
                errors.append(((got - one).abs().max().item(), (plain - one).abs().max().item()))
        out[name] = errors
    return out


def test_image_span_tokens_use_the_vision_bias(rng):
    cfg = shipped_config("tiny-vl")
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    results = launch(_vl_rank, 2, (cfg, [("tp2", 2, 1, "gather"), ("ep2", 1, 2, "replicated")], seed), timeout_s=120)
    for rank, by_case in enumerate(results):
        for name, errors in by_case.items():
            assert max(e for e, _ in errors) <= 2e-2, f"{name} rank {rank}: {errors}"
            assert max(d for _, d in errors) > 0.05  # the vision bias changes some token's experts
