"""flashrt run's text path in-process: tokenizer files of the built-in models, prompt and chat
encoding, decoded reports, progress of prefill and decode."""
import json

import pytest

import flashrt
from flashrt.engine import generate
from flashrt.engine import run as run_mod
from flashrt.graphs import chat_format
from flashrt.graphs.tokenizer import ByteTokenizer, Tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_builtin_checkpoint_gets_its_tokenizer_also_when_cached_without(cache):
    path = run_mod.builtin_checkpoint("tiny", quiet=True)
    assert Tokenizer.from_dir(path).vocab_size == json.loads((path / "config.json").read_text())["vocab_size"]
    (path / "tokenizer.json").unlink()  # a checkpoint cached before tokenizers existed
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert run_mod.builtin_checkpoint("tiny", quiet=True) == path
    assert (path / "tokenizer.json").exists() and weights.stat().st_mtime_ns == mtime
    model = flashrt.load(path)  # the Python API finds it too
    assert isinstance(model.tokenizer, Tokenizer) and model.tokenizer.eos_id == 1


def test_prompt_and_chat_reports_decode_with_the_tokenizer(cache):
    r = run_mod.run("tiny", "héllo wörld", 4, quiet=True)
    tok = Tokenizer.from_dir(cache / "models" / "tiny-seed0")
    assert r["prompt_tokens"] == len(tok.encode("héllo wörld")) and r["message"] is None
    assert r["new_text"] == tok.decode(r["new_token_ids"])
    c = run_mod.run("tiny", max_new_tokens=4, quiet=True, chat="Hi", system="S", thinking=False, effort=60)
    ids = chat_format.encode(tok, run_mod.chat_messages("Hi", "S"), thinking=False)
    assert c["prompt_tokens"] == len(ids) and c["chat"]["effort"] is None
    assert c["message"] == chat_format.parse(tok.decode(c["new_token_ids"]), thinking=False, strict=False)


def test_bad_text_input_fails_before_loading(cache, monkeypatch):
    monkeypatch.setattr(run_mod, "load_model", lambda *a, **k: pytest.fail("loaded"))
    for kwargs, match in [(dict(chat=""), "chat: expected a non-empty message"),
                          (dict(chat="hi", effort="extreme"), "effort: expected"),
                          (dict(system="S"), "system: a system prompt needs --chat")]:
        with pytest.raises(ValueError, match=match):
            run_mod.run("tiny", quiet=True, **kwargs)
    with pytest.raises(ValueError, match="prompt: expected a non-empty str"):
        run_mod.encode_request(ByteTokenizer(), 320, "", None, None, True, None)

    class Wide(ByteTokenizer):  # a tokenizer with ids the model does not have
        def encode(self, text, add_special_tokens=True):
            return [999]

    with pytest.raises(ValueError, match="token id 999 is past the model's vocab_size 320"):
        run_mod.encode_request(Wide(), 320, "x", None, None, True, None)


def test_generate_reports_prefill_and_decode_progress(model):
    calls = []
    out = generate(model, [[5, 6, 7], [8, 9]], 3, progress=lambda *a: calls.append(a))
    assert calls[:3] == [("prefill", 0, 5), ("prefill", 2, 5), ("prefill", 5, 5)]  # one step per prompt length
    assert calls[3:] == [("decode", 1, 3), ("decode", 2, 3), ("decode", 3, 3)]
    eos = out.tokens[0][0]
    calls.clear()
    generate(model, [[5, 6, 7]], 5, eos_token_id=eos, progress=lambda *a: calls.append(a))
    assert calls[-1] == ("decode", 5, 5) and len(calls) == 3  # stopped at EOS: the bar completes
