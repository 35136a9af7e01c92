"""ModelConfig: shipped configs, released parameter counts and layer roles, config.json round trips
(flat and HF-style, the published root config and inference/config.json), and validation errors
that name the key (types and ranges of every key, cross-key rules)."""
import dataclasses
import json
import math
from pathlib import Path

import pytest

from flashrt.errors import CheckpointError
from flashrt.graphs.config import SHIPPED, ModelConfig, shipped_config
from flashrt.graphs.hf_config import read_config, special_tokens, to_hf
from flashrt.graphs.params import count_params

DATA = Path(__file__).parents[1] / "data"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load(name):
    cfg = shipped_config(name)
    assert cfg.name == name
    assert len(cfg.compress_ratios) >= cfg.n_layers
    assert all(isinstance(getattr(cfg, k), tuple) for k in ("compress_ratios", "kv_source_layers"))
    counts = count_params(cfg)
    assert counts["backbone"] > 0
    assert (counts["draft"] > 0) == bool(cfg.dspark_block_size)
    assert (counts["engram"] > 0) == bool(cfg.engram_layer_ids)


def test_shipped_config_unknown_name():
    with pytest.raises(ValueError, match="model"):
        shipped_config("v4-huge")


def test_released_shape():
    cfg = shipped_config("v4.1-flash")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size) == (5120, 40, 64, 129280)
    assert (cfg.head_dim, cfg.rope_head_dim, cfg.window_size) == (512, 64, 128)
    assert cfg.compress_ratios[:cfg.n_layers] == (0, 0) + (2,) * 18 + (1,) * 20
    assert cfg.kv_source_layers == (2, 8, 14, 20)
    assert cfg.index_source_layers == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (cfg.n_routed_experts, cfg.n_activated_experts) == (384, 6)
    assert cfg.engram_num_embeddings == (384006168, 384016682)


def test_released_param_counts():
    counts = count_params(shipped_config("v4.1-flash"))
    assert 551.5e9 <= counts["backbone"] <= 552.5e9, counts
    assert 196.55e9 <= counts["engram"] <= 196.65e9, counts
    assert counts["engram"] == (384006168 + 384016682) * 256  # the two tables, head_dim 256


def test_released_layer_roles():
    """docs/model.md, 2: 0, 1 window; 2, 8, 14, 20 full; 24, 28, 32, 36 reindex; the rest reuse."""
    cfg = shipped_config("v4.1-flash")
    special = {0: "window", 1: "window", 2: "full", 8: "full", 14: "full", 20: "full",
               24: "reindex", 28: "reindex", 32: "reindex", 36: "reindex"}
    for layer in range(cfg.n_layers):
        assert cfg.role(layer) == special.get(layer, "reuse"), layer
    assert [cfg.role(l) for l in range(cfg.n_layers, cfg.total_layers)] == ["draft"] * 3
    assert [cfg.ratio(l) for l in (2, 8, 14, 19, 20, 39)] == [2, 2, 2, 2, 1, 1]
    # reuse layers read the nearest earlier source; reindex layers score inside layer 20's candidates
    assert [cfg.kv_source(l) for l in (3, 13, 19, 21, 24, 39)] == [2, 8, 14, 20, 20, 20]
    assert [cfg.index_source(l) for l in (21, 25, 31, 39)] == [20, 24, 28, 36]
    assert cfg.candidate_source_layer == 20
    assert all(cfg.uses_candidates(l) for l in (24, 28, 32, 36)) and not cfg.uses_candidates(20)


# ----- files ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SHIPPED)
def test_flat_config_round_trip(name, tmp_path):
    cfg = shipped_config(name)
    data = cfg.to_dict()
    assert "name" not in data
    assert set(data) == {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data, indent=1))
    back = ModelConfig.from_file(str(path))
    assert back == cfg and back.to_dict() == data
    assert back.name == "my-model"  # named after its directory


def test_hf_style_config(tmp_path):
    cfg = shipped_config("tiny")
    data = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "torch_dtype": "bfloat16", "transformers_version": "4.99.0", "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "fp8"}, "vision_config": {},
            "text_config": cfg.to_dict()}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert ModelConfig.from_file(str(path)) == cfg
    # model keys may also sit next to text_config; a key given twice with two values is an error
    outer = {**data, "max_seq_len": 1234, "text_config": {k: v for k, v in cfg.to_dict().items() if k != "max_seq_len"}}
    assert ModelConfig.from_dict(outer).max_seq_len == 1234
    outer = {**data, "max_batch_size": 1, "text_config": {**cfg.to_dict(), "max_batch_size": 2}}
    with pytest.raises(ValueError, match="'text_config.max_batch_size' and 'max_batch_size' disagree"):
        ModelConfig.from_dict(outer)
    assert ModelConfig.from_dict({**data, "max_batch_size": cfg.max_batch_size}) == cfg  # same value twice: fine


