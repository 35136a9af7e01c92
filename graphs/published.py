"""The published DeepSeek-V4.1-Flash directory, read as it is.

What the published files hold beyond the reference runtime's parameters (``params.py``):

- ``attn.wo_a.weight`` is stored FP8 E4M3 with a ``.scale`` (UE8M0 per 32x32 tile), while the
  reference model holds it in BF16 (its grouped einsum takes no FP8 weight; the official
  ``convert.py`` dequantizes it). A plain-kind weight stored that way is dequantized once at load
  (``w * scale`` in fp32, then BF16: exact, the scale is a power of two): :func:`fp8_plain`.
- The vision tower (``vision.*``, ``aligner.*``, ``image_start`` / ``image_end`` /
  ``image_newline`` and ``ffn.gate.bias_vl`` in every block) when ``vision_n_layers > 0``: the
  published layout loads text only, so these are accepted and not loaded (:func:`vision_tensors`).
  A checkpoint in flashrt's layout loads them (``tiny-vl``); one without them, whatever its
  layout, loads text only (:func:`text_only`).
- ``inference/config.json`` (the flat ``ModelArgs``) beside the root ``config.json``: the two must
  describe one model (:func:`check_inference_config`).
- The Engram compressed token map is not a file: the reference derives it from ``tokenizer.json``
  (:func:`token_map_from_tokenizer`).
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from flashrt.errors import CheckpointError

from .config_schema import ConfigValueError
from .hf_config import read_config
from .params import QUANTIZED, ParamSpec

log = logging.getLogger("flashrt.checkpoint")
INFERENCE_CONFIG = "inference/config.json"
TOKENIZER = "tokenizer.json"
VISION = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$|(layers|mtp)\.\d+\.ffn\.gate\.bias_vl$)")
VISION_WHY = ("the vision tower (vision.*, aligner.*, image_start/end/newline, ffn.gate.bias_vl): the published "
              "layout loads text only")


def vision_tensors(names, cfg) -> list[str]:
    """The vision tower's tensors among ``names`` (none unless ``cfg`` has a vision tower)."""
    return [n for n in names if VISION.match(n)] if cfg.vision_enabled else []


def is_published(path: Path) -> bool:
    """``path/config.json`` is the Hugging Face layout (``text_config`` / ``vision_config``)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return isinstance(raw, dict) and "text_config" in raw


def text_only(cfg, names, published: bool) -> bool:
    """Whether a checkpoint of ``cfg`` holding tensors ``names`` loads without its vision tower: the
    config has one and the checkpoint is in the published layout or holds none of its tensors."""
    return cfg.vision_enabled and (published or not any(VISION.match(n) for n in names))


def text_config(cfg):
    """``cfg`` without its vision tower: the parameters a text-only load reads."""
    return cfg.replace(vision_n_layers=0)


def fp8_scale_name(name: str) -> str:
    return name[: -len("weight")] + "scale"


def fp8_plain(specs: list[ParamSpec], dtypes: dict[str, str]) -> set[str]:
    """Plain-kind 2-D weights stored as F8_E4M3 with a sibling ``.scale`` (``dtypes``: stored
    name -> safetensors dtype), dequantized at load."""
    return {s.name for s in specs if s.kind not in QUANTIZED and len(s.shape) == 2 and s.name.endswith(".weight")
            and dtypes.get(s.name) == "F8_E4M3" and fp8_scale_name(s.name) in dtypes}


def log_ignored(names: list[str], nbytes: int) -> None:
    if names:
        log.warning("ignoring %d tensors (%.1f MiB) of %s", len(names), nbytes / 2**20, VISION_WHY)


def log_no_vision(cfg) -> None:
    log.warning("the checkpoint has none of the vision tower's tensors (vision_n_layers=%d in its config): "
                "loading text only", cfg.vision_n_layers)


def _read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{file}: not valid JSON: {exc}") from None


def check_inference_config(path: Path, cfg) -> None:
    """``inference/config.json``, when present, must agree with ``cfg`` on every key it has."""
    file = path / INFERENCE_CONFIG
    if not file.is_file():
        return
    try:
        args, labels, _ = read_config(_read_json(file), str(file))
    except ConfigValueError as exc:
        raise CheckpointError(str(exc)) from None
    for field, value in args.items():
        if getattr(cfg, field) != value:
            raise CheckpointError(f"{file}: {labels[field]!r} is {value!r} but config.json gives "
                                  f"{getattr(cfg, field)!r}; the two files must describe one model")


def needs_token_map(cfg) -> bool:
    """Whether the Engram layers need a compressed-id map (the identity covers too few ids)."""
    return bool(cfg.engram_layer_ids) and cfg.engram_compressed_vocab_size < cfg.vocab_size


def token_map_from_tokenizer(file: Path, cfg):
    """The reference's compressed token map, derived from ``tokenizer.json``: each id's decoded
    text (special tokens kept) normalized by :meth:`TokenMap.from_tokens`."""
    from .engram_hash import TokenMap

    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CheckpointError(f"{file}: deriving the Engram token map needs the 'tokenizers' package "
                              f"(pip install tokenizers), or an engram_token_map.json beside config.json") from None
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exceptions for a bad file
        raise CheckpointError(f"{file}: not a tokenizer file ({exc})") from None
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > cfg.vocab_size:
        raise CheckpointError(f"{file}: {n} tokens, more than vocab_size={cfg.vocab_size}")
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(n)]
    token_map = TokenMap.from_tokens(texts, raw=[tok.id_to_token(i) or "" for i in range(n)])
    if token_map.compressed_vocab_size != cfg.engram_compressed_vocab_size:
        raise CheckpointError(f"{file}: derives {token_map.compressed_vocab_size} compressed ids, config.json has "
                              f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}")
    return token_map
