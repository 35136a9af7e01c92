"""``flashrt.load(path)``: a checkpoint directory -> a ready :class:`~flashrt.graphs.model.Model`.

``path`` is a directory written by ``model.save`` or the published DeepSeek-V4.1-Flash folder as
downloaded (root Hugging Face ``config.json``, ``inference/config.json``, the index and shards;
see ``docs/checkpoints.md``).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from flashrt import profiles
from flashrt.errors import CheckpointError

from . import checkpoint, published
from .devices import resolve_device
from .engram_hash import TokenMap
from .model import Model
from .tokenizer import attach_tokenizer

TOKEN_MAP_FILES = ("engram_token_map.json", "engram_token_map.npy")


def load(path, device=None, profile=None, verify: bool = False, progress=None, *, check_finite: bool | None = None,
         threads: int | None = None, verify_files=(), parallel=None) -> Model:
    """Load ``config.json`` + safetensors shards (memory-mapped) from ``path`` onto ``device``.

    ``device``: ``cpu`` (default), ``cuda[:N]``, ``npu[:N]`` or ``meta``; one this machine lacks is
    a :class:`~flashrt.errors.DeviceError` naming the devices it has. ``verify`` checks every file
    that decides the output against ``SHA256SUMS`` first (``verify_files``: more such names, e.g.
    chat-format files). ``check_finite`` (default on; ``False`` skips it) rejects a weight holding
    NaN or Inf, naming it; it costs one pass over the weights. ``threads``: CPU threads for torch (process-wide,
    ``torch.set_num_threads``); None leaves torch's setting (``flashrt run`` uses 1 for ``tiny``).
    The Engram compressed vocabulary comes from ``engram_token_map.json`` / ``.npy`` in the
    directory (``map[token_id] = compressed_id``), else is derived from ``tokenizer.json`` as the
    reference does when the identity map cannot cover the vocabulary, else is the identity.
    ``profile``: a hardware profile name, path or :class:`~flashrt.profiles.Profile` (default: the
    one selected for the device); it decides the Engram table placement, the KV page size and, where
    given, the weights' layout (the experts' scale order and fp4 code layout; without it, the active
    profile's, as for a Model built directly).
    ``parallel``: a :class:`~flashrt.graphs.parallel.Parallel` context; only this rank's slices are
    read (:func:`~flashrt.graphs.shard_load.load_shard`).
    """
    dev = resolve_device(device)
    set_threads(threads)
    prof = resolve_profile(profile, dev)
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"path: expected a checkpoint directory with config.json, got {str(path)!r}")
    if parallel is None:
        cfg, weights = checkpoint.load(path, device=dev, verify=verify, progress=progress, check_finite=check_finite,
                                       verify_files=verify_files)
    else:
        from .shard_load import load_shard

        cfg, weights, _ = load_shard(path, parallel.layout, device=dev, verify=verify, progress=progress,
                                     check_finite=check_finite)
    window_fmt = "int8" if prof.kv_window_dtype == "int8" else "fp8"
    # a profile given here lays the weights out too (expert scales, fp4 words), whatever profile is active
    with profiles.using(prof) if profile is not None else contextlib.nullcontext():
        model = Model(cfg, weights, token_map=token_map_for(path, cfg), engram_placement=prof.engram_placement,
                      window_fmt=window_fmt, parallel=parallel)
    model.profile = prof
    attach_tokenizer(model, path)
    return model


def token_map_for(path: Path, cfg) -> TokenMap | None:
    """The Engram token map of checkpoint ``path`` (None: the identity)."""
    try:
        for name in TOKEN_MAP_FILES:
            if (path / name).exists():
                return TokenMap.from_file(str(path / name), cfg)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / name}: {exc}") from None
    if not published.needs_token_map(cfg):
        return None
    if (path / published.TOKENIZER).is_file():
        return published.token_map_from_tokenizer(path / published.TOKENIZER, cfg)
    raise CheckpointError(f"{path}: engram_compressed_vocab_size={cfg.engram_compressed_vocab_size} is below "
                          f"vocab_size={cfg.vocab_size}, so the Engram layers need the compressed token map: "
                          f"put {TOKEN_MAP_FILES[0]} or the model's {published.TOKENIZER} in the directory")


def set_threads(threads) -> None:
    """``torch.set_num_threads(threads)`` for a positive int; None leaves torch's setting."""
    if threads is None:
        return
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads: expected a positive int or None, got {threads!r}")
    torch.set_num_threads(threads)


def resolve_profile(profile, device):
    """The Profile for ``profile`` (name, path, Profile) or the one selected for ``device``."""
    from flashrt.profiles import Profile, load_profile, select_profile

    if isinstance(profile, Profile):
        return profile
    if profile is not None:
        return load_profile(profile)
    return select_profile(device)[0]
