"""Every parameter of a V4.1 model: checkpoint name, logical shape, storage kind, group.

Names follow the reference inference code (docs/model.md, 8). Storage kinds:

| kind | tensors in the checkpoint | in memory |
|---|---|---|
| ``bf16`` / ``fp32`` | ``name`` in that dtype | a plain tensor |
| ``fp8_w`` | ``name`` F8_E4M3 ``[out, in]`` + sibling ``.scale`` F8_E8M0 ``[ceil(out/32), ceil(in/32)]`` | ``QTensor`` ``fp8_w`` |
| ``fp4_w`` | ``name`` two E2M1 per byte ``[out, in/2]`` (I8, U8 or F4 x2) + ``.scale`` F8_E8M0 ``[out, in/32]`` | ``QTensor`` ``fp4_w`` |
| ``fp8_table`` | ``name`` F8_E4M3 ``[rows, dim]`` + ``.scale`` F8_E8M0 ``[rows, dim/32]`` | ``QTensor`` ``fp8`` |

Groups: ``backbone``, ``engram`` (the Engram tables) and ``draft`` (DSpark layers, ``mtp.{k}.``).
A model with a vision tower (``vision_n_layers > 0``) adds the ViT, the aligner, the span
delimiters and every gate's ``bias_vl`` to ``backbone``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

QUANTIZED = {"fp8_w": "fp8_w", "fp4_w": "fp4_w", "fp8_table": "fp8"}  # kind -> QTensor format


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # bf16 | fp32 | fp8_w | fp4_w | fp8_table
    group: str  # backbone | engram | draft
    init: str = "linear"  # linear (std 1/sqrt(in)) | ones | zeros | small | normal

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def scale_name(self) -> str | None:
        return self.name[: -len("weight")] + "scale" if self.kind in QUANTIZED else None


def _default_kind(cfg: ModelConfig) -> str:
    return "fp8_w" if cfg.dtype == "fp8" else "bf16"


def _expert_kind(cfg: ModelConfig) -> str:
    return "fp4_w" if cfg.expert_dtype == "fp4" else _default_kind(cfg)


class _Collector:
    def __init__(self, cfg: ModelConfig, group: str):
        self.cfg, self.group, self.out = cfg, group, []

    def add(self, name, shape, kind, init="linear", group=None):
        self.out.append(ParamSpec(name, tuple(shape), kind, group or self.group, init))

    def linear(self, name, out_f, in_f, kind=None):
        self.add(f"{name}.weight", (out_f, in_f), kind or _default_kind(self.cfg))

    def norm(self, name, n):
        self.add(f"{name}.weight", (n,), "bf16", "ones")


def _attention(c: _Collector, p: str, layer: int) -> None:
    cfg = c.cfg
    hd, H = cfg.head_dim, cfg.n_heads
    c.add(f"{p}attn.attn_sink", (H,), "fp32", "zeros")
    c.linear(f"{p}attn.wq_a", cfg.q_lora_rank, cfg.dim)
    c.norm(f"{p}attn.q_norm", cfg.q_lora_rank)
    c.linear(f"{p}attn.wq_b", H * hd, cfg.q_lora_rank)
    c.linear(f"{p}attn.wkv", hd, cfg.dim)
    c.norm(f"{p}attn.kv_norm", hd)
    c.linear(f"{p}attn.wo_a", cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups, "bf16")
    c.linear(f"{p}attn.wo_b", cfg.dim, cfg.o_groups * cfg.o_lora_rank)
    role = cfg.role(layer)
    if role == "full":
        c.linear(f"{p}attn.compressor.wkv", hd, cfg.dim, "bf16")
        if cfg.ratio(layer) > 1:
            c.linear(f"{p}attn.compressor.wgate", hd, cfg.dim, "bf16")
        c.norm(f"{p}attn.compressor.norm", hd)
    if role in ("full", "reindex"):
        c.linear(f"{p}attn.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        c.linear(f"{p}attn.indexer.weights_proj", cfg.index_n_heads, cfg.dim, "bf16")
    if role == "full":
        c.linear(f"{p}attn.indexer.wk", cfg.index_head_dim, hd, "bf16")
        c.norm(f"{p}attn.indexer.k_norm", cfg.index_head_dim)


def _ffn(c: _Collector, p: str, layer: int) -> None:
    cfg = c.cfg
    n_routed, _ = cfg.n_experts(layer)
    c.add(f"{p}ffn.gate.weight", (n_routed, cfg.dim), "bf16")
    c.add(f"{p}ffn.gate.bias", (n_routed,), "fp32", "zeros")
    if cfg.vision_n_layers:  # the expert-choice bias of image-span tokens (docs/vision.md)
        c.add(f"{p}ffn.gate.bias_vl", (n_routed,), "fp32", "zeros")
    for e in range(n_routed):
        for w, (o, i) in (("w1", (cfg.moe_inter_dim, cfg.dim)), ("w2", (cfg.dim, cfg.moe_inter_dim)),
                          ("w3", (cfg.moe_inter_dim, cfg.dim))):
            c.linear(f"{p}ffn.experts.{e}.{w}", o, i, _expert_kind(cfg))
    if cfg.n_shared_experts:
        inter = cfg.n_shared_experts * cfg.moe_inter_dim
        c.linear(f"{p}ffn.shared_experts.w1", inter, cfg.dim)
        c.linear(f"{p}ffn.shared_experts.w2", cfg.dim, inter)
        c.linear(f"{p}ffn.shared_experts.w3", inter, cfg.dim)


def _block(c: _Collector, p: str, layer: int) -> None:
    cfg = c.cfg
    mix, hc_dim = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim
    for part in ("attn", "ffn"):
        c.add(f"{p}hc_{part}_fn", (mix, hc_dim), "fp32", "small")
        c.add(f"{p}hc_{part}_base", (mix,), "fp32", "zeros")
        c.add(f"{p}hc_{part}_scale", (3,), "fp32", "ones")
    c.norm(f"{p}attn_norm", cfg.dim)
    c.norm(f"{p}ffn_norm", cfg.dim)
    _attention(c, p, layer)
    _ffn(c, p, layer)


def _engram(c: _Collector, p: str, layer: int) -> None:
    cfg = c.cfg
    rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    c.add(f"{p}engram.embed.weight", (rows, cfg.engram_head_dim), "fp8_table", "normal", group="engram")
    c.linear(f"{p}engram.wkv", cfg.dim * (cfg.hc_mult + 1), cols * cfg.engram_head_dim)
    c.add(f"{p}engram.q_weight", (cfg.hc_mult, cfg.dim), "bf16", "ones")
    c.add(f"{p}engram.k_weight", (cfg.hc_mult, cfg.dim), "bf16", "ones")


def _draft(c: _Collector, stage: int) -> None:
    cfg = c.cfg
    p = f"mtp.{stage}."
    _block(c, p, cfg.n_layers + stage)
    if stage == 0:
        c.linear(f"{p}main_proj", cfg.dim, cfg.dim * len(cfg.dspark_target_layer_ids))
        c.norm(f"{p}main_norm", cfg.dim)
    if stage == cfg.n_mtp_layers - 1:
        c.norm(f"{p}norm", cfg.dim)
        c.add(f"{p}markov_head.embed.weight", (cfg.vocab_size, cfg.dspark_markov_rank), "bf16", "normal")
        c.linear(f"{p}markov_head.head", cfg.vocab_size, cfg.dspark_markov_rank, "bf16")
        c.linear(f"{p}confidence_head.proj", 1, cfg.dim + cfg.dspark_markov_rank, "bf16")


def _vision(c: _Collector) -> None:
    """The ViT (``vision.``), the aligner (``aligner.``) and the span delimiters, all bf16."""
    cfg = c.cfg
    D, I, p, r = cfg.vision_dim, cfg.vision_inter_dim, cfg.vision_patch_size, cfg.vision_downsample_ratio
    c.linear("vision.patch_embed.proj", D, 3 * p * p, "bf16")
    c.add("vision.patch_embed.proj.bias", (D,), "bf16")
    for i in range(cfg.vision_n_layers):
        b = f"vision.blocks.{i}."
        c.norm(f"{b}norm1", D)
        c.linear(f"{b}attn.wqkv", 3 * D, D, "bf16")
        c.add(f"{b}attn.wqkv.bias", (3 * D,), "bf16")
        c.linear(f"{b}attn.wo", D, D, "bf16")
        c.add(f"{b}attn.wo.bias", (D,), "bf16")
        c.norm(f"{b}norm2", D)
        c.linear(f"{b}mlp.w1", 2 * I, D, "bf16")
        c.linear(f"{b}mlp.w2", D, I, "bf16")
    c.norm("vision.norm", D)
    c.linear("aligner.w1", cfg.dim, D * r * r, "bf16")
    c.add("aligner.w1.bias", (cfg.dim,), "bf16")
    c.linear("aligner.w2", cfg.dim, cfg.dim, "bf16")
    c.add("aligner.w2.bias", (cfg.dim,), "bf16")
    for name in ("image_start", "image_end", "image_newline"):
        c.add(name, (cfg.dim,), "bf16", "normal")


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """All parameters of ``cfg`` in a stable order."""
    c = _Collector(cfg, "backbone")
    c.add("embed.weight", (cfg.vocab_size, cfg.dim), "bf16", "normal")
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        if layer in cfg.engram_layer_ids:
            _engram(c, p, layer)
        _block(c, p, layer)
    c.norm("norm", cfg.dim)
    c.linear("head", cfg.vocab_size, cfg.dim, "bf16")
    if cfg.vision_n_layers:
        _vision(c)
    if cfg.dspark_block_size:
        c.group = "draft"
        for stage in range(cfg.n_mtp_layers):
            _draft(c, stage)
    return c.out


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Logical parameter counts per group."""
    out = {"backbone": 0, "engram": 0, "draft": 0}
    for s in param_specs(cfg):
        out[s.group] += s.numel
    return out
