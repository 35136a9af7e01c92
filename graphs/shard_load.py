"""Sharded loading: each rank reads only its own slices of a checkpoint (docs/parallel.md).

The safetensors shards are memory-mapped (``safe_open``) and every parameter is read through
``get_slice`` with the index of this rank's cut (:func:`flashrt.graphs.shard.stored_index`), so
only those bytes are touched; a parameter the rank holds whole is read whole (``get_tensor``,
which also serves the packed FP4 dtype that safetensors cannot slice); experts of other ranks
are never read. The published layout reads as :func:`flashrt.graphs.checkpoint.load` reads it
(``wo_a`` stored FP8 with 32x32-tile scales: cut on whole tiles, dequantized; the vision tower's
tensors accepted and not loaded). A rank's host memory holds
at most its own weights plus the tensor being moved to the device.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from flashrt.errors import CheckpointError

from . import checkpoint, published
from .finite import FiniteCheck, checks_enabled
from .parallel import Layout
from .shard import local_specs, nbytes, stored_index


def load_shard(path, layout: Layout, device=None, verify: bool = False, progress=None,
               check_finite: bool | None = None) -> tuple:
    """``(cfg, weights, bytes_read)``: the parameters ``layout``'s rank holds, as
    :func:`flashrt.graphs.checkpoint.load` makes them (checked the same way: names, shapes, and
    NaN / Inf in this rank's slices unless ``check_finite`` is False), on ``device``.
    ``progress(done, total)`` counts this rank's parameters."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if verify:
        checkpoint.verify_checksums(path)
    cfg = checkpoint.read_config(path)
    layout.check(cfg)
    weights, read = {}, 0
    finite = FiniteCheck() if checks_enabled(check_finite) else None
    with contextlib.ExitStack() as stack:
        where = checkpoint.open_shards(path, stack)
        headers = {k: h.get_slice(k) for k, h in where.items()}
        text_only = published.text_only(cfg, headers, published.is_published(path))
        model_cfg = published.text_config(cfg) if text_only else cfg  # the published vision tower is not loaded
        skip = set(published.vision_tensors(headers, cfg)) if text_only else set()
        whole = [full for full, _, _ in local_specs(model_cfg, Layout())]
        fp8 = published.fp8_plain(whole, {k: v.get_dtype() for k, v in headers.items()})
        checkpoint.check_names(whole, {k: f"{v.get_dtype()} {v.get_shape()}" for k, v in headers.items()
                                       if k not in skip}, fp8)  # the whole model's names
        mine = local_specs(model_cfg, layout)
        for i, (full, local, cut) in enumerate(mine):
            stored = dataclasses.replace(full, kind="fp8_w") if full.name in fp8 else full  # published FP8 wo_a
            scale_name = published.fp8_scale_name(full.name) if full.name in fp8 else full.scale_name
            data_index, scale_index = stored_index(stored, cut)
            data = _read(where[full.name], full.name, cut, data_index)
            scale = _read(where[scale_name], scale_name, cut, scale_index) if scale_name else None
            value = checkpoint.decode(local, data, scale)
            read += nbytes(data) + (nbytes(scale) if scale is not None else 0)
            weights[full.name] = value if device is None else value.to(device)
            if finite is not None:
                finite.add(full.name, weights[full.name])
            if progress is not None:
                progress(i + 1, len(mine))
        if finite is not None:
            finite.finish()
    return cfg, weights, read


def _read(handle, name: str, cut, index):
    """One stored tensor: this rank's slice of it, or all of it when the rank holds it whole."""
    if cut is None:
        return handle.get_tensor(name)
    part = handle.get_slice(name)
    if part.get_dtype() == "F4":
        raise CheckpointError(f"tensor {name!r}: packed F4 data cannot be sliced by safetensors; "
                              f"store it as I8 or U8 to load it sharded")
    return part[index]
