"""Prefix caching for the model (HKCP persistent tier).

A prompt's state at an aligned length ``L`` (a multiple of ``ALIGN`` tokens, so no compressor
group is pending) is stored content-addressed by the hash of (model identity, how the state was
made, the first ``L`` tokens): its global KV and everything else a continuation reads, with the
logits of position ``L - 1`` (:mod:`flashrt.engine.prefix_entry`). Generation with a cache splits
a prompt's prefill at its longest aligned length and stores the state there. A hit loads the
entry into a fresh state and replays nothing: it continues exactly as the prefill that stored it
(same backend, same rows prefilled together) would have. On a backend whose results do not depend
on where a prefill is split, as the reference backend, that is bit-identical to a run without the
cache; rows of one length but different hits are prefilled as separate groups, which can move the
last bit on a backend that rounds by batch shape.

``replay=N`` (an option) loads only the global KV and replays the last ``N`` tokens through
every layer to rebuild the window state: the bounded-replay approximation of docs/model.md, section 7
(``benchmarks/bounded_replay.py`` measures its deviation). Session pauses store "global" entries
(global KV only; the window state waits in the window pool).
"""
from __future__ import annotations

import array
import hashlib
import json

import torch

from flashrt.formats import QTensor
from flashrt.graphs.prefill import prefill_prompt

from .prefix_entry import FULL, GLOBAL, LayoutError, export_row, import_row, parse

ALIGN = 64


def model_identity(model) -> str:
    """sha256 of the config, a fingerprint of every weight (name, shape, dtype, leading bytes) and
    the Engram token map."""
    if getattr(model, "_identity", None) is None:
        h = hashlib.sha256(json.dumps(model.cfg.to_dict(), sort_keys=True).encode())
        for name in sorted(model.weights):
            w = model.weights[name]
            data = w.data if isinstance(w, QTensor) else w
            h.update(f"{name}:{tuple(data.shape)}:{data.dtype};".encode())
            h.update(data.reshape(-1)[:64].view(torch.uint8).cpu().numpy().tobytes())
        table = None if model.hasher is None else model.hasher.token_map.table
        if table is not None:
            h.update(b"token_map:" + table.numpy().tobytes())
        model._identity = h.hexdigest()
    return model._identity


def prefix_key(identity: str, tokens, salt: str = "", images=()) -> str:
    """Key of a prefix: the model, how its state was made (``salt``), its tokens and the digests of
    the images whose spans start in it (an image span's tokens are all the image token: only the
    digest tells two images apart)."""
    data = array.array("q", tokens).tobytes()  # int64 in native order, as a torch int64 tensor's bytes
    return hashlib.sha256(f"{identity}:{salt}".encode() + b":" + data + "".join(images).encode()).hexdigest()


def image_digests(images, length: int) -> list[str]:
    """Digests of the images of ``images`` (``[(span start, ImageInput)]``) starting before ``length``."""
    return [item.digest for start, item in images if start < length]


def entry_key(model, tokens, kind: str = FULL, schedule: str = "exact", images=()) -> str:
    """Key of an entry of ``kind`` for ``tokens`` (and the ``images`` starting in them): full
    entries also depend on the prefill schedule and the window-ring format, every entry on the
    device type that computed it."""
    salt = f"{kind}:{model.device.type}" + (f":{schedule}:{model.window_fmt}" if kind == FULL else "")
    return prefix_key(model_identity(model), tokens, salt, image_digests(images, len(tokens)))


