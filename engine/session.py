"""Pause and resume a sequence: global KV to the persistent prefix cache, the rest to the window
pool; a session resumed within the pool's TTL continues exactly where it stopped (no replay)."""
from __future__ import annotations

import torch

from flashrt.formats import QTensor

from . import prefix


def pause(model, state, row: int, tokens: list[int], cache, pool, session_id: str) -> None:
    """Snapshot ``row`` of ``state`` (which has run exactly ``tokens``)."""
    n = state.host_positions[row]
    if n != len(tokens):
        raise ValueError(f"tokens: expected the {n} tokens row {row} has run, got {len(tokens)}")
    cfg, u8 = model.cfg, torch.uint8
    length = prefix.aligned(n, cfg)
    if length:
        prefix.store(model, cache, state, row, tokens)
    snap = {"position": n, "aligned": length, "history": state.engram_history[row]}
    for l in state.rings:
        ring = state.rings[l]
        snap[f"ring.{l}.data"], snap[f"ring.{l}.scale"] = ring.data[row].view(u8), ring.scale[row].view(u8)
        snap[f"ring.{l}.start"] = state.ring_start[l][row]
    for l, c in state.compressed.items():
        r = cfg.ratio(l)
        lo, hi = length // r, n // r
        main = c.main.read_row(row, hi)
        snap[f"tail.{l}.main.data"], snap[f"tail.{l}.main.scale"] = main.data[lo:], main.scale.view(u8)[lo:]
        index = c.index_k.read_row(row, lo, hi)
        snap[f"tail.{l}.index.data"], snap[f"tail.{l}.index.scale"] = index.data, index.scale.view(u8)
        if c.kv_state is not None:
            snap[f"partial.{l}.kv"], snap[f"partial.{l}.score"] = c.kv_state[row], c.score_state[row]
    pool.put(session_id, snap)


def resume(model, tokens: list[int], cache, pool, session_id: str, capacity: int):
    """A one-row state continuing ``session_id`` after ``tokens``, or None when the window pool or
    the prefix cache no longer has it (then prefill again)."""
    snap = pool.take(session_id)
    if snap is None or snap["position"] != len(tokens):
        return None
    length, n = snap["aligned"], snap["position"]
    payload = None
    if length:
        hit = cache.get(prefix.prefix_key(prefix.model_identity(model), tokens[:length]))
        if hit is None:
            return None
        payload = hit[0]
    state = model.new_state(1, max(capacity, n))
    if payload is not None:
        prefix.import_row(state, 0, payload, length)
    _restore_rest(model.cfg, state, snap, length, n)
    return state


def _restore_rest(cfg, state, snap: dict, length: int, n: int) -> None:
    dev, u8 = state.device, torch.uint8
    for l, c in state.compressed.items():
        r = cfg.ratio(l)
        lo, hi = length // r, n // r
        if hi > lo:
            head = c.main.read_row(0, lo)
            data = torch.cat([head.data, snap[f"tail.{l}.main.data"]])
            scale = torch.cat([head.scale.view(u8), snap[f"tail.{l}.main.scale"]]).view(torch.float8_e4m3fn)
            c.main.write_row(0, QTensor(data, scale, "fp4_b16", (hi, cfg.head_dim)))
            c.index_k.write_row(0, lo, QTensor(snap[f"tail.{l}.index.data"], snap[f"tail.{l}.index.scale"].view(
                torch.float8_e8m0fnu), "fp4_b32", (hi - lo, cfg.index_head_dim)))
        if c.kv_state is not None:
            c.kv_state[0], c.score_state[0] = snap[f"partial.{l}.kv"].to(dev), snap[f"partial.{l}.score"].to(dev)
    for l in state.rings:
        state.rings[l].data.view(u8)[0] = snap[f"ring.{l}.data"].to(dev)
        state.rings[l].scale.view(u8)[0] = snap[f"ring.{l}.scale"].to(dev)
        state.ring_start[l][0] = snap[f"ring.{l}.start"].to(dev)
    state.engram_history[0] = snap["history"].to(dev)
    state.positions.fill_(n)
    state.host_positions = [n]

