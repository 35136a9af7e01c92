"""Prefix caching for the model (HKCP persistent tier + bounded replay).

A prompt's global KV (every KV source's main KV and index K) up to an aligned length ``L`` (a
multiple of ``ALIGN`` tokens, so no compressor group is pending) is stored content-addressed by
the hash of (model identity, the first ``L`` tokens). Window KV is not stored: on a hit the entries
are loaded and the last ``window_size`` tokens before ``L`` are replayed through every layer (no new
entries) to rebuild the window rings — the bounded-replay approximation of docs/model.md, 7.
"""
from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from flashrt.formats import QTensor

from flashrt.graphs.context import StepContext

ALIGN = 64


def model_identity(model) -> str:
    """sha256 of the config and a fingerprint of every weight (name, shape, dtype, leading bytes)."""
    if getattr(model, "_identity", None) is None:
        h = hashlib.sha256(json.dumps(model.cfg.to_dict(), sort_keys=True).encode())
        for name in sorted(model.weights):
            w = model.weights[name]
            data = w.data if isinstance(w, QTensor) else w
            h.update(f"{name}:{tuple(data.shape)}:{data.dtype};".encode())
            h.update(data.reshape(-1)[:64].view(torch.uint8).cpu().numpy().tobytes())
        model._identity = h.hexdigest()
    return model._identity


def prefix_key(identity: str, tokens, images=()) -> str:
    """Key of a prefix: the model, its tokens and the digests of the images whose spans start in it
    (an image span's tokens are all the image token: only the digest tells two images apart)."""
    data = torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()
    return hashlib.sha256(identity.encode() + b":" + data + "".join(images).encode()).hexdigest()


def image_digests(images, length: int) -> list[str]:
    """Digests of the images of ``images`` (``[(span start, ImageInput)]``) starting before ``length``."""
    return [item.digest for start, item in images if start < length]


def aligned(n: int, cfg) -> int:
    """The longest cacheable prefix of ``n`` tokens."""
    assert all(ALIGN % cfg.ratio(l) == 0 for l in cfg.kv_source_layers)
    return (n // ALIGN) * ALIGN


def export_row(state, row: int, length: int) -> bytes:
    """The global KV of ``row`` for its first ``length`` positions, as safetensors bytes."""
    tensors = {}
    for l, c in state.compressed.items():
        n = length // state.cfg.ratio(l)
        main = c.main.read_row(row, n)
        tensors[f"{l}.main.data"], tensors[f"{l}.main.scale"] = main.data, main.scale.view(torch.uint8)
        index = c.index_k.read_row(row, 0, n)
        tensors[f"{l}.index.data"], tensors[f"{l}.index.scale"] = index.data, index.scale.view(torch.uint8)
    return st_save(tensors)


def import_row(state, row: int, payload: bytes, length: int) -> None:
    """Load :func:`export_row` bytes into ``row`` of a fresh ``state``."""
    tensors = st_load(payload)
    cfg = state.cfg
    for l, c in state.compressed.items():
        n = length // cfg.ratio(l)
        main = QTensor(tensors[f"{l}.main.data"], tensors[f"{l}.main.scale"].view(torch.float8_e4m3fn),
                       "fp4_b16", (n, cfg.head_dim))
        if main.data.shape[0] != n:
            raise ValueError(f"payload: layer {l} holds {main.data.shape[0]} entries, expected {n}")
        c.main.write_row(row, main)
        index = QTensor(tensors[f"{l}.index.data"], tensors[f"{l}.index.scale"].view(torch.float8_e8m0fnu),
                        "fp4_b32", (n, cfg.index_head_dim))
        c.index_k.write_row(row, 0, index)


def lookup(model, cache, tokens: list[int], images=()) -> tuple[int, bytes | None]:
    """Longest cached aligned prefix of ``tokens`` (with ``images``, ``[(span start,
    ImageInput)]``): (length, payload), or (0, None)."""
    ident = model_identity(model)
    for length in range(aligned(len(tokens), model.cfg), 0, -ALIGN):
        hit = cache.get(prefix_key(ident, tokens[:length], image_digests(images, length)))
        if hit is not None:
            return length, hit[0]
    return 0, None


def store(model, cache, state, row: int, tokens: list[int], images=()) -> bool:
    """Store ``row``'s aligned prefix of ``tokens`` (with ``images``) unless already cached; True
    if written."""
    length = aligned(len(tokens), model.cfg)
    if length == 0:
        return False
    key = prefix_key(model_identity(model), tokens[:length], image_digests(images, length))
    if cache.contains(key):
        return False
    cache.put(key, export_row(state, row, length), {"tokens": length, "model": model_identity(model)[:16]})
    return True


def restore(model, state, payloads: list[bytes], ids: torch.Tensor, length: int,
            replay: int | None = None, spans=None) -> torch.Tensor:
    """Load cached global KV (one payload per row, all ``length`` positions) into a fresh
    ``state`` and replay the last ``window_size`` tokens before ``length``; returns the logits at
    position ``length - 1``. ``ids`` [B, >= length] are the rows' tokens. ``replay``: tokens to
    replay (default ``window_size``; ``length`` replays everything and reproduces a full prefill).
    ``spans``: the rows' image spans over ``ids`` (:class:`~flashrt.graphs.vision.ImageSpans`)."""
    cfg = model.cfg
    for row, payload in enumerate(payloads):
        import_row(state, row, payload, length)
    start = max(0, length - (cfg.window_size if replay is None else replay))
    for ring_start in state.ring_start.values():
        ring_start.fill_(start)
    state.positions.fill_(start)
    state.host_positions = [start] * state.batch
    tokens = ids[:, start:length].to(model.device)
    if model.hasher is not None and start:
        n_hist = state.engram_history.shape[1]
        state.engram_history = model.hasher.token_map(ids[:, max(0, start - n_hist):start].to(model.device))
        if spans is not None:  # image tokens enter the history as no token
            state.engram_history[spans.mask[:, max(0, start - n_hist):start]] = -1
        if state.engram_history.shape[1] < n_hist:
            pad = torch.full((state.batch, n_hist - state.engram_history.shape[1]), -1, dtype=torch.long,
                             device=model.device)
            state.engram_history = torch.cat([pad, state.engram_history], dim=1)
    part = None if spans is None else spans.chunk(start, length)
    ctx = model.context(tokens, state, *model._span_masks(tokens, None, part))
    ctx = StepContext(ctx.positions, ctx.end, state, ctx.rope, ctx.engram_ids,
                      compress_done=frozenset(cfg.kv_source_layers), token_mask=ctx.token_mask,
                      next_history=ctx.next_history, vl_mask=ctx.vl_mask)
    captured = {} if model.drafts is not None else None
    x, pre = model.run_layers(*model.embed_tokens(tokens, part), ctx, range(cfg.n_layers), capture=captured)
    if captured:
        model.drafts.seed(captured, ctx)
    state.advance(length - start, ctx.next_history)
    return model.logits(x, pre, all_positions=False)
