"""The DeepSeek-V4.1 chat format: prompts built token by token from the format's rules, effort
levels, thinking / non-thinking, tools and tool results, render -> parse round trips (text and ids)."""
import json
import random

import pytest

from flashrt.graphs import chat_format as cf
from flashrt.graphs.builtin_tokenizer import ensure_builtin_tokenizer
from flashrt.graphs.chat_format import (ASSISTANT, BOS, DSML, END_THINK, EOS, SYSTEM, THINK, USER, ChatFormatError,
                                        parse, render)
from flashrt.graphs.chat_tools import call_arguments
from flashrt.graphs.config import shipped_config
from flashrt.graphs.tokenizer import ByteTokenizer, Tokenizer


def effort(n):
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def call(name, args, cid=None):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def block(*invokes):
    return f"\n\n<{DSML} calls>\n" + "\n".join(invokes) + f"\n</{DSML} calls>"


def invoke(name, *params):
    return f'<{DSML} invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML} invoke>"


def param(key, value, string=True):
    return f'<{DSML} parameter name="{key}" string="{"true" if string else "false"}">{value}</{DSML} parameter>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    ensure_builtin_tokenizer(path, shipped_config("tiny"))
    return Tokenizer.from_dir(path)


def test_first_turns_and_effort_levels():
    user = [{"role": "user", "content": "Q"}]
    assert render(user) == BOS + SYSTEM + effort(75) + USER + "Q" + ASSISTANT + THINK
    for level, n in [("low", 50), ("high", 75), ("max", 100), (1, 1), (42, 42), ("100", 100)]:
        assert render(user, effort=level) == BOS + SYSTEM + effort(n) + USER + "Q" + ASSISTANT + THINK
    sys_user = [{"role": "system", "content": "S"}, *user]
    assert render(sys_user, effort="max") == BOS + SYSTEM + effort(100) + "S" + USER + "Q" + ASSISTANT + THINK
    assert render(sys_user, thinking=False) == BOS + SYSTEM + "S" + USER + "Q" + ASSISTANT + END_THINK
    assert render(user, thinking=False, add_bos=False) == USER + "Q" + ASSISTANT + END_THINK
    for bad in (0, 101, "medium", 2.5, True):
        with pytest.raises(ValueError, match="effort: expected an int in 1..100"):
            render(user, effort=bad, thinking=False)  # checked in both modes


def test_history_reasoning_is_dropped_before_the_last_user_turn():
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "reasoning_content": "r1", "content": "a1"},
            {"role": "user", "content": "q2"}]
    head = BOS + SYSTEM + effort(75) + USER + "q1" + ASSISTANT
    assert render(msgs) == head + END_THINK + "a1" + EOS + USER + "q2" + ASSISTANT + THINK
    assert render(msgs, drop_thinking=False) == head + THINK + "r1" + END_THINK + "a1" + EOS + USER + "q2" + ASSISTANT + THINK
    chat = BOS + USER + "q1" + ASSISTANT + END_THINK + "a1" + EOS + USER + "q2" + ASSISTANT + END_THINK
    assert render(msgs, thinking=False) == chat
    # a finished conversation ends with the assistant's EOS, no new header
    assert render(msgs[:2]) == head + THINK + "r1" + END_THINK + "a1" + EOS


def test_system_turns_user_merging_and_tool_results():
    mid = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
           {"role": "system", "content": "MID"}, {"role": "user", "content": "q2"}, {"role": "user", "content": "q3"}]
    assert render(mid, thinking=False) == (BOS + USER + "q1" + ASSISTANT + END_THINK + "a1" + EOS + SYSTEM + "MID"
                                           + USER + "q2\n\nq3" + ASSISTANT + END_THINK)
    assert render(mid[:3], thinking=False).endswith(EOS + SYSTEM + "MID" + ASSISTANT + END_THINK)
    calls = [call("lookup", {"query": "first"}, "a"), call("lookup", {"query": "second", "n": 2}, "b")]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "b", "content": "rb"}, {"role": "tool", "tool_call_id": "a", "content": "ra"},
            {"role": "user", "content": "and?"}]
    calls_text = block(invoke("lookup", param("query", "first")),
                       invoke("lookup", param("query", "second"), param("n", "2", string=False)))
    assert render(msgs, thinking=False) == (BOS + USER + "q" + ASSISTANT + END_THINK + calls_text + EOS + USER
                                            + "<tool_result>ra</tool_result>\n\n<tool_result>rb</tool_result>\n\nand?"
                                            + ASSISTANT + END_THINK)


def test_tools_go_into_the_system_turn_and_keep_reasoning():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "reasoning_content": "r1", "content": "a1"},
            {"role": "user", "content": "q2"}]
    text = render(msgs, tools=tools)
    head = BOS + SYSTEM + effort(75) + "\n\n## Tools\n"
    assert text.startswith(head) and json.dumps(tools[0]["function"]) + "\n" in text
    assert f"<{DSML} calls>" in text and 'string="true|false"' in text
    assert text.endswith(USER + "q1" + ASSISTANT + THINK + "r1" + END_THINK + "a1" + EOS + USER + "q2" + ASSISTANT + THINK)
    with_system = render([{"role": "system", "content": "S"}, *msgs], tools=tools, thinking=False)
    assert with_system.startswith(BOS + SYSTEM + "S\n\n## Tools\n")


_ALPHABET = "abcxyz ABC 0123 .,;:!?'\"<>/\\{}[]\n\t é中文字😀👍"


def _text(rng, n=12):
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, n)))


