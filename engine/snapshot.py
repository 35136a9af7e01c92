"""Exact snapshots of one sequence's KV state on the host, and the serving engine's prefix store.

A :class:`RowSnapshot` holds everything a row of a :class:`~flashrt.kv.state.KVState` carries at
its position: window rings (and their start), compressor partial groups, Engram history, and the
main-KV and index-K entries of every source layer. Restoring it into an empty row reproduces the
row bit for bit, so a sequence continued from a snapshot computes exactly what it would have
computed without one. The engine uses snapshots to swap out preempted sequences, to fork the
``n`` sequences of a request after one prefill, and as prefix-cache entries (:class:`PrefixStore`:
one snapshot per prefill-chunk boundary of a prompt, keyed by a hash chain over the chunks; an
optional on-disk :class:`~flashrt.kv.prefix_cache.PrefixCache` keeps them across restarts).
Unlike :mod:`flashrt.engine.prefix` (global KV only, window rebuilt by bounded replay), nothing is
approximated.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from flashrt.formats import MAIN_KV_FORMAT, QTensor, spec
from flashrt.kv.util import to_device

U8 = torch.uint8


@dataclass
class RowSnapshot:
    position: int
    host: dict  # name -> CPU tensor (quantized data as uint8 bytes); filled once ``ready`` completed
    ready: object = None  # the CUDA event after the copy into ``pinned`` (None: filled already)
    pinned: object = None  # (page-locked packed buffer, layout) the tensors are views of, until settled

    @property
    def tensors(self) -> dict:
        """The host tensors, once the copy that fills them is done."""
        self.settle(wait=True)
        return self.host

    def settle(self, wait: bool = False) -> bool:
        """Once the copy is done (waited for when ``wait``), move the tensors out of page-locked
        memory into ordinary host memory (one copy of the packed buffer), so that a snapshot kept
        for long holds no page-locked memory. True when settled."""
        if self.ready is not None:
            if not wait and not self.ready.query():
                return False
            self.ready.synchronize()
            self.ready = None
        if self.pinned is not None:
            buf, layout = self.pinned
            self.host = {**self.host, **_views(torch.empty(buf.numel(), dtype=U8).copy_(buf), layout)}
            self.pinned = None
        return True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def to_bytes(self) -> bytes:
        return st_save(self.tensors, metadata={"position": str(self.position)})

    @classmethod
    def from_bytes(cls, payload: bytes, position: int) -> "RowSnapshot":
        return cls(position, st_load(payload))


def snapshot_row(state, row: int) -> RowSnapshot:
    """Everything ``row`` of ``state`` holds, copied to the host: the device parts packed into one
    buffer and copied in one transfer that the host does not wait for (:func:`_to_host`)."""
    n, cfg, t, host = state.host_positions[row], state.cfg, {}, {}
    for l, q in state.rings.items():
        t[f"ring.{l}.data"] = q.data.view(U8)[row]
        t[f"ring.{l}.scale"] = q.scale.view(U8)[row]
        t[f"ring.{l}.start"] = state.ring_start[l][row]
    t["history"] = state.engram_history[row]
    for l, c in state.compressed.items():
        e = n // cfg.ratio(l)
        data, scale = _main_entries(c.main, row, e)
        main = t if data.device.type == state.device.type else host  # pages in host memory were gathered there
        main[f"{l}.main.data"], main[f"{l}.main.scale"] = data, scale
        t[f"{l}.index.data"], t[f"{l}.index.scale"] = c.index_k.gather_row(row, 0, e)
        if c.kv_state is not None:
            t[f"{l}.kv"], t[f"{l}.score"] = c.kv_state[row], c.score_state[row]
    snap = _to_host(t, state.device)
    snap.position, snap.host = n, {**snap.host, **host}
    return snap


def _to_host(tensors: dict, device: torch.device) -> RowSnapshot:
    """A snapshot whose host tensors are copies of ``tensors`` (on ``device``): packed into one
    device buffer (each part at an 8-byte aligned offset, so that its dtype view is aligned), then
    on a GPU copied to page-locked host memory without waiting (the snapshot's ``ready`` event
    marks the copy done); on the CPU the packing is the copy."""
    layout, total = _layout(tensors)
    buf = torch.empty(total, dtype=U8, device=device)
    parts = []  # every part's bytes, then its padding to the next 8-byte offset: one cat, one launch
    for name, x in tensors.items():
        nb = layout[name][1]
        if nb:
            parts.append(x.reshape(-1).view(U8))
        if nb % 8:
            parts.append(buf.new_empty(8 - nb % 8))
    if parts:
        torch.cat(parts, out=buf)
    if device.type != "cuda":
        return RowSnapshot(0, _views(buf, layout))
    pinned = torch.empty(total, dtype=U8, pin_memory=True)
    pinned.copy_(buf, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return RowSnapshot(0, _views(pinned, layout), ready, (pinned, layout))


def _layout(tensors: dict) -> tuple[dict, int]:
    """name -> (byte offset, bytes, dtype, shape) of each tensor packed in order at 8-byte aligned
    offsets, and the buffer's size."""
    layout, total = {}, 0
    for name, x in tensors.items():
        nb = x.numel() * x.element_size()
        layout[name] = (total, nb, x.dtype, tuple(x.shape))
        total += -(-nb // 8) * 8
    return layout, total


def _views(buf: torch.Tensor, layout: dict) -> dict:
    """name -> the tensor stored at its (offset, bytes, dtype, shape) in the uint8 buffer ``buf``."""
    return {name: buf[off:off + nb].view(dtype).view(shape) for name, (off, nb, dtype, shape) in layout.items()}


def _main_entries(main, row: int, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Main-KV entries ``[0, entries)`` of ``row`` as uint8 (data, scale): one gather per tier (not
    a copy per page); on the device when every page is there, else on the host."""
    pool, P = main.pool, main.pool.P
    pages = main.tables[row].pages[:-(-entries // P)]
    if all(tier == "dev" for tier, _ in pages):
        ids = to_device([p for _, p in pages], pool.dev.data.device)
        data = pool.dev.data.view(U8).index_select(0, ids).reshape(-1, pool.D // 2)[:entries]
        return data, pool.dev.scale.view(U8).index_select(0, ids).reshape(-1, pool.D // 16)[:entries]
    data = torch.empty((len(pages), P, pool.D // 2), dtype=U8)
    scale = torch.empty((len(pages), P, pool.D // 16), dtype=U8)
    for tier, src in (("dev", pool.dev), ("host", pool.host)):
        at = [j for j, (t, _) in enumerate(pages) if t == tier]
        if at:
            ids = torch.tensor([pages[j][1] for j in at], device=src.data.device)
            data[at] = src.data.view(U8).index_select(0, ids).cpu()
            scale[at] = src.scale.view(U8).index_select(0, ids).cpu()
    return data.reshape(-1, pool.D // 2)[:entries].clone(), scale.reshape(-1, pool.D // 16)[:entries].clone()


def _q(t: dict, name: str, fmt: str, dim: int) -> QTensor:
    s = spec(fmt)
    data, scale = t[f"{name}.data"], t[f"{name}.scale"]
    return QTensor(data.view(s.data_dtype), scale.view(s.scale_dtype), fmt, (data.shape[0], dim))


def restore_row(snap: RowSnapshot, state, row: int) -> None:
    """Load ``snap`` into ``row`` of ``state`` (a row holding no pages, e.g. of a fresh state)."""
    t, cfg, dev = snap.tensors, state.cfg, state.device
    for l, q in state.rings.items():
        q.data.view(U8)[row].copy_(t[f"ring.{l}.data"])
        q.scale.view(U8)[row].copy_(t[f"ring.{l}.scale"])
        state.ring_start[l][row] = t[f"ring.{l}.start"].to(dev)
    state.engram_history[row] = t["history"].to(dev)
    state.ensure_capacity(snap.position)
    for l, c in state.compressed.items():
        main = _q(t, f"{l}.main", MAIN_KV_FORMAT, cfg.head_dim)
        if main.shape[0]:
            c.main.write_row(row, main)
            c.index_k.write_row(row, 0, _q(t, f"{l}.index", "fp4_b32", cfg.index_head_dim))
        if c.kv_state is not None:
            c.kv_state[row], c.score_state[row] = t[f"{l}.kv"].to(dev), t[f"{l}.score"].to(dev)
    state.positions[row] = snap.position
    state.host_positions[row] = snap.position


def chunk_keys(tokens: list[int], block: int, salt: bytes = b"", images=()) -> list[bytes]:
    """``keys[i]``: the hash chain over the first ``(i + 1) * block`` tokens (full blocks only).
    ``images``: ``[(span start, digest)]``; a block also hashes the digests of the images whose
    spans start in it (every token of a span is the image token: only the digest tells two images
    of one size apart)."""
    keys, h = [], hashlib.sha256(salt).digest()
    for b0 in range(0, len(tokens) - block + 1, block):
        data = torch.tensor(tokens[b0:b0 + block], dtype=torch.int64).numpy().tobytes()
        data += "".join(d for start, d in images if b0 <= start < b0 + block).encode()
        h = hashlib.sha256(h + data).digest()
        keys.append(h)
    return keys


class PrefixStore:
    """Snapshots at prefill-chunk boundaries, least recently used evicted beyond ``max_bytes``;
    ``disk``: a :class:`~flashrt.kv.prefix_cache.PrefixCache` written through and read on a miss.
    ``salt`` identifies the model (entries of another model never match)."""

    def __init__(self, block: int, max_bytes: int, salt: bytes = b"", disk=None):
        self.block, self.max_bytes, self.salt, self.disk = block, max_bytes, salt, disk
        self.entries: OrderedDict[bytes, RowSnapshot] = OrderedDict()
        self.unsettled: list[RowSnapshot] = []  # kept while their copies may still be in flight
        self.bytes = 0
        self.queries = self.hits = self.query_tokens = self.hit_tokens = 0

    def lookup(self, tokens: list[int], images=()) -> tuple[int, RowSnapshot | None]:
        """The longest stored prefix of ``tokens`` (with ``images``, see :func:`chunk_keys`)
        shorter than all of them: (length, snapshot)."""
        keys = chunk_keys(tokens, self.block, self.salt, images)
        self.queries += 1
        self.query_tokens += len(tokens)
        for i in range(len(keys) - 1, -1, -1):
            length = (i + 1) * self.block
            if length >= len(tokens):
                continue
            snap = self._get(keys[i], length)
            if snap is not None:
                self.hits += 1
                self.hit_tokens += length
                return length, snap
        return 0, None

    def _get(self, key: bytes, length: int) -> RowSnapshot | None:
        snap = self.entries.get(key)
        if snap is not None:
            self.entries.move_to_end(key)
            return snap
        if self.disk is not None:
            hit = self.disk.get(key.hex())
            if hit is not None:
                snap = RowSnapshot.from_bytes(hit[0], length)
                self._keep(key, snap)
        return snap

    def wants(self, tokens: list[int], length: int, images=()) -> bytes | None:
        """The key to store a snapshot of ``tokens[:length]`` (with ``images``) under, or None
        (not a boundary, or already stored)."""
        if length % self.block or length == 0 or self.max_bytes <= 0:
            return None
        key = chunk_keys(tokens[:length], self.block, self.salt, images)[-1]
        return None if key in self.entries else key

    def put(self, key: bytes, snap: RowSnapshot) -> None:
        self.unsettled = [s for s in self.unsettled if not s.settle()] + [snap]  # settle those whose copy is done
        self._keep(key, snap)
        if self.disk is not None and not self.disk.contains(key.hex()):
            self.disk.put(key.hex(), snap.to_bytes(), {"tokens": snap.position})

    def _keep(self, key: bytes, snap: RowSnapshot) -> None:
        if snap.nbytes > self.max_bytes:
            return
        self.entries[key] = snap
        self.bytes += snap.nbytes
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the store / prompt tokens looked up."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