@pytest.mark.parametrize("where", ["flat", "text_config", "outer"])
def test_unknown_key_named(where):
    good = shipped_config("tiny").to_dict()
    data = {"flat": {**good, "n_dense_layers": 3},
            "text_config": {"model_type": "x", "text_config": {**good, "n_dense_layers": 3}},
            "outer": {"model_type": "x", "n_dense_layers": 3, "text_config": good}}[where]
    with pytest.raises(ValueError, match="n_dense_layers"):
        ModelConfig.from_dict(data)


def test_bad_json_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{\"dim\": 64,")
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_file(str(path))


# ----- validation -------------------------------------------------------------------------------------
TINY_RATIOS = shipped_config("tiny").compress_ratios


@pytest.mark.parametrize("key, value", [
    ("vision_n_heads", 0),  # with the vision tower on, below
    ("vision_n_heads", 512),  # a head dim of 2: no 2-D rotary halves
    ("vision_max_n_token", 2),  # fewer than one 2 x 2 merged patch grid
    ("score_func", "relu"),
    ("compress_ratios", TINY_RATIOS[:5]),  # fewer than n_layers
    ("compress_ratios", (3,) * len(TINY_RATIOS)),  # not a supported ratio
    ("dtype", "fp16"),
    ("expert_dtype", "int4"),
    ("n_shared_experts", 2),
    ("o_groups", 3),  # not a divisor of n_heads
    ("rope_head_dim", 15),
    ("head_dim", 48),
    ("kv_source_layers", (1, 4)),  # layer 1 has no compression
    ("kv_source_layers", (4,)),  # layer 2 (ratio 2) would have no source
    ("index_source_layers", (4, 6)),  # layer 2 would have no index source
    ("candidate_source_layer", 6),  # not a KV source
    ("candidate_topk_blocks", 0),
    ("engram_num_embeddings", (6126,)),
    ("engram_max_ngram_size", 1),
    ("dspark_target_layer_ids", ()),
    ("dspark_target_layer_ids", (5, 8)),  # layer 8 does not exist
    ("n_activated_experts", 9),  # more than the 8 routed experts
    ("dspark_n_activated_experts", 5),  # more than the 4 draft experts
    ("engram_layer_ids", (1, 1)),
    ("index_head_dim", 48),
])
def test_invalid_value_names_key(key, value):
    data = {**shipped_config("tiny").to_dict(), "vision_n_layers": 2, key: value}
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(data)
    with pytest.raises(ValueError, match=key):  # replace() validates too
        shipped_config("tiny").replace(vision_n_layers=2, **{key: value})


def test_bad_index_source_names_its_own_key():
    with pytest.raises(ValueError, match="index_source_layers"):
        shipped_config("tiny").replace(index_source_layers=(1, 2, 4, 6))  # layer 1 has ratio 0


def test_kv_source_must_be_an_index_source():
    cfg = shipped_config("tiny")
    assert cfg.replace(index_source_layers=(2, 4, 6)).index_source(5) == 4  # the valid layout
    with pytest.raises(ValueError, match="index_source_layers"):
        cfg.replace(index_source_layers=(2, 6))


def test_config_is_frozen_and_hashable():
    cfg = shipped_config("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 128
    assert hash(cfg) == hash(shipped_config("tiny"))
    assert cfg.replace(max_seq_len=8192) != cfg


# ----- types and ranges ---------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, expected", [
    ("dim", "64", "an int >= 1"),
    ("rope_theta", None, "a finite number > 0"),
    ("window_size", -8, "an int >= 1"),
    ("norm_topk_prob", "false", "true or false"),
    ("norm_topk_prob", 0, "true or false"),
    ("n_layers", True, "an int >= 1"),
    ("max_seq_len", 12.5, "an int >= 1"),
    ("vocab_size", 2**40, "<= 2147483647"),
    ("hc_eps", math.nan, "a finite number > 0"),
    ("route_scale", math.inf, "a finite number > 0"),
    ("compress_ratios", "00221111", "a list of ints each >= 0"),
    ("kv_source_layers", [2, "4"], "a list of ints each >= 0"),
    ("engram_num_embeddings", [6126, 0], "a list of ints each >= 1"),
    ("score_func", 1, "one of 'softmax', 'sigmoid', 'sqrtsoftplus'"),
    ("expert_dtype", "nvfp4", "null or one of 'fp4'"),
    ("vision_max_wh_ratio", 0, "null or an int >= 1"),
    ("vision_n_layers", -1, "an int >= 0"),
    ("candidate_source_layer", -2, "an int >= -1"),
    ("dtype", "bfloat16", "'bf16' or 'fp8'"),  # a torch dtype name is not the flat file's weight format
])
def test_bad_type_or_range_names_key_expected_and_found(key, value, expected):
    data = {**shipped_config("tiny").to_dict(), key: value}
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(data)
    msg = str(err.value)
    assert f"config key {key!r}" in msg and expected in msg and repr(value) in msg, msg


