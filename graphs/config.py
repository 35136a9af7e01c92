"""Model configuration: one field per key of the reference inference ``config.json``.

``ModelConfig.from_file`` reads a flat ``config.json`` (the reference ``ModelArgs`` keys, as in
the published ``inference/config.json``) or the published Hugging Face root ``config.json``
(``text_config`` / ``vision_config`` / ``quantization_config`` with Hugging Face key names, mapped
by :mod:`.hf_config`). Every value is type- and range-checked (:mod:`.config_schema`) and an
unknown key is rejected by name. Shipped configs (``tiny``, ``small``, ``v4.1-flash``) live in
``graphs/configs/*.json``; ``deepseek-llm-67b`` is a dense GQA config (:mod:`flashrt.graphs.dense`)
used only by ``flashrt plan``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from importlib import resources

from flashrt.errors import CheckpointError

from .config_schema import KEYS, ConfigValueError, check_value
from .hf_config import read_config


@dataclass(frozen=True)
class ModelConfig:
    """The reference ``ModelArgs`` keys; defaults describe no particular model (use a shipped one)."""

    max_batch_size: int = 4
    max_seq_len: int = 4096
    temperature: float = 1.0
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    vocab_size: int = 129280
    dim: int = 1024
    moe_inter_dim: int = 1024
    n_layers: int = 5
    n_mtp_layers: int = 0
    n_heads: int = 16
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    swiglu_limit: float = 0.0
    q_lora_rank: int = 256
    head_dim: int = 128
    rope_head_dim: int = 32
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 256
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 2, 2, 1, 1)
    kv_source_layers: tuple[int, ...] = (1, 3)
    index_source_layers: tuple[int, ...] = (1, 3)
    compress_rope_theta: float = 40000.0
    original_seq_len: int = 0
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    index_n_heads: int = 16
    index_head_dim: int = 64
    index_topk: int = 64
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 1
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 544 * 544
    vision_max_wh_ratio: int | None = None
    image_token_id: int = 129264
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for key in KEYS:  # type and range first: the cross-key rules below assume them
            object.__setattr__(self, key, check_value(key, getattr(self, key)))
        validate(self)

    # ----- derived facts -----------------------------------------------------------------------
    @property
    def vision_enabled(self) -> bool:
        """The config describes a vision tower (``vision_n_layers > 0``; docs/vision.md)."""
        return self.vision_n_layers > 0

    @property
    def total_layers(self) -> int:
        """Backbone plus draft layers (draft layers exist when ``dspark_block_size > 0``)."""
        return self.n_layers + (self.n_mtp_layers if self.dspark_block_size else 0)

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0

    def kv_source(self, layer: int) -> int | None:
        """The layer whose compressed KV ``layer`` reads (itself for a source), or None."""
        if layer >= self.n_layers or not self.ratio(layer):
            return None
        return max((s for s in self.kv_source_layers if s <= layer), default=None)

    def index_source(self, layer: int) -> int | None:
        """The layer whose top-k ``layer`` uses (itself for an index source), or None."""
        if layer >= self.n_layers or not self.ratio(layer):
            return None
        return max((s for s in self.index_source_layers if s <= layer), default=None)

    def role(self, layer: int) -> str:
        """``window``, ``full`` (own KV + indexer), ``reindex`` (own indexer, shared KV),
        ``reuse`` (shared KV and top-k) or ``draft``."""
        if layer >= self.n_layers:
            return "draft"
        if not self.ratio(layer):
            return "window"
        if layer in self.kv_source_layers:
            return "full"
        return "reindex" if layer in self.index_source_layers else "reuse"

    def uses_candidates(self, layer: int) -> bool:
        return layer in self.index_source_layers and 0 <= self.candidate_source_layer < layer

    def n_experts(self, layer: int) -> tuple[int, int]:
        """(routed, activated) experts of ``layer`` (draft layers may have their own)."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("name")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: dict, name: str = "custom", source: str = "config") -> "ModelConfig":
        """A config from a flat ``ModelArgs`` or published Hugging Face style object (``ValueError``
        naming the key, as written in ``data``, for an unknown key or a bad value)."""
        args, labels, _ = read_config(data, source)
        try:
            return cls(**args, name=name)
        except ConfigValueError as exc:
            label = labels.get(exc.key, exc.key)
            if label != exc.key and repr(label) not in str(exc):
                raise ConfigValueError(exc.key, f"{exc} (written as {label!r} in {source})") from None
            raise

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        with open(path) as f:
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "custom"
        return cls.from_dict(data, name=name, source=path)


assert set(KEYS) == {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}, "config_schema.KEYS is stale"


