"""Safetensors shards of a checkpoint directory: the index, the files, the tensor headers.

``model.safetensors.index.json`` (Hugging Face: ``weight_map`` tensor -> shard file) or a single
``model.safetensors``. A file name in the index must be a relative path inside the checkpoint
directory: absolute paths and ``..`` are rejected before anything is opened (:func:`inside`).
"""
from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path, PurePosixPath

from safetensors import SafetensorError, safe_open

from flashrt.errors import CheckpointError

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
# bytes per element of the safetensors dtypes a checkpoint may hold (F4: two codes per byte)
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5}


def inside(root: Path, name, what: str, follow_links: bool = False) -> Path:
    """``root / name`` for a relative ``name`` that stays inside ``root``; ``CheckpointError`` naming
    ``what`` otherwise. ``follow_links``: also reject a path whose symlinks lead out of ``root``."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{what}: expected a file name, got {name!r}")
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or Path(name).is_absolute() or ":" in pure.parts[0]:
        raise CheckpointError(f"{what}: {name!r} points outside the checkpoint directory {root}")
    path = root / pure
    if follow_links and path.exists():
        real, top = path.resolve(), root.resolve()
        if real != top and top not in real.parents:
            raise CheckpointError(f"{what}: {name!r} is a link to {real}, outside the checkpoint directory {root}")
    return path


def read_index(path: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file), every file checked by :func:`inside`."""
    try:
        data = json.loads((path / INDEX).read_text())
        weight_map = data["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"{path / INDEX}: not a safetensors index ({exc!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise CheckpointError(f"{path / INDEX}: 'weight_map' must map tensor names to file names")
    for fname in set(weight_map.values()):
        inside(path, fname, f"{path / INDEX} shard")
    return weight_map


def shard_files(path: Path) -> tuple[list[str], dict | None]:
    """The shard file names and the index's weight map (None for a single ``model.safetensors``)."""
    if (path / INDEX).is_file():
        weight_map = read_index(path)
        return sorted(set(weight_map.values())), weight_map
    if (path / SINGLE).is_file():
        return [SINGLE], None
    raise CheckpointError(f"{path}: no {SINGLE} or {INDEX}")


def open_shards(path: Path, stack: contextlib.ExitStack) -> dict:
    """Tensor name -> open (memory-mapped) ``safe_open`` handle holding it."""
    files, weight_map = shard_files(path)
    where = {}
    for fname in files:
        try:
            handle = stack.enter_context(safe_open(str(path / fname), framework="pt"))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path / fname}: missing or not a safetensors file ({exc})") from None
        for key in handle.keys():
            if key in where or (weight_map is not None and weight_map.get(key) != fname):
                raise CheckpointError(f"tensor {key!r}: found in {fname}, expected in "
                                      f"{weight_map.get(key) if weight_map else SINGLE} only")
            where[key] = handle
    for key in set(weight_map or ()) - set(where):
        raise CheckpointError(f"tensor {key!r}: listed in {INDEX} under {weight_map[key]}, not found there")
    return where


def read_header(file: Path) -> dict[str, tuple[str, list[int], int]]:
    """Tensor name -> (safetensors dtype, shape, stored bytes) from a shard's header alone."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
        out = {}
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                out[name] = (entry["dtype"], list(entry["shape"]), int(end) - int(start))
        return out
    except (OSError, struct.error, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{file}: missing or not a safetensors file ({exc})") from None
