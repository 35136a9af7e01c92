"""``flashrt plan``: what a model costs, from its config and a trace on meta tensors.

Nothing is allocated: the model is built from meta weights and a decode step is run through the
trace backend at the requested context, so FLOPs and bytes come from the same graph every
backend runs. Parameter and KV figures come from the parameter list and the formats.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashrt import tracing
from flashrt.dtypes import MAIN_KV_FORMAT, TORCH
from flashrt.formats import QTensor, expected_layout, spec

from .config import ModelConfig
from .params import QUANTIZED, ParamSpec, count_params, param_specs

KIND_DTYPE = {kind: TORCH[kind] for kind in ("bf16", "fp32")}  # plain parameter kinds


def stored_bytes(s: ParamSpec) -> int:
    """Bytes a parameter takes as stored (data + scales)."""
    if s.kind in KIND_DTYPE:
        return s.numel * KIND_DTYPE[s.kind].itemsize
    fmt = QUANTIZED[s.kind]
    data, scale = expected_layout(fmt, s.shape)
    return data.numel() * spec(fmt).data_dtype.itemsize + scale.numel() * spec(fmt).scale_dtype.itemsize


def meta_weights(cfg: ModelConfig) -> dict:
    """Every parameter as a meta tensor / QTensor of the stored layout (no memory)."""
    out = {}
    for s in param_specs(cfg):
        if s.kind in KIND_DTYPE:
            out[s.name] = torch.empty(s.shape, dtype=KIND_DTYPE[s.kind], device="meta")
        else:
            fmt = QUANTIZED[s.kind]
            data, scale = expected_layout(fmt, s.shape)
            f = spec(fmt)
            out[s.name] = QTensor(torch.empty(data, dtype=f.data_dtype, device="meta"),
                                  torch.empty(scale, dtype=f.scale_dtype, device="meta"), fmt, s.shape)
    return out


def kv_bytes_per_token(cfg: ModelConfig) -> float:
    """Global KV per token: main KV (MAIN_KV_FORMAT) + index K (fp4_b32) of every source, per ratio."""
    def entry(fmt, dim):
        data, scale = expected_layout(fmt, (dim,))
        return data.numel() + scale.numel()

    per = entry(MAIN_KV_FORMAT, cfg.head_dim) + entry("fp4_b32", cfg.index_head_dim)
    return sum(per / cfg.ratio(l) for l in cfg.kv_source_layers)


def window_state_bytes(cfg: ModelConfig) -> dict:
    """Fixed bytes per sequence: window rings (fp8), compressor partial groups (fp32), Engram history."""
    data, scale = expected_layout("fp8", (cfg.head_dim,))
    ring = cfg.window_size * (data.numel() + scale.numel())
    partial = sum(2 * cfg.ratio(l) * cfg.head_dim * 4 for l in cfg.kv_source_layers if cfg.ratio(l) > 1)
    return {"rings_backbone": cfg.n_layers * ring, "rings_draft": (cfg.total_layers - cfg.n_layers) * ring,
            "compressor_state": partial, "engram_history": max(cfg.engram_max_ngram_size - 1, 0) * 8}


def active_params(cfg: ModelConfig, prompt: int | None = None) -> float:
    """Backbone parameters touched per token: routed experts count ``n_activated`` of ``n_routed``;
    Engram tables count the rows a token reads. With ``prompt`` (CED prefill of that many tokens)
    the decoder layers count only ``window_size / prompt`` of the time."""
    from .prefill import ced_split

    split = ced_split(cfg) if prompt else cfg.n_layers
    frac = 1.0 if not prompt else min(1.0, cfg.window_size / prompt)
    total = 0.0
    for s in param_specs(cfg):
        if s.group == "draft":
            continue
        n = float(s.numel)
        if ".ffn.experts." in s.name:
            layer = int(s.name.split(".")[1])
            routed, active = cfg.n_experts(layer)
            n *= active / routed
        if s.group == "engram":
            n = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        if s.name.startswith("layers.") and int(s.name.split(".")[1]) >= split:
            keep = int(s.name.split(".")[1]) == split and ".compressor." in s.name
            n *= 1.0 if keep else frac
        total += n
    return total


def meta_model(cfg: ModelConfig):
    from .model import Model

    return Model(cfg, meta_weights(cfg))


def decode_trace(model, context: int, batch: int = 1):
    """The recorded graph of one decode step of ``batch`` sequences at ``context`` tokens
    (``model`` built by :func:`meta_model`)."""
    state = model.new_state(batch, context + 1)
    state.host_positions = [context] * batch
    ids = torch.empty(batch, 1, dtype=torch.long, device="meta")
    with tracing.record() as graph:  # meta tensors: dispatch runs them on the trace backend
        model.forward(ids, state=state)
    return graph


@dataclass
class Plan:
    config: ModelConfig
    params: dict
    weight_bytes: dict
    kv_bytes_per_token: float
    window_state: dict
    active_decode: float
    active_prefill_ced: float
    decode_flops: dict  # context -> FLOPs per decode token
    decode_bytes: dict
    decode_largest: dict = field(default_factory=dict)  # context -> bytes of a decode step's largest op output


def make_plan(cfg: ModelConfig, contexts=(4096, 1 << 20), prompt: int = 1 << 20) -> Plan:
    wb = {"backbone": 0, "engram": 0, "draft": 0}
    for s in param_specs(cfg):
        wb[s.group] += stored_bytes(s)
    flops, moved, largest = {}, {}, {}
    model = meta_model(cfg)
    for n in contexts:
        graph = decode_trace(model, n)
        total = graph.total()
        flops[n], moved[n] = total.flops, total.bytes_read + total.bytes_written
        largest[n] = max(sum(o.nbytes for o in c.outputs) for c in graph.calls)
    return Plan(cfg, count_params(cfg), wb, kv_bytes_per_token(cfg), window_state_bytes(cfg),
                active_params(cfg), active_params(cfg, prompt), flops, moved, largest)


def sequences_that_fit(plan: Plan, context: int, memory_bytes: float, engram_on_device: bool) -> int:
    """How many sequences of ``context`` tokens fit ``memory_bytes`` next to the weights."""
    weights = plan.weight_bytes["backbone"] + plan.weight_bytes["draft"]
    weights += plan.weight_bytes["engram"] if engram_on_device else 0
    per_seq = context * plan.kv_bytes_per_token + sum(plan.window_state.values())
    return max(0, int((memory_bytes - weights) // per_seq))