def validate(cfg: ModelConfig) -> None:
    """``ValueError`` naming the key when the config cannot describe a runnable model."""
    def need(ok: bool, key: str, what: str):
        if not ok:
            raise ConfigValueError(key, f"config key {key!r}: expected {what}, got {getattr(cfg, key)!r}")

    need(len(cfg.compress_ratios) >= cfg.n_layers, "compress_ratios", f"at least n_layers={cfg.n_layers} entries")
    need(all(r in (0, 1, 2, 4) for r in cfg.compress_ratios), "compress_ratios", "ratios in {0, 1, 2, 4}")
    need(cfg.rope_head_dim % 2 == 0 and cfg.rope_head_dim <= cfg.head_dim, "rope_head_dim", "even and <= head_dim")
    need(cfg.head_dim % 32 == 0, "head_dim", "a multiple of 32 (fp8 / fp4 blocks)")
    need(cfg.index_head_dim % 32 == 0, "index_head_dim", "a multiple of 32 (fp4 blocks)")
    need(cfg.n_heads % cfg.o_groups == 0, "o_groups", f"a divisor of n_heads={cfg.n_heads}")
    need(cfg.n_shared_experts in (0, 1), "n_shared_experts", "0 or 1")
    need(cfg.n_activated_experts <= cfg.n_routed_experts, "n_activated_experts",
         f"at most n_routed_experts={cfg.n_routed_experts}")
    for key in ("kv_source_layers", "index_source_layers"):
        need(all(0 <= l < cfg.n_layers and cfg.ratio(l) > 0 for l in getattr(cfg, key)), key,
             "layers with a compress ratio > 0")
    for layer in range(cfg.n_layers):
        if cfg.ratio(layer):
            src, isrc = cfg.kv_source(layer), cfg.index_source(layer)
            need(src is not None and cfg.ratio(src) == cfg.ratio(layer), "kv_source_layers",
                 f"an earlier source with ratio {cfg.ratio(layer)} for layer {layer}")
            need(isrc is not None, "index_source_layers", f"an index source at or before layer {layer}")
            need(cfg.kv_source(isrc) == src, "index_source_layers",
                 f"layer {layer}'s top-k to come from an index source over its own KV source {src} "
                 f"(every KV source must be an index source)")
    if cfg.candidate_source_layer >= 0:
        need(cfg.candidate_source_layer in cfg.kv_source_layers, "candidate_source_layer", "a kv source layer")
        need(cfg.candidate_topk_blocks > 0 and cfg.candidate_block_size > 0, "candidate_topk_blocks", "> 0")
    _validate_extras(cfg, need)


def _validate_extras(cfg: ModelConfig, need) -> None:
    """Engram, draft and vision keys."""
    if cfg.engram_layer_ids:
        need(len(set(cfg.engram_layer_ids)) == len(cfg.engram_layer_ids)
             and all(l < cfg.n_layers for l in cfg.engram_layer_ids), "engram_layer_ids",
             f"distinct layers below n_layers={cfg.n_layers}")
        need(len(cfg.engram_num_embeddings) == len(cfg.engram_layer_ids), "engram_num_embeddings",
             "one row count per engram layer")
        need(cfg.engram_max_ngram_size >= 2 and cfg.engram_n_heads > 0 and cfg.engram_head_dim % 32 == 0
             and cfg.engram_head_dim > 0, "engram_max_ngram_size",
             ">= 2 with engram heads and head_dim a positive multiple of 32")
    if cfg.dspark_block_size:
        need(len(cfg.dspark_target_layer_ids) > 0 and cfg.n_mtp_layers > 0, "dspark_target_layer_ids",
             "target layers and n_mtp_layers > 0")
        need(all(l < cfg.n_layers for l in cfg.dspark_target_layer_ids), "dspark_target_layer_ids",
             f"layers below n_layers={cfg.n_layers}")
        routed, active = cfg.n_experts(cfg.n_layers)
        need(active <= routed, "dspark_n_activated_experts", f"at most the draft layers' {routed} routed experts")
    if cfg.vision_n_layers:
        validate_vision(cfg, need)


def validate_vision(cfg: ModelConfig, need) -> None:
    """The vision keys of a model with a vision tower (docs/vision.md)."""
    for key in ("vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
                "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels"):
        need(getattr(cfg, key) > 0, key, "> 0 with a vision tower (vision_n_layers > 0)")
    need(cfg.vision_dim % cfg.vision_n_heads == 0 and (cfg.vision_dim // cfg.vision_n_heads) % 4 == 0,
         "vision_n_heads",
         f"a divisor of vision_dim={cfg.vision_dim} leaving a head dim divisible by 4 (2-D rotary halves)")
    need(cfg.vision_max_n_token >= 4, "vision_max_n_token", ">= 4 (one 2 x 2 merged patch grid)")
    need(cfg.vision_rope_theta > 0, "vision_rope_theta", "> 0")
    need(cfg.vision_max_wh_ratio is None or cfg.vision_max_wh_ratio > 0, "vision_max_wh_ratio", "null or > 0")


SHIPPED = ("tiny", "small", "v4.1-flash", "tiny-vl")


def shipped_config(name: str) -> ModelConfig:
    """A shipped config by name (``tiny``, ``small``, ``v4.1-flash``, ``tiny-vl``)."""
    if name not in SHIPPED:
        raise ValueError(f"model: expected one of {list(SHIPPED)} or a checkpoint directory, got {name!r}")
    text = resources.files("flashrt.graphs").joinpath("configs", f"{name}.json").read_text()
    return ModelConfig.from_dict(json.loads(text), name=name, source=f"{name}.json")
