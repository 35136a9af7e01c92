"""Pause and resume a sequence: global KV to the persistent prefix cache, the rest to the window
pool; a session resumed within the pool's TTL continues exactly where it stopped (no replay).

Neither writes anything to disk but through the prefix cache (the window pool is host memory)."""
from __future__ import annotations

import torch

from flashrt.formats import MAIN_KV_FORMAT, QTensor

from . import prefix
from .prefix_entry import global_kv, import_row, load_window, window_state


def pause(model, state, row: int, tokens: list[int], cache, pool, session_id: str) -> None:
    """Snapshot ``row`` of ``state`` (which has run exactly ``tokens``)."""
    n = state.host_positions[row]
    if n != len(tokens):
        raise ValueError(f"tokens: expected the {n} tokens row {row} has run, got {len(tokens)}")
    length = prefix.store_global(model, cache, state, row, tokens)
    snap = {"position": n, "aligned": length}
    snap.update({f"tail.{k}": v for k, v in global_kv(state, row, length, n).items()})
    snap.update(window_state(state, row))
    pool.put(session_id, snap)


def resume(model, tokens: list[int], cache, pool, session_id: str, capacity: int):
    """A one-row state continuing ``session_id`` after ``tokens``, or None when the window pool or
    the prefix cache no longer has it (then prefill again)."""
    snap = pool.take(session_id)
    if snap is None or snap["position"] != len(tokens):
        return None
    length, n = snap["aligned"], snap["position"]
    entry = None
    if length:
        entry = prefix.load_global(model, cache, tokens[:length])
        if entry is None:
            return None
    state = model.new_state(1, max(capacity, n))
    if entry is not None:
        import_row(state, 0, entry, length, window=False)
    _restore_tail(model.cfg, state, snap, length, n)
    load_window(state, 0, snap)
    state.advance(n)
    return state


def _restore_tail(cfg, state, snap: dict, length: int, n: int) -> None:
    """The global KV of positions ``[length, n)`` (not in the aligned cache entry)."""
    u8 = torch.uint8
    for l, c in state.compressed.items():
        r = cfg.ratio(l)
        lo, hi = length // r, n // r
        if hi > lo:
            head = c.main.read_row(0, lo)
            data = torch.cat([head.data, snap[f"tail.{l}.main.data"]])
            scale = torch.cat([head.scale.view(u8), snap[f"tail.{l}.main.scale"]]).view(torch.float8_e4m3fn)
            c.main.write_row(0, QTensor(data, scale, MAIN_KV_FORMAT, (hi, cfg.head_dim)))
            c.index_k.write_row(0, lo, QTensor(snap[f"tail.{l}.index.data"], snap[f"tail.{l}.index.scale"].view(
                torch.float8_e8m0fnu), "fp4_b32", (hi - lo, cfg.index_head_dim)))
