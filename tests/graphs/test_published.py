"""The published DeepSeek-V4.1-Flash directory layout loads as it is (tiny dimensions).

A directory written as published (root Hugging Face config, inference/config.json, index and
shards, wo_a F8_E4M3 + scale, I8 experts, the vision tensors) and today's layout written by
``checkpoint.save`` from the same random weights load to the same weights and the same logits,
bit for bit. The reference model holds wo_a in BF16 and the official convert.py dequantizes the
published FP8 to it (exact: power-of-two scales), so today's layout gets that BF16 weight.
"""
import json
import logging
import shutil

import pytest
import torch

import flashrt
from flashrt.errors import CheckpointError
from flashrt.formats import dequantize, quantize
from flashrt.graphs import checkpoint
from published_layout import published_tensors, with_vision, wo_a_as_converted, write_published
from test_checkpoint import assert_same


@pytest.fixture(scope="module")
def dirs(cfg, weights, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    pub = write_published(weights, with_vision(cfg), root / "published")
    ours = checkpoint.save(wo_a_as_converted(weights), cfg, root / "ours")
    return pub, ours


def test_published_dir_holds_the_published_storage(dirs):
    index = json.loads((dirs[0] / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) == 3 and all((dirs[0] / f).is_file() for f in files)
    from flashrt.graphs.shards import read_header

    header = {}
    for f in files:
        header.update(read_header(dirs[0] / f))
    assert header["layers.0.attn.wo_a.weight"][0] == "F8_E4M3" and header["layers.0.attn.wo_a.scale"][0] == "F8_E8M0"
    assert header["layers.0.ffn.experts.0.w1.weight"][0] == "I8"
    assert "vision.blocks.1.mlp.w1.weight" in header and "mtp.0.ffn.gate.bias_vl" in header


def test_same_weights_as_todays_layout(dirs, cfg, weights):
    pub_cfg, pub = checkpoint.load(dirs[0])
    our_cfg, ours = checkpoint.load(dirs[1])
    assert pub_cfg == with_vision(cfg) and our_cfg == cfg
    assert_same(pub, ours)
    w = pub["layers.3.attn.wo_a.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, dequantize(quantize(weights["layers.3.attn.wo_a.weight"].float(), "fp8_w"), torch.bfloat16))


def test_same_logits_and_tokens_as_todays_layout(dirs, cfg, rng):
    a, b = flashrt.load(dirs[0]), flashrt.load(dirs[1])
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=rng)
    assert torch.equal(a.forward(ids), b.forward(ids))
    prompts = [ids[0, :9].tolist(), ids[1, :5].tolist()]
    ga = flashrt.generate(a, prompts, max_new_tokens=4)
    gb = flashrt.generate(b, prompts, max_new_tokens=4)
    assert ga.tokens == gb.tokens and all(len(t) == 4 for t in ga.tokens)


def test_vision_tensors_ignored_with_one_log_line(dirs, caplog):
    with caplog.at_level(logging.INFO, logger="flashrt.checkpoint"):
        checkpoint.load(dirs[0], device="meta")
    lines = [r.getMessage() for r in caplog.records if r.name == "flashrt.checkpoint"]
    n_vision = 3 + 4 + 3 + 8 * 2 + 9  # delimiters, aligner, patch embed + norm, 8 per block, bias_vl per block
    assert len(lines) == 1 and f"ignoring {n_vision} tensors" in lines[0] and "text only" in lines[0], lines


def test_vision_tensors_without_a_vision_config_are_unexpected(dirs, tmp_path):
    path = tmp_path / "p"
    shutil.copytree(dirs[0], path)
    data = json.loads((path / "config.json").read_text())
    data["vision_config"]["num_hidden_layers"] = 0
    (path / "config.json").write_text(json.dumps(data))
    (path / "inference" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="unexpected tensor 'aligner.w1.bias'"):
        checkpoint.load(path)


def test_inference_config_must_agree(dirs, tmp_path):
    path = tmp_path / "p"
    shutil.copytree(dirs[0], path)
    flat = json.loads((path / "inference" / "config.json").read_text())
    (path / "inference" / "config.json").write_text(json.dumps({**flat, "window_size": 16}))
    with pytest.raises(CheckpointError, match="inference/config.json: 'window_size' is 16 but config.json gives 8"):
        checkpoint.load(path)
    (path / "inference" / "config.json").write_text(json.dumps({**flat, "bogus": 1}))
    with pytest.raises(CheckpointError, match="bogus"):
        checkpoint.load(path)


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.update({"layers.2.attn.wo_a.scale": t["layers.2.attn.wo_a.scale"][:-1]}),
     ["layers.2.attn.wo_a.scale", "float8_e8m0fnu [2, 4]", "[1, 4]"]),
    (lambda t: t.update({"layers.2.attn.wo_a.weight": t["layers.2.attn.wo_a.weight"][:, :-32]}),
     ["layers.2.attn.wo_a.weight", "float8_e4m3fn [64, 128]", "[64, 96]"]),
    (lambda t: t.pop("layers.2.attn.wo_a.scale"), ["layers.2.attn.wo_a.weight", "bfloat16/float32 [64, 128]",
                                                   "float8_e4m3fn"]),
    (lambda t: t.pop("layers.2.ffn.experts.3.w2.weight"), ["missing tensor 'layers.2.ffn.experts.3.w2.weight'"]),
])
def test_bad_published_tensor_is_named(cfg, weights, tmp_path, edit, words):
    vcfg = with_vision(cfg)
    tensors = published_tensors(weights, vcfg)
    edit(tensors)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(write_published(weights, vcfg, tmp_path / "p", tensors=tensors))
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("where", ["../outside.safetensors", "/tmp/abs.safetensors", "sub/../../x.safetensors"])
def test_index_shard_outside_the_directory_is_rejected(dirs, tmp_path, where):
    path = tmp_path / "p"
    shutil.copytree(dirs[0], path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["norm.weight"] = where
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="points outside the checkpoint directory"):
        checkpoint.load(path)


