"""Tokenizers: the built-in byte-level BPE, BOS rules of tokenizer_config.json, round trips,
special tokens, streaming decoding against a full decode, the UTF-8 fallback."""
import json
import logging
import random

import pytest
from hypothesis import given, settings, strategies as st

from flashrt.graphs import chat_format as cf
from flashrt.graphs.builtin_tokenizer import MIN_VOCAB, build, ensure_builtin_tokenizer, tokenizer_config
from flashrt.graphs.config import shipped_config
from flashrt.graphs.tokenizer import (ByteTokenizer, Tokenizer, WindowStream, attach_tokenizer, byte_level_chars,
                                      load_tokenizer)

TEXTS = ["The quick brown fox jumps over the lazy dog.", "  two  spaces\tand\nnewlines\r\n", "",
         "中文分词：你好，世界！深度求索", "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷", "mixed: αβγ русский العربية हिन्दी 日本語",
         "numbers 1234567890 3.14159 and code: def f(x): return x**2"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    assert ensure_builtin_tokenizer(path, shipped_config("tiny"))
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_builtin_tokenizer_has_the_model_vocabulary_and_the_published_layout(tok, tok_dir):
    cfg = shipped_config("tiny")
    assert tok.vocab_size == cfg.vocab_size == tok.backend.get_vocab_size(with_added_tokens=True)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2) == (tok.token_id(cf.BOS), tok.token_id(cf.EOS),
                                                                tok.token_id(cf.PAD))
    assert cfg.engram_pad_id == tok.pad_id
    chat_ids = [tok.token_id(t) for t, _ in cf.CHAT_TOKENS]
    assert chat_ids == list(range(cfg.vocab_size - len(cf.CHAT_TOKENS), cfg.vocab_size))
    special = {tok.token_id(t) for t, s in cf.CHAT_TOKENS if s} | {0, 1, 2}
    assert tok.special_ids == frozenset(special)
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())["add_bos_token"] is True
    # every byte is one token, so any text encodes; English merges come first
    assert all(tok.token_id(c) is not None for c in byte_level_chars())
    assert len(tok.encode("the the the", add_special_tokens=False)) < len("the the the")


def test_builtin_tokenizer_is_deterministic_and_fills_any_vocabulary():
    assert build(400).to_str() == build(400).to_str()
    small = build(MIN_VOCAB + 5)
    assert small.get_vocab_size(with_added_tokens=True) == MIN_VOCAB + 5
    big = build(3000, seed=1)  # a text short of merges is topped up with placeholders, never short
    assert big.get_vocab_size(with_added_tokens=True) == 3000
    with pytest.raises(ValueError, match=f"vocab_size.*at least {MIN_VOCAB}"):
        build(MIN_VOCAB - 1)


def test_ensure_builtin_tokenizer_writes_once(tmp_path):
    cfg = shipped_config("tiny")
    assert ensure_builtin_tokenizer(tmp_path, cfg)
    mtime = (tmp_path / "tokenizer.json").stat().st_mtime_ns
    assert not ensure_builtin_tokenizer(tmp_path, cfg)
    assert (tmp_path / "tokenizer.json").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[:1] == [tok.bos_id] and tok.bos_id not in ids[1:]
    assert tok.decode(ids[1:]) == text and tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids) == cf.BOS + text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_tokens_encode_as_single_ids(tok):
    text = cf.BOS + cf.USER + "hi" + cf.ASSISTANT + cf.THINK + "hm" + cf.END_THINK + "ok" + cf.EOS
    ids = tok.encode(text, add_special_tokens=False)
    for t in (cf.BOS, cf.USER, cf.ASSISTANT, cf.THINK, cf.END_THINK, cf.EOS):
        assert ids.count(tok.token_id(t)) == 1
    assert tok.decode(ids) == text
    # skip_special_tokens drops the special ones; <think> / </think> are plain added tokens
    assert tok.decode(ids, skip_special_tokens=True) == "hi" + cf.THINK + "hm" + cf.END_THINK + "ok"


def test_bos_rules_follow_the_config(tok_dir, tmp_path):
    from tokenizers import Tokenizer as Backend, processors

    backend = Backend.from_file(str(tok_dir / "tokenizer.json"))
    plain = backend.encode("hello", add_special_tokens=False).ids
    off = Tokenizer(backend, {**tokenizer_config(64), "add_bos_token": False})
    assert off.encode("hello") == plain
    both = Tokenizer(backend, {**tokenizer_config(64), "add_eos_token": True})
    assert both.encode("hello") == [0] + plain + [1]
    # no add_*_token keys: the tokenizer.json post-processor decides, and adds nothing twice
    backend.post_processor = processors.TemplateProcessing(single=f"{cf.BOS} $A", special_tokens=[(cf.BOS, 0)])
    by_file = Tokenizer(backend, {"bos_token": cf.BOS})
    assert by_file.encode("hello") == [0] + plain and by_file.encode("hello", add_special_tokens=False) == plain
    explicit = Tokenizer(backend, tokenizer_config(64))  # config says BOS, the post-processor too: one BOS
    assert explicit.encode("hello") == [0] + plain


