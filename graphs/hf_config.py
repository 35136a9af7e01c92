"""Config keys as published: the Hugging Face root ``config.json`` of DeepSeek-V4.1-Flash.

The published root config nests the language model under ``text_config`` with Hugging Face key
names (``hidden_size``, ``num_hidden_layers``, ``kv_source_layer_ids``, ``rope_scaling``, ...),
keeps the weight quantization (``quantization_config``) and the vision tower (``vision_config``)
beside it, and adds identity and token keys (``architectures``, ``model_type``,
``bos/eos/pad_token_id``). :func:`read_config` maps every one of them onto the reference
``ModelArgs`` field it stands for (the same fields ``inference/config.json`` uses, which are read
as they are), checks each value's type and range (:mod:`.config_schema`), and checks the keys that
describe an architecture flashrt does not implement against the one it does (``hidden_act``
``silu``, one KV head, ``topk_method`` ``noaux_tc``, ...). Any other key is an error naming it.
Keys that do not change the computation (``architectures``, token ids, ``initializer_range``, ...)
are type-checked and returned in ``meta``. A field given twice (``dim`` and ``hidden_size``, or
at the root and in ``text_config``) must have one value.
"""
from __future__ import annotations

import dataclasses
import math

from .config_schema import INT_MAX, KEYS, VISION_KEYS, ConfigValueError, check_value

TEXT_ALIASES = {
    "hidden_size": "dim", "moe_intermediate_size": "moe_inter_dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "qk_rope_head_dim": "rope_head_dim", "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size", "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers", "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id", "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts", "max_position_embeddings": "max_seq_len",
}
VISION_ALIASES = {
    "num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim", "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim", "patch_size": "vision_patch_size", "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio", "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels", "max_wh_ratio": "vision_max_wh_ratio",
}
ROPE_ALIASES = {"factor": "rope_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
                "original_max_position_embeddings": "original_seq_len"}
# keys describing the architecture: flashrt implements exactly these values
FIXED = {"hidden_act": "silu", "num_key_value_heads": 1, "attention_bias": False, "tie_word_embeddings": False,
         "topk_method": "noaux_tc"}
QUANT_FIXED = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
               "weight_block_size": [32, 32]}
TORCH_DTYPES = ("bfloat16", "float16", "float32")
RUNTIME_ONLY = ("max_batch_size", "temperature", "gate_temp")  # ModelArgs fields with no published key


def _number(v) -> bool:
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    except OverflowError:
        return False


def _token_id(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT_MAX)


META = {  # key -> (check, what is expected); the value does not change the computation
    "model_type": (lambda v: isinstance(v, str), "a string"),
    "architectures": (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "a list of strings"),
    "transformers_version": (lambda v: isinstance(v, str), "a string"),
    "auto_map": (lambda v: isinstance(v, dict), "an object"),
    "torch_dtype": (lambda v: v in TORCH_DTYPES, "one of " + ", ".join(TORCH_DTYPES)),
    "attention_dropout": (_number, "a finite number >= 0"),
    "initializer_range": (_number, "a finite number >= 0"),
    "use_cache": (lambda v: isinstance(v, bool), "true or false"),
    "bos_token_id": (_token_id, "null or an int >= 0"),
    "pad_token_id": (_token_id, "null or an int >= 0"),
    "eos_token_id": (lambda v: _token_id(v) or (isinstance(v, list) and len(v) > 0 and all(
        v_ is not None and _token_id(v_) for v_ in v)), "null, an int >= 0 or a list of them"),
}


def _bad(field: str, label: str, expected: str, value) -> ConfigValueError:
    return ConfigValueError(field, f"config key {label!r}: expected {expected}, got {value!r} ({type(value).__name__})")