def test_model_run_on_published_dir(dirs, tmp_path):
    """`flashrt run --model DIR` takes the downloaded folder and nothing else."""
    from flashrt.engine.run import run

    report = run(str(dirs[0]), prompt="hello", max_new_tokens=3, device="cpu", quiet=True, threads=1)
    assert report["new_tokens"] == 3 and report["model"] == "published"


def _tokenizer_file(path):
    """A word-level tokenizer of 320 tokens whose ids i and i + 160 differ only in case."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"tok{i}": i for i in range(160)} | {f"TOK{i}": 160 + i for i in range(160)}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="tok0")).save(str(path / "tokenizer.json"))


def test_engram_token_map_derived_from_the_tokenizer(cfg, weights, tmp_path, rng):
    """The published folder has no token-map file: the compressed ids come from tokenizer.json
    (tokens that normalize alike share one), as the reference derives them."""
    from flashrt.graphs.loader import token_map_for

    vcfg = with_vision(cfg).replace(engram_compressed_vocab_size=160)
    path = write_published(weights, vcfg, tmp_path / "p")
    with pytest.raises(CheckpointError, match="engram_compressed_vocab_size=160 is below vocab_size=320"):
        flashrt.load(path)
    _tokenizer_file(path)
    table = token_map_for(path, vcfg).table
    assert torch.equal(table[:160], table[160:]) and sorted(table[:160].tolist()) == list(range(160))
    model = flashrt.load(path)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=rng)
    assert torch.isfinite(model.forward(ids)).all()
    with pytest.raises(CheckpointError, match="derives 160 compressed ids.*engram_compressed_vocab_size=150"):
        token_map_for(path, vcfg.replace(engram_compressed_vocab_size=150))


def test_chat_on_a_published_dir_prints_decoded_text(cfg, weights, tmp_path):
    """`flashrt run --model <published dir> --chat ...`: the folder's own tokenizer encodes the chat
    turn and decodes the answer (text, never bytes)."""
    from flashrt.engine.run import run
    from flashrt.graphs import chat_format
    from flashrt.graphs.builtin_tokenizer import ensure_builtin_tokenizer
    from flashrt.graphs.tokenizer import load_tokenizer

    path = write_published(weights, with_vision(cfg), tmp_path / "published")
    ensure_builtin_tokenizer(path, cfg)  # a real byte-level BPE of the model's vocabulary
    report = run(str(path), max_new_tokens=4, device="cpu", quiet=True, threads=1, chat="Hello there")
    tok = load_tokenizer(path)
    assert report["tokenizer"] and report["new_text"] == tok.decode(report["new_token_ids"])
    prompt_ids = chat_format.encode(tok, [{"role": "user", "content": "Hello there"}], thinking=True)
    assert report["prompt_tokens"] == len(prompt_ids)


def test_vision_config_without_vision_tensors_loads_text_only(cfg, weights, tmp_path, rng, caplog):
    vcfg = with_vision(cfg)
    path = checkpoint.save(weights, vcfg, tmp_path / "text")  # the text weights under a vision config
    with caplog.at_level(logging.INFO, logger="flashrt.checkpoint"):
        back = flashrt.load(path)
    lines = [r.getMessage() for r in caplog.records if r.name == "flashrt.checkpoint"]
    assert len(lines) == 1 and "none of the vision tower's tensors" in lines[0] and "text only" in lines[0], lines
    assert back.cfg == vcfg and back.vision is None
    ids = torch.randint(0, cfg.vocab_size, (1, 11), generator=rng)
    assert torch.equal(back.forward(ids), flashrt.load(checkpoint.save(weights, cfg, tmp_path / "plain")).forward(ids))
