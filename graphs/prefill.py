"""Prefill schedules: ``exact`` and ``ced``.

``exact`` runs every layer over every prompt token. ``ced`` (docs/model.md, serving-side
approximations) runs the encoder layers over every token plus the decoder's KV source's
compression, then the decoder layers only over the last ``window_size`` tokens (their window rings
start there: SWA bounded replay).
"""
from __future__ import annotations

import torch

from flashrt.kv.state import KVState

PREFILLS = ("exact", "ced")


def ced_split(cfg) -> int:
    """First decoder layer: the layer-20-style KV source (candidate source, else the last source)."""
    split = cfg.candidate_source_layer if cfg.candidate_source_layer >= 0 else max(cfg.kv_source_layers, default=-1)
    if split < 0 or any(s > split for s in cfg.kv_source_layers):
        raise ValueError("prefill: 'ced' needs one KV source that starts the decoder and none after it")
    return split


def prefill_prompt(model, ids: torch.Tensor, state: KVState, schedule: str = "exact",
                   chunk: int | None = None, spans=None) -> torch.Tensor:
    """Run prompt ``ids`` [B, S] (all rows starting at the same position) -> last-position logits.

    ``chunk``: tokens per forward call (bounds activation memory and lets HKCP spill pages
    between chunks); None runs the prompt in one call. ``spans``: the prompt's image spans
    (:class:`~flashrt.graphs.vision.ImageSpans` over ``ids``); a chunk may cut a span."""
    if schedule not in PREFILLS:
        raise ValueError(f"prefill: expected one of {list(PREFILLS)}, got {schedule!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"prefill_chunk: expected an int >= 1 or None, got {chunk!r}")
    cfg = model.cfg
    S, W = ids.shape[1], cfg.window_size
    chunk = chunk or S
    if schedule == "exact" or S <= W or any(state.host_positions):
        for c0 in range(0, S, chunk):
            part = None if spans is None else spans.chunk(c0, c0 + chunk)
            logits = model.forward(ids[:, c0:c0 + chunk], state=state, spans=part)
        return logits
    return _ced(model, ids, state, chunk, spans)


def _ced(model, ids, state: KVState, chunk: int, spans=None) -> torch.Tensor:
    """Encoder layers + the decoder's KV-source compression over every token (in chunks), then
    the decoder layers over the last ``window_size`` tokens only."""
    cfg = model.cfg
    S, W = ids.shape[1], cfg.window_size
    split = ced_split(cfg)
    block = model.blocks[split]
    tails = []  # (x, pre, positions, engram ids) of the last W tokens
    for c0 in range(0, S, chunk):
        part = ids[:, c0:c0 + chunk]
        sp = None if spans is None else spans.chunk(c0, c0 + part.shape[1])
        token_mask, vl_mask = model._span_masks(part, None, sp)
        ctx = model.context(part, state, token_mask, vl_mask=vl_mask)
        x, pre = model.run_layers(*model.embed_tokens(part, sp), ctx, range(split))
        if block.engram is not None:
            x = block.engram.forward(x, ctx, ctx.token_mask)
        block.attn.compressor.forward(block.attention_input(x, pre), ctx)  # the decoder's global KV
        state.advance(part.shape[1], ctx.next_history)
        if c0 + part.shape[1] > S - W:
            tails.append((x, pre, ctx.positions, ctx.engram_ids))
    cut = lambda i: None if tails[0][i] is None else torch.cat([t[i] for t in tails], dim=1)[:, -W:]
    x, pre, positions, engram_ids = (cut(i) for i in range(4))
    for layer in range(split, cfg.n_layers):
        state.ring_start[layer].fill_(S - W)
    token_mask, vl_mask = model._span_masks(ids[:, -W:], None, None if spans is None else spans.chunk(S - W, S))
    sub = model.step_context(state, positions, S, engram_ids=engram_ids, compress_done=frozenset({split}),
                             token_mask=token_mask, vl_mask=vl_mask)
    captured = {} if model.drafts is not None else None
    x, pre = model.run_layers(x, pre, sub, range(split, cfg.n_layers), skip_engram={split}, capture=captured)
    if captured:
        model.drafts.seed(captured, sub)
    state.commit()  # the decoder layers' (and drafts') rings
    return model.logits(x, pre, all_positions=False)
