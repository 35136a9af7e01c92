"""Text in the serving engine: output text decoded token by token (multi-byte characters split
over tokens never show half, stop strings cut it, deltas add up to ``decode``); the engine picks
the model's tokenizer; chat requests render exactly as ``chat_format.encode`` of the same
conversation (roles, text parts, tools, tool results, thinking and effort switches)."""
import random
import re
from types import SimpleNamespace

import pytest

from flashrt.engine import outputs
from flashrt.engine.request import Request, Sequence
from flashrt.engine.sampling import SamplingParams
from flashrt.engine.server import chat
from flashrt.engine.server.protocol import BadRequest, ChatCompletionRequest
from flashrt.engine.text import token_str, tokenizer_for
from flashrt.graphs import chat_format
from flashrt.graphs.tokenizer import ByteTokenizer

from serving_text import byte_ids, tiny_tokenizer

PIECES = ["北京", "😀", " the", "天气", "é", "x", "!"]


def feed(tok, ids, params, eos=None):
    """Run ``ids`` through the engine's finish checks and outputs as if sampled; the deltas seen."""
    req = Request("r", [1], params, 0, params.max_tokens)
    seq = Sequence(req, 0, None)
    req.seqs.append(seq)
    deltas = []
    for t in ids:
        seq.tokens.append(t)
        outputs.check_finish(seq, tok, eos, 10_000)
        deltas.append(outputs.completion(seq))
        if seq.finish_reason is not None:
            break
    return seq, deltas


def random_ids(tok, rnd):
    text = "".join(rnd.choice(PIECES) for _ in range(rnd.randint(4, 12)))
    pieces = [byte_ids(tok, ch) if rnd.random() < 0.5 else tok.encode(ch, add_special_tokens=False) for ch in text]
    return text, [t for p in pieces for t in p]


@pytest.mark.parametrize("trial", range(4))
def test_deltas_are_whole_characters_and_add_up(trial):
    tok, rnd = tiny_tokenizer(), random.Random()
    text, ids = random_ids(tok, rnd)
    seq, outs = feed(tok, ids, SamplingParams(max_tokens=len(ids)))
    assert seq.finish_reason == "length" and outs[-1].text == text == tok.decode(ids)
    assert "".join(o.delta_text for o in outs) == text and "\ufffd" not in text
    for k, o in enumerate(outs):  # after each token: every whole character so far, nothing of the next
        assert o.text == b"".join(tok.token_bytes(t) for t in ids[:k + 1]).decode("utf-8", "ignore")


def test_stop_string_and_eos_through_the_decoder():
    tok, rnd = tiny_tokenizer(), random.Random()
    text, ids = random_ids(tok, rnd)
    stop = "天气"
    ids = ids + byte_ids(tok, "a天气b") + [tok.eos_id]
    seq, outs = feed(tok, ids, SamplingParams(max_tokens=len(ids), stop=[stop]), eos=tok.eos_id)
    assert seq.finish_reason == "stop" and seq.stop_reason == stop
    full = text + "a天气b"
    assert outs[-1].text == full[:full.find(stop)]
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    seq, outs = feed(tok, tok.encode("ok 😀", add_special_tokens=False) + [tok.eos_id], SamplingParams(max_tokens=9),
                     eos=tok.eos_id)
    assert (seq.finish_reason, seq.stop_reason, outs[-1].text) == ("stop", tok.eos_id, "ok 😀")


def test_engine_takes_the_models_tokenizer():
    tok = tiny_tokenizer()
    assert tokenizer_for(SimpleNamespace(tokenizer=tok)) is tok
    assert isinstance(tokenizer_for(SimpleNamespace()), ByteTokenizer)
    assert tokenizer_for(SimpleNamespace(tokenizer=tok), ByteTokenizer()) is not tok
    with pytest.raises(ValueError, match="tokenizer: expected a flashrt.graphs.tokenizer tokenizer"):
        tokenizer_for(SimpleNamespace(), object())
    strs = [token_str(tok, i) for i in range(tok.vocab_size)]
    assert len(set(strs)) == len(strs)  # logprob keys never merge two tokens
    assert token_str(ByteTokenizer(), 300) == "token_id:300" and token_str(ByteTokenizer(), 0xE5) == "bytes:\\xe5"


CONVERSATION = [
    {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
    {"role": "user", "content": "weather in 北京?"},
    {"role": "assistant", "content": "", "reasoning_content": "use the tool",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "北京"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny 😀"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def request(**fields):
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": CONVERSATION, **fields})


@pytest.mark.parametrize("fields, want", [
    ({}, dict(thinking=True, effort=None)),
    ({"reasoning_effort": "low"}, dict(thinking=True, effort="low")),
    ({"reasoning_effort": "medium"}, dict(thinking=True, effort="high")),
    ({"reasoning_effort": 90}, dict(thinking=True, effort=90)),
    ({"reasoning_effort": "none"}, dict(thinking=False, effort=None)),
    ({"chat_template_kwargs": {"thinking": False}}, dict(thinking=False, effort=None)),
    ({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "max"}, dict(thinking=False, effort="max")),
    ({"tools": TOOLS}, dict(thinking=True, effort=None, tools=TOOLS)),
    ({"tools": TOOLS, "tool_choice": "none"}, dict(thinking=True, effort=None)),
    ({"chat_template_kwargs": {"drop_thinking": False}}, dict(thinking=True, effort=None, drop_thinking=False)),
])
def test_chat_prompt_is_chat_format_encode(fields, want):
    tok = tiny_tokenizer()
    req = request(**fields)
    opts = chat.options(req)
    got = chat.prompt_ids(tok, [m.model_dump(exclude_none=True) for m in req.messages], opts)
    messages = [{**m, "role": "system", "content": "Be brief."} if m["role"] == "developer" else m for m in CONVERSATION]
    assert got == chat_format.encode(tok, messages, **want)
    assert got[0] == tok.bos_id and ("Reasoning Effort" in tok.decode(got)) == want["thinking"]


@pytest.mark.parametrize("fields, param, part", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "expected one of ['none', 'minimal'"),
    ({"reasoning_effort": 101}, "reasoning_effort", "got 101"),
    ({"chat_template_kwargs": {"foo": True}}, "chat_template_kwargs.foo", "unknown key"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking", "expected a bool"),
    ({"tool_choice": "required"}, "tool_choice", "only 'auto' and 'none'"),
])
def test_bad_chat_options(fields, param, part):
    with pytest.raises(BadRequest, match=re.escape(part)) as e:
        chat.options(request(**fields))
    assert e.value.param == param


def test_bad_chat_messages():
    tok = tiny_tokenizer()
    opts = chat.ChatOptions()
    cases = [([{"role": "wizard", "content": "x"}], "messages[0].role"),
             ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0].image_url"),
             ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content"),
             ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
                 {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}],
              "messages[1].tool_calls[0].function.arguments")]
    for messages, param in cases:
        with pytest.raises(BadRequest) as e:
            chat.prompt_ids(tok, messages, opts)
        assert e.value.param == param and param in str(e.value)
    with pytest.raises(BadRequest, match="the chat format needs the tokens"):
        chat.prompt_ids(ByteTokenizer(), [{"role": "user", "content": "q"}], opts)
