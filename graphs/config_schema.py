"""The type and range of every ``config.json`` key (one :class:`Key` per ``ModelConfig`` field).

:func:`check_value` returns the value in its stored form (tuples for lists, floats for numbers)
or raises :class:`ConfigValueError` naming the key, what was expected and what was found, so a
``"dim": "64"``, ``"rope_theta": null``, ``"window_size": -8`` or ``"norm_topk_prob": "false"``
is an error naming the key rather than a traceback or a silently wrong model. Cross-key rules
(divisibility, layer roles) live in :func:`flashrt.graphs.config.validate`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

INT_MAX = 2**31 - 1  # sizes and ids index int32-addressed tensors and tables


class ConfigValueError(ValueError):
    """A config value of the wrong type or out of range; ``key`` is the ``ModelConfig`` field."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Key:
    kind: str  # int | float | bool | str | ints
    lo: float | None = None  # smallest allowed value (ints: of every element)
    above: bool = False  # lo itself is excluded (> lo)
    choices: tuple = ()  # str: the allowed values
    optional: bool = False  # null allowed

    def describe(self) -> str:
        if self.kind == "bool":
            what = "true or false"
        elif self.kind == "str":
            what = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            noun = {"int": "an int", "float": "a finite number", "ints": "a list of ints"}[self.kind]
            bound = "" if self.lo is None else f" {'>' if self.above else '>='} {self.lo:g}"
            hi = f" and <= {INT_MAX}" if self.kind in ("int", "ints") else ""
            what = noun + (f" each{bound}{hi}" if self.kind == "ints" else f"{bound}{hi}")
        return f"null or {what}" if self.optional else what


def _int(n=0):
    return Key("int", n)


def _pos(kind="float"):
    return Key(kind, 0, above=True)


VISION_KEYS = ("vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
               "vision_rope_theta", "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels",
               "vision_max_wh_ratio")

KEYS: dict[str, Key] = {
    "max_batch_size": _int(1), "max_seq_len": _int(1), "temperature": Key("float", 0),
    "dtype": Key("str", choices=("bf16", "fp8")), "expert_dtype": Key("str", choices=("fp4",), optional=True),
    "vocab_size": _int(1), "dim": _int(1), "moe_inter_dim": _int(1), "n_layers": _int(1), "n_mtp_layers": _int(0),
    "n_heads": _int(1), "n_routed_experts": _int(1), "n_shared_experts": _int(0), "n_activated_experts": _int(1),
    "score_func": Key("str", choices=("softmax", "sigmoid", "sqrtsoftplus")), "gate_temp": _pos(),
    "norm_topk_prob": Key("bool"), "route_scale": _pos(), "swiglu_limit": Key("float", 0),
    "q_lora_rank": _int(1), "head_dim": _int(1), "rope_head_dim": _int(0), "norm_eps": _pos(),
    "o_groups": _int(1), "o_lora_rank": _int(1), "window_size": _int(1),
    "compress_ratios": Key("ints", 0), "kv_source_layers": Key("ints", 0), "index_source_layers": Key("ints", 0),
    "compress_rope_theta": _pos(), "original_seq_len": _int(0), "rope_theta": _pos(), "rope_factor": _pos(),
    "beta_fast": _pos(), "beta_slow": _pos(),
    "index_n_heads": _int(1), "index_head_dim": _int(1), "index_topk": _int(1),
    "candidate_source_layer": _int(-1), "candidate_topk_blocks": _int(0), "candidate_block_size": _int(0),
    "hc_mult": _int(1), "hc_sinkhorn_iters": _int(1), "hc_eps": _pos(),
    "engram_layer_ids": Key("ints", 0), "engram_num_embeddings": Key("ints", 1), "engram_max_ngram_size": _int(1),
    "engram_vocab_size": _int(0), "engram_n_heads": _int(0), "engram_head_dim": _int(0), "engram_pad_id": _int(0),
    "engram_compressed_vocab_size": _int(0),
    "vision_n_layers": _int(0), "vision_dim": _int(0), "vision_n_heads": _int(0), "vision_inter_dim": _int(0),
    "vision_patch_size": _int(0), "vision_rope_theta": _pos(), "vision_downsample_ratio": _int(0),
    "vision_max_n_token": _int(0), "vision_min_pixels": _int(0), "vision_max_wh_ratio": Key("int", 1, optional=True),
    "image_token_id": _int(0),
    "dspark_block_size": _int(0), "dspark_noise_token_id": _int(0), "dspark_target_layer_ids": Key("ints", 0),
    "dspark_markov_rank": _int(1), "dspark_n_routed_experts": _int(0), "dspark_n_activated_experts": _int(0),
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _in_range(spec: Key, v) -> bool:
    if spec.kind in ("int", "ints") and v > INT_MAX:
        return False
    if spec.lo is None:
        return True
    return v > spec.lo if spec.above else v >= spec.lo


def _coerce(spec: Key, value):
    """The stored form of ``value`` or None when it does not fit ``spec`` (never raises)."""
    if spec.kind == "bool":
        return value if isinstance(value, bool) else None
    if spec.kind == "str":
        return value if isinstance(value, str) and value in spec.choices else None
    if spec.kind == "int":
        return value if _is_int(value) and _in_range(spec, value) else None
    if spec.kind == "float":
        if not (_is_int(value) or isinstance(value, float)):
            return None
        try:
            f = float(value)
        except OverflowError:  # an int beyond the float range
            return None
        return f if math.isfinite(f) and _in_range(spec, f) else None
    if isinstance(value, (list, tuple)) and all(_is_int(v) and _in_range(spec, v) for v in value):
        return tuple(value)
    return None


def check_value(key: str, value, label: str | None = None):
    """``value`` of config field ``key`` in its stored form; ``ConfigValueError`` naming ``label``
    (the key as written in the file, default ``key``) when the type or range is wrong."""
    spec = KEYS[key]
    if value is None and spec.optional:
        return None
    out = _coerce(spec, value)
    if out is None:
        raise ConfigValueError(key, f"config key {label or key!r}: expected {spec.describe()}, "
                                    f"got {value!r} ({type(value).__name__})")
    return out
