"""Response bodies from engine outputs, without a server: SSE chunks of n = 2 choices ending at
different steps; completion logprob offsets; chat messages parsed from ids of the model's chat
format (reasoning_content, content, OpenAI tool_calls, finish_reason "tool_calls"), whole and
streamed token by token (the deltas add up to the whole message, never half a character)."""
import json
import random

import pytest

from flashrt.engine.request import CompletionOutput, RequestOutput, TokenLogprob
from flashrt.engine.server import chat
from flashrt.engine.server.responses import Renderer
from flashrt.graphs import chat_format
from flashrt.graphs.tokenizer import ByteTokenizer

from serving_text import byte_ids, tiny_tokenizer


def out(texts, finished, deltas, lps=None):
    outs = [CompletionOutput(i, t, list(t.encode()), lps, f, delta_text=d, delta_token_ids=list(d.encode()),
                             delta_logprobs=[TokenLogprob(b, -1.0, []) for b in d.encode()] if lps is not None else [])
            for i, (t, f, d) in enumerate(zip(texts, finished, deltas))]
    return RequestOutput("r", [1, 2], outs, all(finished))


def events(render, outputs):
    got = []
    for o in outputs:
        got += [json.loads(e[6:]) for e in render.chunks(0, o)]
    return got


def test_chat_chunks_end_each_choice_once():
    render = Renderer("chat", "id", "tiny", ByteTokenizer(), n=2, thinking=False)
    steps = [out(["a", "x"], [None, None], ["a", "x"]), out(["ab", "xy"], ["length", None], ["b", "y"]),
             out(["ab", "xyz"], ["length", None], ["", "z"]), out(["ab", "xyzw"], ["length", "stop"], ["", "w"])]
    chunks = events(render, steps)
    per = {0: [], 1: []}
    for c in chunks:
        (choice,) = c["choices"]
        per[choice["index"]].append(choice)
    for i, text in ((0, "ab"), (1, "xyzw")):
        assert "".join(ch["delta"]["content"] for ch in per[i]) == text
        assert [ch["finish_reason"] for ch in per[i]][-1] is not None
        assert sum(ch["finish_reason"] is not None for ch in per[i]) == 1
        assert sum("role" in ch["delta"] for ch in per[i]) == 1 and "role" in per[i][0]["delta"]


def test_completion_chunk_logprob_offsets():
    tok = tiny_tokenizer()
    ids = byte_ids(tok, "h北") + tok.encode("lo", add_special_tokens=False)  # 北: three byte tokens
    render = Renderer("completion", "id", "tiny", tok, n=1)
    lps = lambda ids: [TokenLogprob(t, -1.0, [(t, -1.0)]) for t in ids]
    steps = [RequestOutput("r", [1], [CompletionOutput(0, "h", ids[:2], [], None, "h", ids[:2], lps(ids[:2]))], False),
             RequestOutput("r", [1], [CompletionOutput(0, "h北lo", ids, [], "length", "北lo", ids[2:], lps(ids[2:]))], True)]
    chunks = events(render, steps)
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "h北lo"
    assert tokens[:4] == ["h", "bytes:\\xe5", "bytes:\\x8c", "bytes:\\x97"] and len(set(tokens)) == len(tokens)
    assert offsets == [0, 1, 1, 1] + [2 + k for k in range(len(ids) - 4)]  # 北 starts at 1, completed by its last byte


def assistant_ids(tok, assistant: dict, thinking: bool) -> list[int]:
    """The ids a model writes for ``assistant`` after a user turn: the rendered conversation minus
    the rendered prompt, tokenized."""
    user = [{"role": "user", "content": "weather in 北京?"}]
    full = chat_format.render(user + [assistant], thinking=thinking)
    prompt = chat_format.render(user, thinking=thinking)
    assert full.startswith(prompt)
    return tok.encode(full[len(prompt):], add_special_tokens=False)


def run_engine_text(tok, ids):
    """The texts the engine's outputs carry after each id (incremental decoder, EOS left out)."""
    stream, text, texts = tok.stream(), "", []
    for k, t in enumerate(ids):
        if t == tok.eos_id:
            text += stream.finish()
        else:
            text += stream.push(t)
        texts.append(text)
    return texts


CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "北京", "days": 3, "units": ["c"]})}}


@pytest.mark.parametrize("thinking", [True, False])
def test_tool_call_message_from_chat_format_ids(thinking):
    tok = tiny_tokenizer()
    assistant = {"role": "assistant", "reasoning_content": "need the 天气 tool 😀", "content": "checking",
                 "tool_calls": [CALL]}
    ids = assistant_ids(tok, assistant, thinking)
    assert ids[-1] == tok.eos_id
    text = run_engine_text(tok, ids)[-1]
    render = Renderer("chat", "id", "tiny", tok, n=1, thinking=thinking)
    c = CompletionOutput(0, text, ids, None, "stop", stop_reason=tok.eos_id)
    body = render.full([RequestOutput("r", [1], [c], True)])
    (choice,) = body["choices"]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] == "checking"
    assert msg.get("reasoning_content") == ("need the 天气 tool 😀" if thinking else None)
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == json.loads(CALL["function"]["arguments"])


@pytest.mark.parametrize("thinking, with_call", [(True, True), (True, False), (False, True)])
def test_streamed_chat_deltas_add_up_to_the_message(thinking, with_call):
    tok, rnd = tiny_tokenizer(), random.Random()
    words = ["北京", "😀", "rain", " ", "</", "think", "\n", "<｜DSML｜", "天气", "ok"]
    reasoning = "".join(rnd.choice(words) for _ in range(12))
    while "</think>" in reasoning:
        reasoning = reasoning.replace("</think>", "")
    content = "".join(rnd.choice(words) for _ in range(12))
    assistant = {"role": "assistant", "reasoning_content": reasoning, "content": content,
                 "tool_calls": [CALL] if with_call else None}
    ids = assistant_ids(tok, assistant, thinking)
    ids = ids[:-1] + byte_ids(tok, "é😀") + ids[-1:] if not with_call else ids  # characters in pieces, before EOS
    texts = run_engine_text(tok, ids)
    render = Renderer("chat", "id", "tiny", tok, n=1, thinking=thinking)
    chunks = []
    for k, text in enumerate(texts):
        last = k == len(ids) - 1
        c = CompletionOutput(0, text, ids[:k + 1], None, "stop" if last else None, delta_token_ids=[ids[k]])
        chunks += events(render, [RequestOutput("r", [1], [c], last)])
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    whole = chat.message(texts[-1], thinking)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (whole.get("reasoning_content") or "")
    assert "".join(d.get("content") or "" for d in deltas) == (whole["content"] or "")
    assert not any("\ufffd" in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)
    assert (whole.get("reasoning_content") == reasoning) if thinking else True
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == (["get_weather"] if with_call else [])
    assert chunks[-1]["choices"][0]["finish_reason"] == ("tool_calls" if with_call else "stop")


def test_reasoning_split_while_streaming():
    assert chat.split_partial("abc</thi", True) == ("abc", "")
    assert chat.split_partial("abc</think>hello\n\n<｜DS", True) == ("abc", "hello")
    assert chat.split_partial("abc</think>hello\n\n<｜DSML｜ calls>\n<", True) == ("abc", "hello")
    assert chat.split_partial("no think here", False) == ("", "no think here")
    assert chat.message("plan</think>answer", True) == {"role": "assistant", "content": "answer",
                                                         "reasoning_content": "plan"}
    assert chat.message("unclosed plan", True)["reasoning_content"] == "unclosed plan"
