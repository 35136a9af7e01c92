"""Which slice of each parameter a rank holds (docs/parallel.md), in logical and in stored layout.

:func:`param_cut` names the slice of one parameter (rows or columns), :func:`local_specs` lists a
rank's parameters with their local shapes, :func:`stored_index` turns a logical cut into the index
of the stored data and scale tensors (the quantized formats keep one scale per 32 elements or per
32x32 tile, so cuts fall on whole blocks), and :func:`shard_weights` applies it to weights in
memory. The sharded loader (:mod:`flashrt.graphs.shard_load`) applies the same index to
memory-mapped safetensors slices.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from flashrt.formats import QTensor

from .params import QUANTIZED, ParamSpec, param_specs
from .parallel import Layout

_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight$")
_SHARED = re.compile(r"ffn\.shared_experts\.(w[123])\.weight$")


@dataclass(frozen=True)
class Cut:
    """Entries ``[start, stop)`` of logical dim ``dim`` (0: rows / out, 1: columns / in)."""

    dim: int
    start: int
    stop: int


NOT_HERE = "not here"  # param_cut's answer for an expert another rank holds


def _rows(span_, scale: int = 1, dim: int = 0) -> Cut:
    return Cut(dim, span_[0] * scale, span_[1] * scale)


def param_cut(name: str, cfg, layout: Layout):
    """``None`` (the whole parameter), a :class:`Cut`, or :data:`NOT_HERE` for ``name`` on ``layout``'s rank."""
    tp = layout.tp > 1
    if name in ("embed.weight", "head.weight"):
        return _rows(layout.vocab(cfg)) if tp else None
    m = _LAYER.match(name)
    if m is None:  # norm.weight, draft layers (mtp.*): replicated
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if _EXPERT.match(rest) is not None:  # whole experts, spread over every rank
        lo, hi = layout.experts(cfg.n_experts(layer)[0])
        return None if lo <= int(_EXPERT.match(rest).group(1)) < hi else NOT_HERE
    if _SHARED.match(rest) is not None:  # whole, on one rank of each group
        return None if layout.holds_shared(layer) else NOT_HERE
    if not tp:
        return None
    heads, groups = layout.heads(cfg), layout.groups(cfg)
    cuts = {
        "attn.wq_b.weight": _rows(heads, cfg.head_dim),
        "attn.attn_sink": _rows(heads),
        "attn.wo_a.weight": _rows(groups, cfg.o_lora_rank),
        "attn.wo_b.weight": _rows(groups, cfg.o_lora_rank, dim=1),
    }
    if rest == "engram.embed.weight":
        return _rows(layout.engram_rows(cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]))
    return cuts.get(rest)


def local_spec(spec: ParamSpec, cut) -> ParamSpec:
    if cut is None:
        return spec
    shape = list(spec.shape)
    shape[cut.dim] = cut.stop - cut.start
    return replace(spec, shape=tuple(shape))


def local_specs(cfg, layout: Layout) -> list[tuple[ParamSpec, ParamSpec, Cut | None]]:
    """(full spec, local spec, cut) of every parameter ``layout``'s rank holds, in ``param_specs`` order."""
    out = []
    for spec in param_specs(cfg):
        cut = param_cut(spec.name, cfg, layout)
        if cut is not NOT_HERE:
            out.append((spec, local_spec(spec, cut), cut))
    return out


def _block(a: int, b: int, full: int, block: int, what: str) -> slice:
    """``[a, b)`` in units of ``block`` (a quantization block), checked to fall on whole blocks."""
    if a % block or (b % block and b != full):
        raise ValueError(f"{what}: a cut [{a}, {b}) must fall on whole {block}-wide scale blocks")
    return slice(a // block, -(-b // block))


def stored_index(spec: ParamSpec, cut) -> tuple[tuple, tuple | None]:
    """Index tuples into the stored data and scale tensors of ``spec`` for ``cut`` (None: all)."""
    full = (slice(None),) * len(spec.shape)
    if cut is None:
        return full, (full if spec.kind in QUANTIZED else None)
    logical = list(full)
    logical[cut.dim] = slice(cut.start, cut.stop)
    if spec.kind not in QUANTIZED:
        return tuple(logical), None
    fmt, n = QUANTIZED[spec.kind], spec.shape[cut.dim]
    data, scale = list(logical), list(logical)
    last = cut.dim == len(spec.shape) - 1
    if fmt == "fp8_w":  # 32x32 tiles over both dims
        scale[cut.dim] = _block(cut.start, cut.stop, n, 32, spec.name)
    elif last:  # fp4_w columns: two codes per byte, one scale per 32
        scale[cut.dim] = _block(cut.start, cut.stop, n, 32, spec.name)
        data[cut.dim] = slice(cut.start // 2, cut.stop // 2) if fmt == "fp4_w" else data[cut.dim]
    return tuple(data), tuple(scale)


def shard_tensor(value, spec: ParamSpec, cut):
    """This rank's slice of one in-memory parameter (a copy, so the whole one can be freed)."""
    if cut is None:
        return value
    data_idx, scale_idx = stored_index(spec, cut)
    if isinstance(value, QTensor):
        shape = local_spec(spec, cut).shape
        return QTensor(value.data[data_idx].clone(), value.scale[scale_idx].clone(), value.fmt, shape)
    return value[data_idx].clone()


def shard_weights(weights: dict, cfg, layout: Layout) -> dict:
    """The weights ``layout``'s rank holds, cut from a whole-model weights dict."""
    return {spec.name: shard_tensor(weights[spec.name], spec, cut) for spec, _, cut in local_specs(cfg, layout)}


def nbytes(value) -> int:
    if isinstance(value, QTensor):
        return value.nbytes
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
