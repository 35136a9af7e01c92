"""Test helper: write a checkpoint directory laid out as DeepSeek-V4.1-Flash is published.

As published (the root ``config.json`` and ``inference/config.json`` keys, tensor names, stored
dtypes and the vision tower's tensor list follow the published files): a Hugging Face root
config (``text_config`` / ``vision_config`` / ``quantization_config``), the flat
``inference/config.json``, ``model.safetensors.index.json`` with several ``model-0000i-of-0000N``
shards, ``attn.wo_a`` stored F8_E4M3 + ``.scale`` (UE8M0 per 32x32 tile), routed experts' FP4
bytes as I8, and the vision tensors (random values: flashrt does not load them).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashrt.formats import dequantize, quantize
from flashrt.graphs import checkpoint
from flashrt.graphs.hf_config import to_hf

SPECIAL = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
RUNTIME_KEYS = ("max_batch_size", "max_seq_len", "temperature", "gate_temp", "norm_topk_prob")
VISION = dict(vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=48, vision_patch_size=2,
              vision_downsample_ratio=2, vision_max_n_token=16, vision_min_pixels=16)


def with_vision(cfg):
    """``cfg`` with a (small) vision tower, as the published config has one."""
    return cfg.replace(**VISION)


def wo_a_as_converted(weights: dict) -> dict:
    """``weights`` with every ``wo_a`` replaced by what the published FP8 storage dequantizes to
    (the official convert.py's BF16 weight): the values a published checkpoint can hold."""
    out = dict(weights)
    for name, w in weights.items():
        if name.endswith("attn.wo_a.weight"):
            out[name] = dequantize(quantize(w.float(), "fp8_w"), torch.bfloat16)
    return out


def vision_tensors(cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The vision tower's tensors (names and shapes as published), random BF16 / F32."""
    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=gen).to(dtype)
    d, vd, inter, p, k = cfg.dim, cfg.vision_dim, cfg.vision_inter_dim, cfg.vision_patch_size, cfg.vision_downsample_ratio
    out = {name: r(d) for name in ("image_start", "image_end", "image_newline")}
    out.update({"aligner.w1.weight": r(d, vd * k * k), "aligner.w1.bias": r(d), "aligner.w2.weight": r(d, d),
                "aligner.w2.bias": r(d), "vision.patch_embed.proj.weight": r(vd, 3 * p * p),
                "vision.patch_embed.proj.bias": r(vd), "vision.norm.weight": r(vd)})
    for b in range(cfg.vision_n_layers):
        q = f"vision.blocks.{b}."
        out.update({q + "attn.wqkv.weight": r(3 * vd, vd), q + "attn.wqkv.bias": r(3 * vd),
                    q + "attn.wo.weight": r(vd, vd), q + "attn.wo.bias": r(vd), q + "mlp.w1.weight": r(2 * inter, vd),
                    q + "mlp.w2.weight": r(vd, inter), q + "norm1.weight": r(vd), q + "norm2.weight": r(vd)})
    blocks = [f"layers.{i}." for i in range(cfg.n_layers)]
    blocks += [f"mtp.{s}." for s in range(cfg.n_mtp_layers if cfg.dspark_block_size else 0)]
    for i, p_ in enumerate(blocks):
        routed, _ = cfg.n_experts(i if i < cfg.n_layers else cfg.n_layers)
        out[p_ + "ffn.gate.bias_vl"] = r(routed, dtype=torch.float32)
    return out


def published_tensors(weights: dict, cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the published layout for ``weights`` (``wo_a`` quantized to FP8 here)."""
    tensors = checkpoint.encode(wo_a_as_converted(weights), cfg, fp4_dtype="i8")
    out = {}
    for name, t in tensors.items():
        if name.endswith("attn.wo_a.weight"):
            q = quantize(t.float(), "fp8_w")
            out[name], out[name[: -len("weight")] + "scale"] = q.data, q.scale
        else:
            out[name] = t
    if cfg.vision_enabled:
        out.update(vision_tensors(cfg, torch.Generator().manual_seed(seed)))
    return out


def write_published(weights: dict, cfg, path, n_shards: int = 3, tensors: dict | None = None) -> Path:
    """Write ``weights`` of ``cfg`` (which should have a vision tower) in the published layout."""
    path = Path(path)
    (path / "inference").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(to_hf(cfg, SPECIAL), indent=2))
    flat = {k: v for k, v in cfg.to_dict().items() if k not in RUNTIME_KEYS}
    (path / "inference" / "config.json").write_text(json.dumps(flat, indent=2))
    tensors = published_tensors(weights, cfg) if tensors is None else tensors
    names = sorted(tensors)
    weight_map, total = {}, 0
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::n_shards]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path
