"""Projections of one input stored as one weight: their rows concatenated along ``out``, so one
``ops.linear`` computes all of them and its output splits into views.

Each output column of ``linear`` depends only on the input row and its own weight row (the input
is quantized per token, independently of the weight), so the concatenated GEMM gives every
projection's columns as the separate GEMMs would. The weights dict keeps its names: each name is
rebound to its view of the concatenated weight (one copy in memory; checkpoint I/O copies views
out, :func:`flashrt.graphs.checkpoint._own`).
"""
from __future__ import annotations

import torch

from flashrt.formats import QTensor, spec


def _edge(w) -> int:
    """Rows per scale row along ``out`` (1 where each row has its own scales, and for plain weights)."""
    if isinstance(w, QTensor):
        s = spec(w.fmt)
        return s.block if s.tiled else 1
    return 1


def can_concat(weights: list) -> bool:
    """Whether ``weights`` ([out_i, in] each) concatenate along ``out`` into one weight of their
    kind: all plain of one dtype and device, or all ``QTensor`` of one format and layout, one
    ``in``, and every part but the last a whole number of scale tiles along ``out``."""
    first = weights[0]
    if any(w.ndim != 2 or w.shape[1] != first.shape[1] or w.device != first.device for w in weights):
        return False
    if isinstance(first, QTensor):
        if not all(isinstance(w, QTensor) and w.fmt == first.fmt for w in weights):
            return False
        parts = [(w.data, w.scale) for w in weights]
        if any(d.dim() != 2 or s.dim() != 2 or d.shape[1] != parts[0][0].shape[1] or s.shape[1] != parts[0][1].shape[1]
               for d, s in parts):
            return False
    elif not all(isinstance(w, torch.Tensor) and not isinstance(w, QTensor) and w.dtype == first.dtype
                 for w in weights):
        return False
    edge = _edge(first)
    return all(w.shape[0] % edge == 0 for w in weights[:-1])


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` along dim 0, as a view where the parts already lie back to back in one
    storage (the views a previous :func:`fuse_in_place` bound: no second copy)."""
    first = parts[0]
    if all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           for p in parts) and all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(parts, parts[1:])):
        rows = sum(p.shape[0] for p in parts)
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]),
                                       first.stride())
    return torch.cat(parts)


def concat_out(weights: list):
    """``weights`` ([out_i, in], :func:`can_concat`) -> one [sum out_i, in] weight."""
    if not can_concat(weights):
        raise ValueError(f"weights: expected [out, in] weights of one kind, in and scale tiling, got "
                         f"{[(type(w).__name__, getattr(w, 'fmt', getattr(w, 'dtype', None)), tuple(w.shape)) for w in weights]}")
    first = weights[0]
    if not isinstance(first, QTensor):
        return _cat(weights)
    rows = sum(w.shape[0] for w in weights)
    tops = [w.scale_max for w in weights]
    return QTensor(_cat([w.data for w in weights]), _cat([w.scale for w in weights]), first.fmt,
                   (rows, first.shape[1]), scale_max=None if None in tops else max(tops))


def out_rows(w, start: int, stop: int):
    """Rows ``start:stop`` of the [out, in] weight ``w`` as a view (``start`` on a scale tile edge)."""
    if not isinstance(w, QTensor):
        return w[start:stop]
    edge = _edge(w)
    if start % edge:
        raise ValueError(f"start: expected a multiple of the {w.fmt} tile ({edge}), got {start}")
    return QTensor(w.data[start:stop], w.scale[start // edge: -(-stop // edge)], w.fmt, (stop - start, w.shape[1]),
                   scale_max=w.scale_max)  # the whole weight's: a bound of the rows


def fuse_in_place(w: dict, names: list[str]):
    """The weights ``w[names]`` concatenated along ``out``, each name rebound to its view of it:
    ``(fused, widths)``; ``None`` (``w`` untouched) when they cannot be concatenated."""
    parts = [w[n] for n in names]
    if not can_concat(parts):
        return None
    fused = concat_out(parts)
    start = 0
    for n, part in zip(names, parts):
        w[n] = out_rows(fused, start, start + part.shape[0])
        start += part.shape[0]
    return fused, tuple(p.shape[0] for p in parts)
