"""``flashrt.load(path)``: a checkpoint directory -> a ready :class:`~flashrt.graphs.model.Model`."""
from __future__ import annotations

from pathlib import Path

from . import checkpoint
from .engram_hash import TokenMap
from .model import Model
from .tokenizer import attach_tokenizer

TOKEN_MAP_FILES = ("engram_token_map.json", "engram_token_map.npy")


def load(path, device=None, profile=None, verify: bool = False, progress=None, parallel=None) -> Model:
    """Load ``config.json`` + safetensors shards (memory-mapped) from ``path`` onto ``device``.

    The Engram compressed vocabulary comes from ``engram_token_map.json`` / ``.npy`` in the
    directory when present (``map[token_id] = compressed_id``), else the identity map.
    ``model.tokenizer``: the directory's ``tokenizer.json`` (:func:`~flashrt.graphs.tokenizer.attach_tokenizer`).
    ``verify`` checks every file against ``SHA256SUMS`` first. ``profile``: a hardware profile
    name, path or :class:`~flashrt.profiles.Profile` (default: the one selected for the device);
    it decides the Engram table placement and the KV page size. ``parallel``: a
    :class:`~flashrt.graphs.parallel.Parallel` context; only this rank's slices are read
    (:func:`~flashrt.graphs.shard_load.load_shard`).
    """
    prof = resolve_profile(profile, device)
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"path: expected a checkpoint directory with config.json, got {str(path)!r}")
    if parallel is None:
        cfg, weights = checkpoint.load(path, device=device, verify=verify, progress=progress)
    else:
        from .shard_load import load_shard

        cfg, weights, _ = load_shard(path, parallel.layout, device=device, verify=verify, progress=progress)
    token_map = None
    for name in TOKEN_MAP_FILES:
        if (path / name).exists():
            token_map = TokenMap.from_file(str(path / name), cfg)
            break
    window_fmt = "int8" if prof.kv_window_dtype == "int8" else "fp8"
    model = Model(cfg, weights, token_map=token_map, engram_placement=prof.engram_placement, window_fmt=window_fmt,
                  parallel=parallel)
    model.profile = prof
    attach_tokenizer(model, path)
    return model


def resolve_profile(profile, device):
    """The Profile for ``profile`` (name, path, Profile) or the one selected for ``device``."""
    from flashrt.profiles import Profile, load_profile, select_profile

    if isinstance(profile, Profile):
        return profile
    if profile is not None:
        return load_profile(profile)
    return select_profile(device)[0]