def test_bad_files_and_ids_are_clear_errors(tok, tok_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizers file"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>"}))
    with pytest.raises(ValueError, match="bos_token '<nope>' is not in the vocabulary"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": cf.EOS}}))
    assert Tokenizer.from_dir(tmp_path).eos_id == 1  # an AddedToken object names it too
    with pytest.raises(ValueError, match=r"ids: expected ints in \[0, 320\), got 320"):
        tok.decode([5, 320])
    with pytest.raises(ValueError, match="text: expected a str"):
        tok.encode(b"bytes")


def _random_ids(rng: random.Random, tok, n: int) -> list[int]:
    """Ids weighted toward pieces of multi-byte characters and special tokens."""
    partial = [i for i in range(tok.vocab_size) if len(tok._token_bytes()[i]) == 1 and tok._token_bytes()[i][0] >= 0x80]
    pools = [range(tok.vocab_size), partial, sorted(tok.special_ids)]
    return [rng.choice(rng.choices(pools, weights=(5, 4, 1))[0]) for _ in range(n)]


def _streamed(stream, ids) -> tuple[str, list[str]]:
    pieces = [stream.push(i) for i in ids]
    return "".join(pieces) + stream.finish(), pieces


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("window", [False, True])
def test_streaming_equals_a_full_decode_on_random_ids(tok, skip, window):
    rng = random.Random(1234 + 2 * skip + window)
    for n in [1, 2, 3, 7, 40, 200] * 8:
        ids = _random_ids(rng, tok, n)
        stream = WindowStream(tok, skip) if window else tok.stream(skip)
        assert _streamed(stream, ids)[0] == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_emits_each_character_once_it_is_complete(tok, text, window):
    ids = tok.encode(text, add_special_tokens=False)
    stream = WindowStream(tok, False) if window else tok.stream()
    out, table = "", tok._token_bytes()
    for k, i in enumerate(ids):
        out += stream.push(i)
        raw = b"".join(table[j] for j in ids[:k + 1])
        assert out == raw[:_complete_prefix(raw)].decode()  # no part of a character, nothing held back
    assert out + stream.finish() == text


def _complete_prefix(raw: bytes) -> int:
    """Length of the longest prefix of valid UTF-8 ``raw`` that ends on a character boundary."""
    for cut in range(len(raw), max(len(raw) - 4, 0) - 1, -1):
        try:
            raw[:cut].decode()
            return cut
        except UnicodeDecodeError:
            continue
    return 0


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=0, max_size=40))
def test_fuzz_text_round_trip_and_stream(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert _streamed(tok.stream(), ids)[0] == text


def test_utf8_fallback_warns_and_never_drops_ids(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="flashrt"):
        t = load_tokenizer(tmp_path)
    assert isinstance(t, ByteTokenizer) and "no tokenizer.json" in caplog.text
    text = "héllo 😀"
    assert t.encode(text) == list(text.encode()) and t.decode(t.encode(text)) == text
    assert t.decode([104, 300, 105]) == "h\ufffdi"  # an id past the bytes is visible, not dropped
    ids = list("é😀".encode()) + [999] + list("中".encode())[:2]
    assert _streamed(t.stream(), ids)[0] == t.decode(ids) == "é😀\ufffd\ufffd"


def test_attach_checks_the_model_vocabulary(tok_dir, tmp_path):
    class Model:
        cfg = shipped_config("tiny")

    m = Model()
    assert attach_tokenizer(m, tok_dir) is m.tokenizer and m.tokenizer.vocab_size == 320
    (tmp_path / "tokenizer.json").write_text(build(400).to_str())
    with pytest.raises(ValueError, match="token ids reach 399, past the model's vocab_size 320"):
        attach_tokenizer(m, tmp_path)


def test_a_built_in_checkpoint_verifies_with_its_tokenizer(tmp_path, monkeypatch):
    """The built-in tokenizer decides the output, so the built-in checkpoint's SHA256SUMS lists it
    and ``verify=True`` accepts the checkpoint as written."""
    import flashrt
    from flashrt.engine.run import builtin_checkpoint

    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path))
    path = builtin_checkpoint("tiny", quiet=True)
    sums = (path / "SHA256SUMS").read_text()
    assert "tokenizer.json" in sums and "tokenizer_config.json" in sums
    model = flashrt.load(path, verify=True)
    assert model.tokenizer is not None


def test_load_attaches_the_checkpoints_tokenizer(cfg, weights, tok_dir, tmp_path):
    """``flashrt.load`` gives the model the checkpoint's ``tokenizer.json`` (and its config: the same
    ids as the tokenizer loaded alone); a file that is not a tokenizer is the load's error, naming it."""
    import shutil

    import flashrt
    from flashrt.graphs import checkpoint

    path = checkpoint.save(weights, cfg, tmp_path / "ck")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, path / name)
    model = flashrt.load(path)
    assert isinstance(model.tokenizer, Tokenizer) and model.tokenizer.vocab_size == 320
    assert model.tokenizer.encode("hello") == load_tokenizer(tok_dir).encode("hello")
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizers file"):
        flashrt.load(path)
