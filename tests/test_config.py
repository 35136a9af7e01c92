"""ModelConfig: shipped configs, released parameter counts and layer roles, config.json round trips
(flat and HF-style), and validation errors that name the key."""
import dataclasses
import json

import pytest

from flashrt.errors import CheckpointError
from flashrt.graphs.config import SHIPPED, ModelConfig, shipped_config
from flashrt.graphs.params import count_params


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
    # model keys may also sit next to text_config; text_config wins on a clash
    outer = {**data, "max_batch_size": 1, "text_config": {**cfg.to_dict(), "max_batch_size": 2}}
    assert ModelConfig.from_dict(outer).max_batch_size == 2
    outer = {**data, "max_seq_len": 1234, "text_config": {k: v for k, v in cfg.to_dict().items() if k != "max_seq_len"}}
    assert ModelConfig.from_dict(outer).max_seq_len == 1234


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
    ("vision_n_layers", -1),
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
])
def test_invalid_value_names_key(key, value):
    data = {**shipped_config("tiny").to_dict(), key: value}
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(data)
    with pytest.raises(ValueError, match=key):  # replace() validates too
        shipped_config("tiny").replace(**{key: value})


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