class _Reader:
    """Collects ``ModelArgs`` values (with the key each came from), metadata and unknown keys."""

    def __init__(self):
        self.args, self.labels, self.meta, self.unknown = {}, {}, {}, []
        self.hf = False  # a Hugging Face style file (its dtype defaults differ, see read_config)

    def put(self, field: str, value, label: str) -> None:
        value = check_value(field, value, label)
        if field in self.args and self.args[field] != value:
            raise ConfigValueError(field, f"config keys {self.labels[field]!r} and {label!r} disagree: "
                                          f"{self.args[field]!r} vs {value!r}")
        self.args[field] = value
        self.labels.setdefault(field, label)

    def section(self, obj, label: str) -> dict:
        if not isinstance(obj, dict):
            raise _bad(label, label, "an object", obj)
        return obj

    def level(self, obj: dict, prefix: str, top: bool) -> None:
        for key, value in obj.items():
            label = prefix + key
            if top and key == "text_config":
                self.hf = True
                self.level(self.section(value, label), label + ".", top=False)
            elif key in ("vision_config", "quantization_config", "rope_scaling"):
                self.hf = True
                if value is not None:
                    getattr(self, key.split("_")[0])(self.section(value, label), label + ".")
                elif key == "rope_scaling":
                    self.put("original_seq_len", 0, label)  # no YaRN
            elif key == "dtype":
                self.dtype(value, label)
            elif key in KEYS:
                self.put(key, value, label)
            elif key in TEXT_ALIASES:
                self.hf = True
                self.put(TEXT_ALIASES[key], value, label)
            elif key in FIXED:
                self.hf = True
                want = FIXED[key]
                if type(value) is not type(want) or value != want:
                    raise _bad(key, label, f"{want!r} (the only value flashrt implements)", value)
            elif key in META:
                self.hf = True
                check, what = META[key]
                if not check(value):
                    raise _bad(key, label, what, value)
                self.meta[label] = value
            else:
                self.unknown.append(label)

    def dtype(self, value, label: str) -> None:
        """``dtype`` is the ModelArgs weight format (``bf16`` / ``fp8``) or, in Hugging Face files, the
        torch dtype of the unquantized tensors (``bfloat16``, ...): the two value sets are disjoint."""
        if value in TORCH_DTYPES:
            self.meta[label] = value
        elif value in KEYS["dtype"].choices:
            self.put("dtype", value, label)
        else:
            raise _bad("dtype", label, "'bf16' or 'fp8' (weight format) or one of " + ", ".join(TORCH_DTYPES)
                       + " (torch dtype)", value)

    def vision(self, obj: dict, prefix: str) -> None:
        for key, value in obj.items():
            if key == "model_type":
                if not isinstance(value, str):
                    raise _bad(key, prefix + key, "a string", value)
                self.meta[prefix + key] = value
            elif key in VISION_ALIASES:
                self.put(VISION_ALIASES[key], value, prefix + key)
            else:
                self.unknown.append(prefix + key)

    def quantization(self, obj: dict, prefix: str) -> None:
        for key, value in obj.items():
            if key == "expert_dtype":
                self.put("expert_dtype", value, prefix + key)
            elif key in QUANT_FIXED:
                want = QUANT_FIXED[key]
                if type(value) is not type(want) or value != want:
                    raise _bad(key, prefix + key, f"{want!r} (the only value flashrt implements)", value)
                if key == "quant_method":
                    self.put("dtype", "fp8", prefix + key)
            else:
                self.unknown.append(prefix + key)

    def rope(self, obj: dict, prefix: str) -> None:
        for key, value in obj.items():
            if key in ("rope_type", "type"):
                if value != "yarn":
                    raise _bad(key, prefix + key, "'yarn' (the only scaling flashrt implements)", value)
            elif key in ROPE_ALIASES:
                self.put(ROPE_ALIASES[key], value, prefix + key)
            else:
                self.unknown.append(prefix + key)


def read_config(data, source: str = "config") -> tuple[dict, dict, dict]:
    """``(args, labels, meta)`` of a flat ``ModelArgs`` or Hugging Face style config object: ``args``
    maps ``ModelConfig`` fields to checked values, ``labels`` each field to the key it came from."""
    if not isinstance(data, dict):
        raise ConfigValueError("config", f"{source}: expected a JSON object, got {type(data).__name__}")
    reader = _Reader()
    reader.level(data, "", top=True)
    if reader.unknown:
        raise ConfigValueError(reader.unknown[0].split(".")[-1],
                               f"{source}: unknown config keys {reader.unknown} (flashrt accepts the reference "
                               f"ModelArgs keys and the published Hugging Face keys)")
    if not reader.hf and "dtype" in reader.meta:  # a flat ModelArgs file: dtype is the weight format
        raise _bad("dtype", "dtype", "'bf16' or 'fp8'", reader.meta["dtype"])
    if reader.hf and "dtype" not in reader.args:  # no quantization_config: unquantized weights
        reader.args["dtype"] = "bf16"
        reader.args.setdefault("expert_dtype", None)
    return reader.args, reader.labels, reader.meta


def special_tokens(meta: dict) -> dict:
    """``bos/eos/pad_token_id`` from ``meta`` (root or ``text_config``), as published."""
    return {k: v for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            for label, v in meta.items() if label.split(".")[-1] == k}


def to_hf(cfg, special: dict | None = None) -> dict:
    """The published root ``config.json`` layout of ``cfg`` (:func:`read_config` reads it back to ``cfg``)."""
    reverse = {v: k for k, v in TEXT_ALIASES.items()}
    rope = {v: k for k, v in ROPE_ALIASES.items()}
    vision = {v: k for k, v in VISION_ALIASES.items()}
    default = type(cfg)()
    text, rope_scaling, vision_config = {"model_type": "deepseek_v41_text"}, {"rope_type": "yarn"}, {}
    for f in dataclasses.fields(cfg):
        key, value = f.name, getattr(cfg, f.name)
        value = list(value) if isinstance(value, tuple) else value
        if key in ("name", "dtype", "expert_dtype", "image_token_id") or (
                key in RUNTIME_ONLY and value == getattr(default, key)):
            continue
        if key in rope:
            rope_scaling[rope[key]] = value
        elif key in VISION_KEYS:
            vision_config[vision[key]] = value
        else:
            text[reverse.get(key, key)] = value
    out = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
           **(special or {}), "image_token_id": cfg.image_token_id}
    if cfg.dtype == "fp8":
        out["quantization_config"] = {**QUANT_FIXED, "expert_dtype": cfg.expert_dtype}
    elif cfg.expert_dtype is not None:  # unquantized dense weights, quantized experts
        text["expert_dtype"] = cfg.expert_dtype
    text["rope_scaling"] = rope_scaling
    out["text_config"] = text
    out["vision_config"] = {"model_type": "deepseek_v41_vision", **vision_config}
    return out
