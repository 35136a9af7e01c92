"""``flashrt.load(path)``: a checkpoint directory -> a ready :class:`~flashrt.graphs.model.Model`."""
from __future__ import annotations

from pathlib import Path

from . import checkpoint
from .engram_hash import TokenMap
from .model import Model

TOKEN_MAP_FILES = ("engram_token_map.json", "engram_token_map.npy")


def load(path, device=None, profile=None, verify: bool = False, progress=None) -> Model:
    """Load ``config.json`` + safetensors shards (memory-mapped) from ``path`` onto ``device``.

    The Engram compressed vocabulary comes from ``engram_token_map.json`` / ``.npy`` in the
    directory when present (``map[token_id] = compressed_id``), else the identity map.
    ``verify`` checks every file against ``SHA256SUMS`` first. ``profile`` must be None until
    hardware profiles land (the device's defaults are used).
    """
    if profile is not None:
        raise ValueError(f"profile: hardware profiles are not available yet; pass None, got {profile!r}")
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"path: expected a checkpoint directory with config.json, got {str(path)!r}")
    cfg, weights = checkpoint.load(path, device=device, verify=verify, progress=progress)
    token_map = None
    for name in TOKEN_MAP_FILES:
        if (path / name).exists():
            token_map = TokenMap.from_file(str(path / name), cfg)
            break
    return Model(cfg, weights, token_map=token_map)
