"""Engram block: n-gram hash lookups gated into the residual stream (docs/model.md, 5).

``kv = wkv(concat(engram_lookup(table, ids)))`` gives one key per hc copy and one shared value;
``engram_gate`` mixes the value into each copy by how well the key matches it. Positions where the
token mask is False (image tokens) pass through unchanged.

Placement (the profile's ``engram_placement``): ``device`` keeps the fp8 tables in device memory;
``host`` / ``host_pinned`` keep them in (pinned) host memory. Then :class:`EngramPrefetch`
gathers the rows a step needs on the host as soon as the hash ids are known (before any block
runs) and copies them to the device on a side stream, overlapped with the blocks before the
Engram layer; the layer waits for its copy and looks the rows up in that small staged table.
"""
from __future__ import annotations

import torch

from flashrt import ops
from flashrt.formats import QTensor

from .context import StepContext

PLACEMENTS = ("device", "host", "host_pinned")


class Engram:
    def __init__(self, cfg, layer: int, w: dict, prefix: str):
        p = prefix + "engram."
        self.cfg, self.slot = cfg, cfg.engram_layer_ids.index(layer)
        self.table = w[p + "embed.weight"]
        self.wkv = w[p + "wkv.weight"]
        self.weight = w[p + "q_weight"].to(torch.float32) * w[p + "k_weight"].to(torch.float32)

    def table_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``self.table`` for hashed ``ids`` (a tensor-parallel rank holds a slice of them)."""
        return ids

    def rows(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """bf16 [B, S, cols, head_dim]: from the staged rows when prefetched, else the table."""
        staged = ctx.engram_rows.get(self.slot)
        if staged is None and self.table.device == ids.device:
            return ops.engram_lookup(self.table, ids)
        if staged is None:  # host table, not prefetched for this call: gather now
            staged = (host_rows(self.table, ids.reshape(-1).cpu(), ids.device), None)
        table, event = staged
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        local = torch.arange(ids.numel(), device=ids.device).view(ids.shape)
        return ops.engram_lookup(table, local)

    def forward(self, x: torch.Tensor, ctx: StepContext, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        B, S, hc, D = x.shape
        ids = ctx.engram_ids[:, :, self.slot]  # [B, S, cols]
        rows = self.rows(ids, ctx).flatten(-2)  # [B, S, cols * head_dim] bf16
        kv = ops.linear(rows.to(x.dtype), self.wkv)
        key = kv[..., : hc * D].reshape(B, S, hc, D)
        value = kv[..., hc * D:]
        out = ops.engram_gate(x, key, value, self.weight, cfg.norm_eps)
        if token_mask is not None:
            out = torch.where(token_mask.view(B, S, 1, 1), out, x)
        return out


def place_tables(cfg, weights: dict, placement: str) -> None:
    """Move the Engram tables to host memory (pinned for ``host_pinned`` when CUDA is present)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"engram_placement: expected one of {list(PLACEMENTS)}, got {placement!r}")
    if placement == "device":
        return
    pin = placement == "host_pinned" and torch.cuda.is_available()
    for layer in cfg.engram_layer_ids:
        name = f"layers.{layer}.engram.embed.weight"
        t = weights[name].to("cpu")
        weights[name] = QTensor(t.data.pin_memory(), t.scale.pin_memory(), t.fmt, t.shape) if pin else t


def host_rows(table: QTensor, flat: torch.Tensor, device, pin: bool = False) -> QTensor:
    """Rows ``flat`` of a host-memory ``table`` as a ``[len(flat), head_dim]`` QTensor on ``device``
    (gathered on the host; ``pin``: through pinned memory, copied asynchronously)."""
    data, scale = table.data[flat], table.scale[flat]
    if pin:
        data, scale = data.pin_memory(), scale.pin_memory()
    return QTensor(data.to(device, non_blocking=pin), scale.to(device, non_blocking=pin), table.fmt,
                   (flat.numel(), table.shape[-1]))


class EngramPrefetch:
    """Host-side gather + asynchronous copy of the rows each Engram layer needs this step."""

    def __init__(self, engrams: list, device: torch.device):
        self.engrams, self.device = engrams, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, ctx: StepContext) -> None:
        ids = ctx.engram_ids.cpu()  # [B, S, L, cols]: known from the tokens before any block runs
        for e in self.engrams:
            flat = e.table_ids(ids[:, :, e.slot]).reshape(-1)
            if self.stream is None:
                ctx.engram_rows[e.slot] = (host_rows(e.table, flat, self.device), None)
                continue
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                staged = host_rows(e.table, flat, self.device, pin=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            ctx.engram_rows[e.slot] = (staged, event)