def aligned(n: int, cfg) -> int:
    """The longest cacheable prefix of ``n`` tokens."""
    assert all(ALIGN % cfg.ratio(l) == 0 for l in cfg.kv_source_layers)
    return (n // ALIGN) * ALIGN


def check_replay(replay) -> None:
    if replay is not None and (isinstance(replay, bool) or not isinstance(replay, int) or replay < 1):
        raise ValueError(f"prefix_replay: expected None (load the stored window state) or an int >= 1 "
                         f"(tokens to replay), got {replay!r}")


def _load(model, cache, tokens, kind: str, schedule: str = "exact", images=()) -> dict | None:
    """The checked entry of ``kind`` for ``tokens`` (and ``images``), or None (a miss; an unusable
    entry is dropped)."""
    key = entry_key(model, tokens, kind, schedule, images)
    hit = cache.get(key)
    if hit is None:
        return None
    try:
        if hit[1].get("tokens") != len(tokens) or hit[1].get("kind") != kind:
            raise LayoutError(f"meta: expected a {kind} entry of {len(tokens)} tokens, got {hit[1]}")
        return parse(hit[0], model.cfg, model.window_fmt, len(tokens), kind)
    except LayoutError as exc:
        cache.discard(key, str(exc))
        return None


def lookup(model, cache, tokens: list[int], schedule: str = "exact", images=()) -> tuple[int, dict | None]:
    """Longest cached aligned prefix of ``tokens`` (full entries of ``schedule``; ``images``:
    ``[(span start, ImageInput)]`` of the prompt): (length, its checked entry tensors), or (0, None)."""
    for length in range(aligned(len(tokens), model.cfg), 0, -ALIGN):
        entry = _load(model, cache, tokens[:length], FULL, schedule, images)
        if entry is not None:
            return length, entry
    return 0, None


def store(model, cache, state, row: int, tokens: list[int], logits: torch.Tensor, schedule: str = "exact",
          images=()) -> bool:
    """Store ``row`` of ``state``, which has run exactly ``tokens`` (an aligned count, with the
    ``images`` starting in them) and whose logits at its last position are ``logits``, unless
    already cached; True if written."""
    length = len(tokens)
    if length == 0 or length % ALIGN:
        raise ValueError(f"tokens: expected a positive multiple of {ALIGN} tokens, got {length}")
    key = entry_key(model, tokens, FULL, schedule, images)
    if cache.contains(key):
        return False
    meta = {"tokens": length, "kind": FULL, "schedule": schedule, "model": model_identity(model)[:16]}
    return cache.put(key, export_row(state, row, length, logits), meta) is not None


def store_global(model, cache, state, row: int, tokens: list[int]) -> int:
    """Store the global KV of ``row``'s aligned prefix of ``tokens`` (a session pause) unless
    cached; returns that prefix's length."""
    length = aligned(len(tokens), model.cfg)
    key = entry_key(model, tokens[:length], GLOBAL)
    if length and not cache.contains(key):
        cache.put(key, export_row(state, row, length), {"tokens": length, "kind": GLOBAL})
    return length


def load_global(model, cache, tokens: list[int]) -> dict | None:
    """The checked global entry of exactly ``tokens`` (see :func:`store_global`), or None."""
    return _load(model, cache, tokens, GLOBAL)


def restore(model, state, entries: list[dict], ids: torch.Tensor, length: int, replay: int | None = None,
            spans=None) -> torch.Tensor:
    """Load full entries (one per row, from :func:`lookup`) of ``length`` tokens into a fresh
    ``state``; returns the logits at position ``length - 1``. ``replay=None``: the stored window
    state and logits (exact). ``replay=N``: the global KV only, then the last ``N`` tokens before
    ``length`` of ``ids`` [B, >= length] are replayed through every layer (bounded replay;
    ``N >= length`` reproduces a full prefill). ``spans``: the rows' image spans over ``ids``
    (:class:`~flashrt.graphs.vision.ImageSpans`), read by a replay."""
    check_replay(replay)
    for row, entry in enumerate(entries):
        import_row(state, row, entry, length, window=replay is None)
    if replay is None:
        state.advance(length)
        return torch.stack([e["logits"] for e in entries]).to(model.device)
    return _replay(model, state, ids, length, max(0, length - replay), spans)


def _replay(model, state, ids: torch.Tensor, length: int, start: int, spans=None) -> torch.Tensor:
    cfg = model.cfg
    for ring_start in state.ring_start.values():
        ring_start.fill_(start)
    state.advance(start)
    tokens = ids[:, start:length].to(model.device)
    if model.hasher is not None and start:
        n_hist = state.engram_history.shape[1]
        history = model.hasher.token_map(ids[:, max(0, start - n_hist):start].to(model.device))
        if spans is not None:  # image tokens enter the history as no token
            history[spans.mask[:, max(0, start - n_hist):start]] = -1
        pad = torch.full((state.batch, n_hist - history.shape[1]), -1, dtype=torch.long, device=model.device)
        state.engram_history = torch.cat([pad, history], dim=1)
    part = None if spans is None else spans.chunk(start, length)
    token_mask, vl_mask = model._span_masks(tokens, None, part)
    ctx = model.context(tokens, state, token_mask, compress_done=frozenset(cfg.kv_source_layers), vl_mask=vl_mask)
    captured = {} if model.drafts is not None else None
    x, pre = model.run_layers(*model.embed_tokens(tokens, part), ctx, range(cfg.n_layers), capture=captured)
    if captured:
        model.drafts.seed(captured, ctx)
    state.advance(length - start, ctx.next_history)
    return model.logits(x, pre, all_positions=False)


def prefill(model, ids: torch.Tensor, state, cache=None, hit: int = 0, entries: list | None = None,
            schedule: str = "exact", chunk: int | None = None, replay: int | None = None, spans=None,
            images: list | None = None) -> torch.Tensor:
    """Prefill ``ids`` [B, n] (rows of one length) into the fresh ``state`` through the prefix
    ``cache``: load the rows' entries of ``hit`` tokens (from :func:`lookup`), prefill up to the
    longest aligned length and store the state there, then prefill the rest. Returns the logits
    of the last position. After a bounded replay (``replay``) nothing is stored: the state is an
    approximation. ``ced`` prefills store only prompts of an aligned length, from position 0.
    ``spans``: the rows' image spans over ``ids``; ``images``: per row ``[(span start,
    ImageInput)]`` (part of the stored keys)."""
    n, out, start = ids.shape[1], None, 0
    if hit:
        out, start = restore(model, state, entries, ids, hit, replay, spans), hit
    stop = 0
    if cache is not None and not (hit and replay is not None):
        stop = aligned(n, model.cfg)
        if schedule != "exact" and (hit or stop != n):
            stop = 0
    if stop > start:
        out = prefill_prompt(model, ids[:, start:stop], state, schedule, chunk, _part(spans, start, stop))
        for row in range(ids.shape[0]):
            store(model, cache, state, row, ids[row, :stop].tolist(), out[row], schedule,
                  images[row] if images else ())
        start = stop
    if n > start:
        out = prefill_prompt(model, ids[:, start:], state, schedule, chunk,
                             _part(spans, start, n))
    return out


def _part(spans, start: int, stop: int):
    """The image spans of positions ``start .. stop - 1`` (None without images)."""
    return None if spans is None else spans.chunk(start, stop)