def _value(rng, depth=0):
    kind = rng.randrange(7 if depth < 2 else 5)
    return [lambda: _text(rng), lambda: rng.randint(-10**6, 10**6), lambda: rng.random() * 100, lambda: rng.random() < .5,
            lambda: None, lambda: [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            lambda: {f"k{i}": _value(rng, depth + 1) for i in range(rng.randint(0, 3))}][kind]()


def _assistant(rng, thinking):
    calls = [call(f"tool_{rng.randrange(5)}", {f"arg{j}": _value(rng) for j in range(rng.randint(0, 4))}, f"c{k}")
             for k in range(rng.choice([0, 0, 1, 2, 3]))]
    return {"role": "assistant", "content": _text(rng, 30), "tool_calls": calls,
            "reasoning_content": _text(rng, 30) if thinking else ""}


def _same(parsed, msg):
    assert parsed["content"] == msg["content"] and parsed["reasoning_content"] == msg["reasoning_content"]
    assert [call_arguments(c, "got") for c in parsed["tool_calls"]] == [call_arguments(c, "want") for c in msg["tool_calls"]]


@pytest.mark.parametrize("thinking", [True, False])
def test_render_then_parse_gives_the_message_back(tok, thinking):
    rng = random.Random(7 + thinking)
    for trial in range(40):
        convo = [{"role": "system", "content": _text(rng)}] if rng.random() < .5 else []
        convo.append({"role": "user", "content": _text(rng, 20)})
        answer = _assistant(rng, thinking)
        opts = dict(thinking=thinking, effort=rng.choice([None, "low", "max", rng.randint(1, 100)]))
        prompt, full = render(convo, **opts), render([*convo, answer], **opts)
        assert full.startswith(prompt)
        _same(parse(full[len(prompt):], thinking=thinking), answer)
        # the same through token ids: the prompt's ids are a prefix, the rest decodes to the message
        ids_prompt, ids_full = cf.encode(tok, convo, **opts), cf.encode(tok, [*convo, answer], **opts)
        assert ids_full[:len(ids_prompt)] == ids_prompt and ids_prompt[0] == tok.bos_id
        assert tok.decode(ids_full) == full
        _same(cf.decode_message(tok, ids_full[len(ids_prompt):], thinking=thinking, strict=True), answer)


def test_parse_a_model_style_output():
    text = ("The user wants the weather; 北京 needs a call.\n" + END_THINK + "Let me check."
            + block(invoke("get_weather", param("city", "北京"), param("days", "3", string=False),
                           param("units", '{"temp": "C", "wind": ["km/h"]}', string=False)),
                    invoke("now"))
            + EOS)
    msg = parse(text)
    assert msg["reasoning_content"] == "The user wants the weather; 北京 needs a call.\n"
    assert msg["content"] == "Let me check." and msg["role"] == "assistant"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "now"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {
        "city": "北京", "days": 3, "units": {"temp": "C", "wind": ["km/h"]}}
    assert json.loads(msg["tool_calls"][1]["function"]["arguments"]) == {}
    assert parse("plain answer" + EOS, thinking=False) == {
        "role": "assistant", "content": "plain answer", "reasoning_content": "", "tool_calls": []}
    assert parse("r" + END_THINK + "cut short")["content"] == "cut short"  # no EOS yet: still a message


@pytest.mark.parametrize("text,match", [
    ("never closed" + EOS, "not closed by </think>"),
    ("r" + END_THINK + "a" + EOS + "more", "continues after"),
    ("r" + END_THINK + "a" + block(invoke("f", param("x", "1", string=False))) + "tail" + EOS, "continues after the tool calls"),
    ("r" + END_THINK + "a" + block(invoke("f", param("x", "1"), param("x", "2"))), "given twice"),
    ("r" + END_THINK + "a" + block(invoke("f", param("x", "{oops", string=False))), "not JSON"),
    ("r" + END_THINK + "a\n\n<" + DSML + " calls>\n<" + DSML + " invoke>", "expected"),
    ("r" + END_THINK + "a " + THINK + " b" + EOS, "unexpected <think> in the content"),
])
def test_strict_parse_rejects_malformed_text(text, match):
    with pytest.raises(ChatFormatError, match=match):
        parse(text)


def test_lenient_parse_keeps_what_it_can():
    assert parse("still thinking", strict=False)["reasoning_content"] == "still thinking"
    broken = "r" + END_THINK + "a\n\n<" + DSML + " calls>\n<garbage" + EOS + "junk"
    msg = parse(broken, strict=False)
    assert msg["content"] == "a\n\n<" + DSML + " calls>\n<garbage" and msg["tool_calls"] == []


def test_bad_messages_are_clear_errors():
    cases = [([], "messages: expected a non-empty list"), ([{"role": "robot", "content": "x"}], "messages\\[0\\]: expected a dict"),
             ([{"role": "user", "content": 5}], "messages\\[0\\].content: expected a str"),
             ([{"role": "user", "content": "see <｜deepseek_image｜>"}], "image placeholder"),
             ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call("f", [1, 2])]}],
              "tool_calls\\[0\\].function.arguments: expected a JSON object")]
    for msgs, match in cases:
        with pytest.raises(ValueError, match=match):
            render(msgs)
    with pytest.raises(ValueError, match="tools\\[0\\]: expected"):
        render([{"role": "user", "content": "q"}], tools=[{"type": "function"}])
    with pytest.raises(ValueError, match="chat format needs the tokens"):
        cf.encode(ByteTokenizer(), [{"role": "user", "content": "q"}])
