"""One row of a :class:`~flashrt.kv.state.KVState` as prefix-cache entry tensors, and back.

An entry of ``length`` tokens holds the row's global KV (every KV source's main KV and index K for
its first ``length`` positions) and, for a "full" entry, everything else a continuation reads at
that boundary: the window ring of every layer (draft layers too) with its start position, the
compressors' partial groups, the Engram hash history and the logits of position ``length - 1``.
Every tensor is stored as plain bytes (``uint8`` views of the quantized formats) and checked
against the layout the model expects before anything is written into a state.
"""
from __future__ import annotations

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from flashrt.formats import MAIN_KV_FORMAT, QTensor, expected_layout

FULL, GLOBAL = "full", "global"
U8 = torch.uint8


class LayoutError(ValueError):
    """An entry whose tensors do not match the layout the model expects."""


def layout(cfg, window_fmt: str, length: int, kind: str) -> dict:
    """name -> (dtype, shape) of every tensor of an entry of ``length`` tokens."""
    out = {}
    for l in cfg.kv_source_layers:
        n = length // cfg.ratio(l)
        for part, fmt, dim in (("main", MAIN_KV_FORMAT, cfg.head_dim), ("index", "fp4_b32", cfg.index_head_dim)):
            data, scale = expected_layout(fmt, (n, dim))
            out[f"{l}.{part}.data"], out[f"{l}.{part}.scale"] = (U8, tuple(data)), (U8, tuple(scale))
    if kind == FULL:
        data, scale = expected_layout(window_fmt, (cfg.window_size, cfg.head_dim))
        for l in range(cfg.total_layers):
            out[f"ring.{l}.data"], out[f"ring.{l}.scale"] = (U8, tuple(data)), (U8, tuple(scale))
            out[f"ring.{l}.start"] = (torch.int64, (1,))
        for l in cfg.kv_source_layers:
            if cfg.ratio(l) > 1:
                out[f"{l}.partial.kv"] = out[f"{l}.partial.score"] = (torch.float32, (cfg.ratio(l), cfg.head_dim))
        out["engram.history"] = (torch.int64, (max(cfg.engram_max_ngram_size - 1, 0),))
        out["logits"] = (torch.float32, (cfg.vocab_size,))
    return out


def global_kv(state, row: int, lo: int, hi: int) -> dict:
    """The global KV of ``row`` for positions ``[lo, hi)`` (``lo`` a multiple of every ratio): the
    entries of the groups complete by ``hi``."""
    out = {}
    for l, c in state.compressed.items():
        r = state.cfg.ratio(l)
        main = c.main.read_row(row, hi // r)
        index = c.index_k.read_row(row, lo // r, hi // r)
        out[f"{l}.main.data"], out[f"{l}.main.scale"] = main.data[lo // r:].view(U8), main.scale.view(U8)[lo // r:]
        out[f"{l}.index.data"], out[f"{l}.index.scale"] = index.data.view(U8), index.scale.view(U8)
    return out


def window_state(state, row: int) -> dict:
    """Host copies of everything but the global KV that ``row`` carries to its next step."""
    out = {}
    for l, ring in state.rings.items():
        out[f"ring.{l}.data"], out[f"ring.{l}.scale"] = ring.data[row].view(U8), ring.scale[row].view(U8)
        out[f"ring.{l}.start"] = state.ring_start[l][row:row + 1]
    for l, c in state.compressed.items():
        if c.kv_state is not None:
            out[f"{l}.partial.kv"], out[f"{l}.partial.score"] = c.kv_state[row], c.score_state[row]
    out["engram.history"] = state.engram_history[row]
    return {k: v.detach().to("cpu", copy=True) for k, v in out.items()}


def export_row(state, row: int, length: int, logits: torch.Tensor | None = None) -> bytes:
    """Entry bytes of ``row``'s first ``length`` positions: its global KV, and with ``logits`` (its
    logits at ``length - 1``; the row must stand at ``length``) a full entry with its window state."""
    tensors = global_kv(state, row, 0, length)
    if logits is not None:
        if state.host_positions[row] != length:
            raise ValueError(f"length: a full entry needs the row at its boundary ({state.host_positions[row]}), "
                             f"got {length}")
        tensors.update(window_state(state, row), logits=logits.detach().to("cpu", torch.float32))
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def parse(payload: bytes, cfg, window_fmt: str, length: int, kind: str) -> dict:
    """Entry tensors of ``payload``, checked against :func:`layout`; :class:`LayoutError` if not."""
    try:
        tensors = st_load(payload)
    except Exception as exc:  # safetensors raises its own error type for bytes it cannot parse
        raise LayoutError(f"payload: not a safetensors blob ({exc})") from exc
    want = layout(cfg, window_fmt, length, kind)
    if set(tensors) != set(want):
        odd = sorted(set(tensors) ^ set(want))
        raise LayoutError(f"tensors: expected the {len(want)} of a {kind} entry of {length} tokens, "
                          f"{len(odd)} missing or extra (e.g. {odd[:3]})")
    for name, (dtype, shape) in want.items():
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise LayoutError(f"{name}: expected {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
    if kind == FULL:
        starts = torch.cat([tensors[f"ring.{l}.start"] for l in range(cfg.total_layers)])
        if starts.min() < 0 or starts.max() > length:
            raise LayoutError(f"ring starts: expected values in [0, {length}], got {starts.tolist()}")
    return tensors


def import_row(state, row: int, tensors: dict, length: int, window: bool = True) -> None:
    """Write parsed entry ``tensors`` into ``row`` of a fresh ``state``: the global KV of ``length``
    positions and, with ``window`` (a full entry), the window state. Positions are not advanced."""
    cfg = state.cfg
    for l, c in state.compressed.items():
        n = length // cfg.ratio(l)
        c.main.write_row(row, QTensor(tensors[f"{l}.main.data"], tensors[f"{l}.main.scale"].view(torch.float8_e4m3fn),
                                      MAIN_KV_FORMAT, (n, cfg.head_dim)))
        c.index_k.write_row(row, 0, QTensor(tensors[f"{l}.index.data"],
                                            tensors[f"{l}.index.scale"].view(torch.float8_e8m0fnu),
                                            "fp4_b32", (n, cfg.index_head_dim)))
    if window:
        load_window(state, row, tensors)


def load_window(state, row: int, tensors: dict) -> None:
    """Write :func:`window_state` tensors into ``row`` of ``state``."""
    dev = state.device
    for l, ring in state.rings.items():
        ring.data.view(U8)[row] = tensors[f"ring.{l}.data"].to(dev)
        ring.scale.view(U8)[row] = tensors[f"ring.{l}.scale"].to(dev)
        state.ring_start[l][row] = tensors[f"ring.{l}.start"].to(dev)[0]
    for l, c in state.compressed.items():
        if c.kv_state is not None:
            c.kv_state[row] = tensors[f"{l}.partial.kv"].to(dev)
            c.score_state[row] = tensors[f"{l}.partial.score"].to(dev)
    state.engram_history[row] = tensors["engram.history"].to(dev)