def test_values_are_stored_in_their_types():
    data = {**shipped_config("tiny").to_dict(), "rope_theta": 10000, "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0]}
    cfg = ModelConfig.from_dict(data)
    assert type(cfg.rope_theta) is float and cfg.rope_theta == 10000.0
    assert cfg.compress_ratios == (0, 0, 2, 2, 1, 1, 1, 1, 0)


def test_not_an_object(tmp_path):
    with pytest.raises(ValueError, match="expected a JSON object"):
        ModelConfig.from_dict([1, 2])
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ModelConfig.from_file(str(path))


# ----- the published Hugging Face layout -----------------------------------------------------------
RUNTIME_ONLY = ("max_batch_size", "temperature")  # keys the published files do not have


def test_published_root_config_is_the_shipped_release():
    """Every key of the published root config.json maps onto the released model's ModelArgs."""
    published = ModelConfig.from_file(str(DATA / "v41_flash_config.json"))
    shipped = shipped_config("v4.1-flash")
    assert {k: v for k, v in published.to_dict().items() if k not in RUNTIME_ONLY} == \
        {k: v for k, v in shipped.to_dict().items() if k not in RUNTIME_ONLY}
    assert published.vision_enabled and published.vision_n_layers == 32
    assert (published.dtype, published.expert_dtype, published.window_size) == ("fp8", "fp4", 128)
    _, _, meta = read_config(json.loads((DATA / "v41_flash_config.json").read_text()))
    assert special_tokens(meta) == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def test_published_inference_config_agrees_with_root_config():
    inference = json.loads((DATA / "v41_flash_inference_config.json").read_text())
    cfg = ModelConfig.from_dict(inference)  # the vision keys are accepted (vision_n_layers 32)
    root = ModelConfig.from_file(str(DATA / "v41_flash_config.json"))
    assert all(getattr(cfg, k) == getattr(root, k) for k in inference)


@pytest.mark.parametrize("name", SHIPPED)
def test_hf_layout_round_trip(name):
    cfg = shipped_config(name)
    data = json.loads(json.dumps(to_hf(cfg, {"eos_token_id": [1, 7]})))
    assert "hidden_size" in data["text_config"] and "dim" not in data["text_config"]
    assert ModelConfig.from_dict(data) == cfg


def _published():
    return json.loads((DATA / "v41_flash_config.json").read_text())


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["text_config"].update(n_dense_layers=3), ["unknown", "text_config.n_dense_layers"]),
    (lambda d: d["vision_config"].update(depth=3), ["unknown", "vision_config.depth"]),
    (lambda d: d["quantization_config"].update(group_size=128), ["unknown", "quantization_config.group_size"]),
    (lambda d: d["text_config"].update(hidden_act="gelu"), ["text_config.hidden_act", "'silu'", "'gelu'"]),
    (lambda d: d["text_config"].update(num_key_value_heads=8), ["text_config.num_key_value_heads", "8"]),
    (lambda d: d["text_config"].update(tie_word_embeddings=True), ["text_config.tie_word_embeddings"]),
    (lambda d: d["quantization_config"].update(weight_block_size=[128, 128]),
     ["quantization_config.weight_block_size", "[32, 32]", "[128, 128]"]),
    (lambda d: d["quantization_config"].update(expert_dtype="int4"), ["quantization_config.expert_dtype", "'int4'"]),
    (lambda d: d["text_config"]["rope_scaling"].update(rope_type="linear"), ["rope_scaling.rope_type", "'yarn'"]),
    (lambda d: d["text_config"]["rope_scaling"].update(factor="16"), ["rope_scaling.factor", "'16'"]),
    (lambda d: d["text_config"].update(hidden_size=-1), ["text_config.hidden_size", "-1"]),
    (lambda d: d["text_config"].update(dim=4096), ["'text_config.hidden_size' and 'text_config.dim' disagree"]),
    (lambda d: d["text_config"].update(sliding_window="128"), ["text_config.sliding_window", "'128'"]),
    (lambda d: d.update(eos_token_id="1"), ["eos_token_id", "'1'"]),
    (lambda d: d.update(dtype="fp16"), ["'dtype'", "'fp16'"]),
    (lambda d: d.update(text_config=[1]), ["text_config", "an object"]),
    (lambda d: d["vision_config"].update(num_attention_heads=3), ["vision_n_heads", "vision_config.num_attention_heads"]),
    (lambda d: d["text_config"].update(kv_source_layer_ids=[2, 8, 14]),
     ["kv_source_layers", "text_config.kv_source_layer_ids"]),
])
def test_published_key_errors_name_the_key_as_written(edit, words):
    data = _published()
    edit(data)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(data, source="config.json")
    assert all(w in str(err.value) for w in words), str(err.value)


def test_hf_config_without_quantization_is_bf16():
    data = _published()
    del data["quantization_config"]
    cfg = ModelConfig.from_dict(data)
    assert (cfg.dtype, cfg.expert_dtype) == ("bf16", None)
    data["text_config"]["rope_scaling"] = None
    assert ModelConfig.from_dict(data).original_seq_len == 0  # no YaRN
