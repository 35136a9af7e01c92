"""What ``decode_tiles.py`` sweeps: a model's decode-step calls of the GEMM-like ops at given batches
(op, args, launches per step) and the candidate tiles of each profile entry they use.

Shapes follow the model config: the fp8_w projections (wq_a, wq_b, wkv, wo_b every layer; the
indexer's wq_b on the layers with an indexer; the Engram wkv on the Engram layers), the routed
experts (fp4_w / fp8_w per ``expert_dtype``) and the shared expert (one expert, one slot),
``hc_coefficients`` (twice a layer), and the plain bf16-weight linears (:func:`plain_shapes`).
Candidates are values merged into the profile's entry: the tile rule the case's rows select
(``linear``, ``moe`` experts, ``linear_plain``) or the mapping (``mhc``). The
rule knobs ``min_block_n`` and ``split_min_blocks`` only act where a launch does not fill the SMs,
so a winner at decode leaves the prefill launches of the same rule as they are; ``split_per_sm``
also splits launches that fill the SMs once (every launch of its rule).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashrt import formats


@dataclass
class Case:
    name: str  # e.g. "linear 512x1024 b1"
    group: tuple  # (module, key, rule index or None): the profile entry the candidates change
    op: str
    args: tuple
    batch: int
    per_step: int  # launches of this call in one decode step
    meta: dict = field(default_factory=dict)
    want: object = None  # the reference result
    base_err: float = 0.0  # the baseline's error against it


def _w(shape, fmt, dev, scale):
    return formats.quantize(torch.randn(*shape, device=dev) * scale, fmt)


def linear_shapes(cfg) -> dict:
    """(out, in) of each quantized projection a decode step runs -> launches per step."""
    layers = range(cfg.n_layers)
    shapes: dict = {}

    def add(shape, count):
        if count:
            shapes[shape] = shapes.get(shape, 0) + count

    hd = cfg.head_dim
    add((cfg.q_lora_rank, cfg.dim), cfg.n_layers)
    add((cfg.n_heads * hd, cfg.q_lora_rank), cfg.n_layers)
    add((hd, cfg.dim), cfg.n_layers)
    add((cfg.dim, cfg.o_groups * cfg.o_lora_rank), cfg.n_layers)
    add((cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
        sum(cfg.role(i) in ("full", "reindex") for i in layers))
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    add((cfg.dim * (cfg.hc_mult + 1), cols * cfg.engram_head_dim), len(cfg.engram_layer_ids or ()))
    return shapes


def plain_shapes(cfg) -> dict:
    """(out, in, x dtype, groups) of each plain bf16-weight linear a decode step runs -> launches per
    step: the grouped ``wo_a`` every layer, the MoE gate every layer (timed with a bf16 output; the
    model keeps its fp32 sums: the same launch but the stored dtype), the head (fp32 x), and on the
    layers with a compressor (``full``) its ``wkv`` (ratio 1, bf16 x) or ``wkv`` + ``wgate`` fused
    (fp32 x) and the indexer's ``wk``; the indexer's ``weights_proj`` where the layer indexes."""
    layers = range(cfg.n_layers)
    bf16, fp32 = torch.bfloat16, torch.float32
    full = [i for i in layers if cfg.role(i) == "full"]
    shapes: dict = {}

    def add(key, count):
        if count:
            shapes[key] = shapes.get(key, 0) + count

    g, hd = cfg.o_groups, cfg.head_dim
    add((g * cfg.o_lora_rank, cfg.n_heads * hd // g, bf16, g), cfg.n_layers)
    add((cfg.n_routed_experts, cfg.dim, bf16, 1), cfg.n_layers)
    add((cfg.vocab_size, cfg.dim, fp32, 1), 1)
    add((2 * hd, cfg.dim, fp32, 1), sum(cfg.ratio(i) > 1 for i in full))
    add((hd, cfg.dim, bf16, 1), sum(cfg.ratio(i) == 1 for i in full))
    add((cfg.index_head_dim, hd, bf16, 1), len(full))
    add((cfg.index_n_heads, cfg.dim, bf16, 1), sum(cfg.role(i) in ("full", "reindex") for i in layers))
    return shapes


def _plain_cases(cfg, b, dev, rules) -> list:
    out = []
    for (n, k, xdt, groups), count in plain_shapes(cfg).items():
        w = (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)
        x = torch.randn(b, groups, k, device=dev).to(xdt) if groups > 1 else torch.randn(b, k, device=dev).to(xdt)
        name = f"plain {n}x{k}" + (f" g{groups}" if groups > 1 else "") + f" {str(xdt)[6:]} b{b}"
        out.append(Case(name, ("linear_plain", "plain", rule_index(rules, b)),
                        "grouped_linear" if groups > 1 else "linear", (x, w), b, count, dict(n=n, k=k)))
    return out


def rule_index(rules, rows: float) -> int:
    return next(i for i, (limit, _) in enumerate(rules) if limit is None or rows <= limit)


def cases(cfg, batches, dev, tiles_of) -> list[Case]:
    """Every decode call of the swept ops at ``batches``; ``tiles_of(module)`` gives the active
    profile's tiles of a kernel module (to find the rule a case's rows select)."""
    fmt = "fp8_w" if cfg.dtype == "fp8" else "fp4_w"
    efmt = "fp4_w" if cfg.expert_dtype == "fp4" else fmt
    out = []
    lin_rules, moe_rules = tiles_of("linear")["linear"], tiles_of("moe")["experts"]
    plain_rules = tiles_of("linear_plain")["plain"]
    for b in batches:
        out += _plain_cases(cfg, b, dev, plain_rules)
        for (n, k), count in linear_shapes(cfg).items():
            x = torch.randn(b, k, device=dev).to(torch.bfloat16)
            out.append(Case(f"linear {n}x{k} b{b}", ("linear", "linear", rule_index(lin_rules, b)), "linear",
                            (x, _w((n, k), fmt, dev, k ** -0.5)), b, count, dict(n=n, k=k)))
        D, I, E, k = cfg.dim, cfg.moe_inter_dim, cfg.n_routed_experts, cfg.n_activated_experts
        x = torch.randn(b, D, device=dev).to(torch.bfloat16)
        idx = torch.rand(b, E, device=dev).argsort(dim=1)[:, :k].to(torch.int32)
        w = [_w((E, *s), efmt, dev, s[1] ** -0.5) for s in ((I, D), (I, D), (D, I))]
        out.append(Case(f"moe routed b{b}", ("moe", "experts", rule_index(moe_rules, b * k / E)), "moe_experts",
                        (x, torch.rand(b, k, device=dev), idx, *w, cfg.swiglu_limit), b, cfg.n_layers,
                        dict(experts=E, k=k, D=D, I=I)))
        if cfg.n_shared_experts:
            Is = cfg.n_shared_experts * I
            ws = [_w((1, *s), fmt, dev, s[1] ** -0.5) for s in ((Is, D), (Is, D), (D, Is))]
            one, first = torch.ones(b, 1, device=dev), torch.zeros(b, 1, dtype=torch.int32, device=dev)
            out.append(Case(f"moe shared b{b}", ("moe", "experts", rule_index(moe_rules, b)), "moe_experts",
                            (x, one, first, *ws, cfg.swiglu_limit), b, cfg.n_layers, dict(experts=1, k=1, D=D, I=Is)))
        hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        xh = torch.randn(b, 1, hc, D, device=dev).to(torch.bfloat16)
        fn = torch.randn(mix, hc * D, device=dev) * (hc * D) ** -0.5
        out.append(Case(f"hc_coefficients b{b}", ("mhc", "hc_coefficients", None), "hc_coefficients",
                        (xh, fn, torch.ones(3, device=dev), torch.zeros(mix, device=dev), cfg.hc_sinkhorn_iters,
                         cfg.hc_eps, cfg.norm_eps), b, 2 * cfg.n_layers))
    return out


# candidate values merged into the entry, most promising first (the budget may cut the tail);
# the profile's own values always run first as the baseline
_GEMM_KNOBS = [
    dict(min_block_n=32, split_min_blocks=1), dict(min_block_n=32, split_min_blocks=2),
    dict(min_block_n=64, split_min_blocks=2), dict(min_block_n=32), dict(split_min_blocks=2),
    dict(min_block_n=64, split_min_blocks=1), dict(min_block_n=32, split_min_blocks=4),
]
CANDIDATES = {
    ("linear", "linear"): _GEMM_KNOBS + [
        dict(split_min_blocks=1), dict(BLOCK_N=64, min_block_n=32, split_min_blocks=1),
        dict(BLOCK_K=256, min_block_n=32, split_min_blocks=1), dict(num_stages=4, min_block_n=32, split_min_blocks=1),
        # past fused_max_rows: the split K summed in the kernel after act_quant (no sum and cast launches)
        dict(split_reduce=True), dict(split_reduce=True, split_min_blocks=1),
    ],
    ("moe", "experts"): _GEMM_KNOBS + [
        dict(BLOCK_K=128, min_block_n=32, split_min_blocks=2), dict(num_warps=8, min_block_n=64, split_min_blocks=2),
        dict(num_stages=4, min_block_n=32, split_min_blocks=2),
        # K split to more programs an SM, also where the output tiles fill the SMs once
        dict(min_block_n=32, split_min_blocks=2, split_per_sm=6), dict(min_block_n=32, split_min_blocks=2, split_per_sm=3),
    ],
    # the gate and weights_proj (32 columns) fill few programs: shorter K blocks split them further
    ("linear_plain", "plain"): _GEMM_KNOBS + [
        dict(split_min_blocks=1), dict(BLOCK_K=64, min_block_n=32, split_min_blocks=1),
        dict(BLOCK_K=32, min_block_n=32, split_min_blocks=1), dict(BLOCK_N=128, min_block_n=32, split_min_blocks=1),
        dict(num_warps=8, min_block_n=32, split_min_blocks=1),
        dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, min_block_n=32, split_min_blocks=1),
    ],
    ("mhc", "hc_coefficients"): [
        dict(BLOCK_K=64), dict(PROGRAMS=132), dict(PROGRAMS=64), dict(BLOCK_K=64, PROGRAMS=132), dict(PROGRAMS=16),
        dict(BLOCK_K=32), dict(BLOCK_K=64, PROGRAMS=528),
    ],
}


KNOB_NAMES = {"min_block_n", "split_min_blocks", "split_reduce"}


def candidates(group: tuple, last_rule: bool = False, limit: int | None = None) -> list[dict]:
    """The baseline ({}: the profile's values) and the group's candidates (the first ``limit``).
    The last rule (it serves prefill too) gets only the knobs: its tiles stay as tuned there."""
    more = [c for c in CANDIDATES[group[:2]] if not last_rule or set(c) <= KNOB_NAMES]
    return [{}] + (more if limit is None else more[:limit])
