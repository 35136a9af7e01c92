"""The text and JSON that ``flashrt plan`` prints."""
from __future__ import annotations

import os

from .config import SHIPPED, ModelConfig, shipped_config
from .dense import DENSE
from .params import count_params
from .parallel import Layout
from .plan import make_plan, sequences_that_fit
from .plan_parallel import parallel_report


def _g(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n / 1e6:,.2f} M"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def resolve(model: str):
    if model in DENSE:
        return DENSE[model]
    if model in SHIPPED:
        return shipped_config(model)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.exists(path):
        raise ValueError(f"model: expected one of {list(SHIPPED) + list(DENSE)} or a config path, got {model!r}")
    return ModelConfig.from_file(path)


def plan_report(model: str, context: int, memory_bytes: float, tp: int = 1, ep: int = 1,
                engram_placement: str = "device") -> dict:
    """``tp`` / ``ep`` > 1 add what each rank of that layout holds (graphs/plan_parallel.py);
    ``engram_placement`` (the profile's) says whether its Engram rows count against device memory."""
    cfg = resolve(model)
    if context < 1:
        raise ValueError(f"context: expected a positive int, got {context}")
    layout = Layout(tp, ep)
    if not isinstance(cfg, ModelConfig):
        if layout.world > 1:
            raise ValueError(f"tp: --tp / --ep plan V4.1-class models only, not the dense {cfg.name!r}")
        return _dense_report(cfg, context, memory_bytes)
    layout.check(cfg)
    contexts = tuple(sorted({4096, 1 << 20} | ({context} if layout.world > 1 else set())))
    plan = make_plan(cfg.replace(dspark_block_size=0) if cfg.dspark_block_size else cfg, contexts, prompt=context)
    plan.params = count_params(cfg)  # with the draft layers the decode trace leaves out
    kv = plan.kv_bytes_per_token
    fixed = sum(plan.window_state.values())
    fit_dev = sequences_that_fit(plan, context, memory_bytes, engram_on_device=True)
    fit_host = sequences_that_fit(plan, context, memory_bytes, engram_on_device=False)
    lines = [
        f"model {cfg.name}: {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_routed_experts} experts (top-{cfg.n_activated_experts})",
        f"parameters: backbone {_g(plan.params['backbone'])}, engram {_g(plan.params['engram'])}, draft {_g(plan.params['draft'])}",
        f"weights as stored: backbone {_gib(plan.weight_bytes['backbone'])}, engram {_gib(plan.weight_bytes['engram'])}",
        f"KV bytes per token: {kv:,.0f}",
        f"fixed state per sequence: {fixed:,} B (window rings {plan.window_state['rings_backbone']:,} B backbone"
        f" + {plan.window_state['rings_draft']:,} B draft, compressor {plan.window_state['compressor_state']:,} B)",
        f"active parameters per token: decode {_g(plan.active_decode)}, CED prefill of {context:,} tokens "
        f"{_g(plan.active_prefill_ced)}",
    ]
    lines += [f"decode FLOPs per token at {n:,} context: {f / 1e9:,.2f} GFLOP" for n, f in plan.decode_flops.items()]
    lines.append(f"sequences of {context:,} tokens in {_gib(memory_bytes)}: {fit_dev} (Engram on device), "
                 f"{fit_host} (Engram in host memory)")
    parallel = None
    if layout.world > 1:
        parallel = parallel_report(plan, cfg, layout, context, memory_bytes, engram_placement)
        lines += parallel.pop("lines")
    return {"model": cfg.name, "params": plan.params, "parallel": parallel, "weight_bytes": plan.weight_bytes, "kv_bytes_per_token": kv,
            "window_state": plan.window_state, "active_params_decode": plan.active_decode,
            "active_params_prefill_ced": plan.active_prefill_ced,
            "decode_flops": {str(k): v for k, v in plan.decode_flops.items()},
            "sequences_fit": {"engram_device": fit_dev, "engram_host": fit_host}, "lines": lines}


def _dense_report(cfg, context: int, memory_bytes: float) -> dict:
    kv = cfg.kv_bytes_per_token()
    weights = cfg.params() * 2
    fit = max(0, int((memory_bytes - weights) // (kv * context)))
    lines = [
        f"model {cfg.name} (dense GQA): {cfg.n_layers} layers, {cfg.n_kv_heads} KV heads x {cfg.head_dim}, bf16 KV",
        f"parameters: {_g(cfg.params())} (bf16 weights {_gib(weights)})",
        f"KV bytes per token: {kv:,}",
        f"active parameters per token: {_g(cfg.params())}",
    ]
    lines += [f"decode FLOPs per token at {n:,} context: {cfg.decode_flops(n) / 1e9:,.2f} GFLOP" for n in (4096, 1 << 20)]
    lines.append(f"sequences of {context:,} tokens in {_gib(memory_bytes)}: {fit}")
    return {"model": cfg.name, "params": {"backbone": cfg.params()}, "kv_bytes_per_token": kv,
            "sequences_fit": {"device": fit}, "lines": lines}
