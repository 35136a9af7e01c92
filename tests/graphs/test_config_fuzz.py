"""Fuzzing config.json, in flashrt's flat ModelArgs layout and the published Hugging Face layout.

One key of a valid file gets a random JSON value (or an unknown key is added). Reading the file
must either raise ``ValueError`` / ``CheckpointError`` naming a config key (the mutated one when
its JSON type is wrong), or accept a value of the right kind that the config then holds unchanged.
The right kind is judged here independently: from the reference ``ModelArgs`` annotations and
``Literal`` choices (flat layout) or the kind of the valid value at that place (published layout).
"""
import json
import math
import tempfile
import typing
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from flashrt.errors import CheckpointError
from flashrt.graphs.checkpoint import read_config
from flashrt.graphs.config import ModelConfig, shipped_config
from flashrt.graphs.hf_config import RUNTIME_ONLY, to_hf

TINY = shipped_config("tiny")
FLAT = json.loads(json.dumps(TINY.to_dict()))
CHOICES = {"dtype": ("bf16", "fp8"), "expert_dtype": ("fp4", None), "score_func": ("softmax", "sigmoid", "sqrtsoftplus")}
HINTS = typing.get_type_hints(ModelConfig)
# the published keys that describe the one architecture flashrt implements, and their values
FIXED = {"hidden_act": "silu", "num_key_value_heads": 1, "attention_bias": False, "tie_word_embeddings": False,
         "topk_method": "noaux_tc"}
# published keys that do not change the computation: checked for their kind, not held by the config
META = {"architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
        "initializer_range", "use_cache"}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
NULLABLE = TOKEN_IDS + ("expert_dtype",)  # null is a valid value (reference ModelArgs: expert_dtype fp4 | None)
HF = json.loads(json.dumps(to_hf(TINY, {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})))
HF["text_config"].update(FIXED, attention_dropout=0.0, initializer_range=0.02, use_cache=True)

scalars = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=6))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c,
                                                                                       max_size=3), max_leaves=6)


def near(value):
    """Values close to a valid one: its string, off by a little, negated, wrapped, a float."""
    out = [st.just(str(value)), st.just(None), st.just([value]), st.just(-1),
           st.sampled_from(["bfloat16", "float32", "bf16", "fp8", "fp4", "softmax", "yarn", "silu"])]
    if isinstance(value, bool):
        out += [st.just(int(value)), st.just(str(value).lower())]
    elif isinstance(value, (int, float)):
        out += [st.just(-value), st.just(value + 0.5), st.integers(-3, 3).map(lambda d: value + d)]
    elif isinstance(value, list):
        out += [st.just(value[:-1]), st.just(value + [-1]), st.just([str(v) for v in value]), st.just(value * 3)]
    return st.one_of(*out)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def flat_kind_ok(key, v) -> bool:
    """``v`` has the ModelArgs type of ``key`` and a sign that can describe a model."""
    if key in CHOICES:
        return v in CHOICES[key]
    hint = HINTS[key]
    if hint is bool:
        return isinstance(v, bool)
    if hint is int:
        return _int(v) and v >= (-1 if key == "candidate_source_layer" else 0)
    if hint is float:
        return (_int(v) or isinstance(v, float)) and math.isfinite(v) and v >= 0
    if typing.get_origin(hint) is tuple:
        return isinstance(v, list) and all(_int(x) and x >= 0 for x in v)
    return v is None or (_int(v) and v > 0)  # int | None (vision_max_wh_ratio)


def published_kind_ok(orig, v, key=None) -> bool:
    """``v`` is of the kind of the valid value ``orig`` at the same place (token ids may be null,
    ``eos_token_id`` a list of ids)."""
    if (key in NULLABLE and v is None) or (key == "eos_token_id" and isinstance(v, list) and v
                                           and all(_int(x) and x >= 0 for x in v)):
        return True
    if isinstance(orig, bool) or orig is None:
        return type(v) is type(orig) or (orig is None and _int(v) and v > 0)
    if isinstance(orig, (int, float)):
        return (_int(v) if _int(orig) else (_int(v) or isinstance(v, float)) and math.isfinite(v)) and v >= -1
    if isinstance(orig, list):
        return isinstance(v, list) and all(type(x) is type(orig[0]) for x in v) if orig else isinstance(v, list)
    return isinstance(v, type(orig))


def read(data):
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(data, allow_nan=True))
        return read_config(d)


def outcome(data, key):
    """(cfg, None) or (None, message); any other exception fails the test."""
    try:
        return read(data), None
    except (ValueError, CheckpointError) as exc:
        msg = str(exc)
        assert "config key" in msg or "unknown config keys" in msg, msg
        return None, msg


def leaves(obj, prefix=()):
    for k, v in obj.items():
        if isinstance(v, dict) and k in ("text_config", "vision_config", "quantization_config", "rope_scaling"):
            yield from leaves(v, prefix + (k,))
        else:
            yield prefix + (k,)


PATHS = sorted(leaves(HF))


def _at(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _same(a, b) -> bool:
    return a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b))


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.data())
def test_fuzz_flat_config(data):
    key = data.draw(st.sampled_from(sorted(FLAT)))
    value = data.draw(st.one_of(json_values, near(FLAT[key])))
    cfg, msg = outcome({**FLAT, key: value}, key)
    if cfg is None:
        assert flat_kind_ok(key, value) or repr(key) in msg, msg
        return
    assert flat_kind_ok(key, value), f"{key}={value!r} accepted"
    held = getattr(cfg, key)
    assert _same(list(held) if isinstance(held, tuple) else held, value), (key, value, held)


@FUZZ
@given(st.data())
def test_fuzz_published_config(data):
    path = data.draw(st.sampled_from(PATHS))
    orig = _at(HF, path)
    value = data.draw(st.one_of(json_values, near(orig)))
    doc = json.loads(json.dumps(HF))
    _at(doc, path[:-1])[path[-1]] = value
    cfg, msg = outcome(doc, path[-1])
    if cfg is None:
        assert published_kind_ok(orig, value, path[-1]) or path[-1] in msg, msg
        return
    assert published_kind_ok(orig, value, path[-1]), f"{'.'.join(path)}={value!r} accepted"
    if path[-1] in META:
        return
    if path[-1] in FIXED:
        assert value == orig and type(value) is type(orig)
    elif path[-1] == "dtype" and len(path) == 1:
        assert value in ("bfloat16", "float16", "float32", "fp8")
    elif path[-1] in RUNTIME_ONLY:  # to_hf writes these only when they differ from the default
        assert _same(getattr(cfg, path[-1]), value), (path, value, getattr(cfg, path[-1]))
    else:
        held = _at(to_hf(cfg), path)
        assert _same(held, value), (path, value, held)


@FUZZ
@given(st.sampled_from(["flat", "text_config", "root", "vision_config"]), st.text(min_size=1, max_size=12), scalars)
def test_fuzz_unknown_key_is_named(where, key, value):
    if where == "flat":
        doc, known = {**FLAT, key: value}, key in FLAT
    else:
        doc = json.loads(json.dumps(HF))
        target = doc if where == "root" else doc[where]
        # the reader takes flashrt's flat ModelArgs names at the root and inside text_config too
        known = key in target or (where in ("root", "text_config") and key in FLAT)
        target[key] = value
    if known:
        return
    cfg, msg = outcome(doc, key)
    assert cfg is None and "unknown config keys" in msg or repr(key) in msg, (where, key, msg)
