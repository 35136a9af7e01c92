"""The DeepSeek-V4.1 chat format: messages -> prompt text / token ids, generated ids -> a message.

Messages are OpenAI-style dicts: ``system`` / ``user`` (``content``: a str, or a list of text
parts and, in user turns, ``image_url`` / ``image`` parts, each rendered as one image placeholder
``<｜deepseek_image｜>`` where it stands; :func:`images` lists them), ``assistant`` (``content``,
``reasoning_content``, ``tool_calls`` ``[{"id", "type": "function", "function": {"name",
"arguments"}}]``) and ``tool`` (``tool_call_id``, ``content``). The layout follows the release's
``encoding/encoding.py`` (docs/chat.md):

- ``BOS``, then each turn: a system turn is ``<｜System｜>`` + its text (+ the tool schemas); a user
  turn ``<｜User｜>`` + its text; an assistant turn its reasoning + ``</think>`` (thinking mode,
  when kept) + content + a DSML tool-call block + ``EOS``. Tool results merge into the following
  user turn as ``<tool_result>...</tool_result>`` blocks (joined by a blank line, ordered as the
  calls were), as do consecutive user turns.
- After a user turn (or a system turn past the first) that an assistant turn follows, or that
  ends the conversation: ``<｜Assistant｜>`` then ``<think>`` (thinking mode) or ``</think>``.
- Thinking mode opens the first turn with ``<｜System｜>Reasoning Effort: N ...`` (N in 1..100;
  ``low`` / ``high`` / ``max`` = 50 / 75 / 100, default ``high``). Reasoning of assistant turns
  before the last user turn is dropped unless ``drop_thinking=False`` or tools are defined.
"""
from __future__ import annotations

import copy

from .chat_tools import ChatFormatError, parse_tool_calls, render_tool_calls, render_tools

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT, SYSTEM = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"
THINK, END_THINK, DSML = "<think>", "</think>", "｜DSML｜"
LATEST_REMINDER, IMAGE = "<｜latest_reminder｜>", "<｜deepseek_image｜>"
# (token, special): the chat tokens a tokenizer has as single entries; think / DSML are plain
# added tokens, so they survive decoding with skip_special_tokens
CHAT_TOKENS = ((USER, True), (ASSISTANT, True), (SYSTEM, True), (THINK, False), (END_THINK, False),
               (DSML, False), (LATEST_REMINDER, True), (IMAGE, True))
REQUIRED_TOKENS = (BOS, EOS, USER, ASSISTANT, SYSTEM, THINK, END_THINK)
TOOL_CALLS_START = "\n\n<" + DSML + " calls"
EFFORT_LEVELS = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = "high"
EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
ROLES = ("system", "user", "assistant", "tool")

__all__ = ["ChatFormatError", "render", "encode", "parse", "decode_message", "effort_budget", "images"]


def effort_budget(effort) -> int:
    """The reasoning budget 1..100 of ``effort`` (an int, ``low`` / ``high`` / ``max`` or None)."""
    effort = DEFAULT_EFFORT if effort is None else effort
    if isinstance(effort, str) and effort in EFFORT_LEVELS:
        return EFFORT_LEVELS[effort]
    if isinstance(effort, str) and effort.isdigit():
        effort = int(effort)
    if isinstance(effort, bool) or not isinstance(effort, int) or not 1 <= effort <= 100:
        raise ValueError(f"effort: expected an int in 1..100 or one of {list(EFFORT_LEVELS)}, got {effort!r}")
    return effort


def _part_image(part: dict, where: str):
    """The image source of an ``image_url`` / ``image`` content part."""
    if part.get("type") == "image":
        return part.get("image")
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}.image_url: expected a URL string or {{'url': ...}}, got {part.get('image_url')!r}")
    return url


def _parts(content, where: str, role: str) -> tuple[str, list]:
    """A list of OpenAI-style content parts -> (text with one image placeholder per image part,
    the images in order). Parts: ``{"type": "text", "text"}``, ``{"type": "image_url",
    "image_url": {"url"}}`` and ``{"type": "image", "image"}`` (images in user turns only)."""
    text, images = "", []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            if IMAGE in part["text"]:
                raise ValueError(f"{where}[{k}]: the image placeholder {IMAGE} cannot appear in text")
            text += part["text"]
        elif kind in ("image_url", "image") and role == "user":
            images.append(_part_image(part, f"{where}[{k}]"))
            text += IMAGE
        else:
            raise ValueError(f"{where}[{k}]: expected a text part (or an image_url / image part in a user "
                             f"turn), got {part!r:.80}")
    return text, images


def images(messages) -> list:
    """The images of ``messages``' content parts, in the order their placeholders are rendered."""
    return [img for i, m in enumerate(messages or ()) if isinstance(m, dict) and isinstance(m.get("content"), list)
            for img in _parts(m["content"], f"messages[{i}].content", m.get("role"))[1]]


def _checked(messages, tools) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list of message dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]: expected a dict with role in {list(ROLES)}, got {m!r}")
        parts = None
        if isinstance(m.get("content"), list):
            parts, _ = _parts(m["content"], f"messages[{i}].content", m["role"])
            m = {**m, "content": None}
        for key in ("content", "reasoning_content"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key}: expected a str, got {type(m[key]).__name__}")
        if IMAGE in (m.get("content") or "") + (m.get("reasoning_content") or ""):
            raise ValueError(f"messages[{i}]: the image placeholder {IMAGE} cannot appear in text")
        m = copy.deepcopy(m)
        if parts is not None:
            m["content"] = parts
        out.append(m)
    if tools:
        if out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": ""})
        out[0]["tools"] = list(out[0].get("tools") or []) + list(tools)
    return out


def _merge_user_turns(messages: list[dict]) -> list[dict]:
    """Tool results and consecutive user turns become one user turn of text blocks; tool results
    follow the order of the calls of the assistant turn before them."""
    out, order = [], {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {c.get("id"): k for k, c in enumerate(m.get("tool_calls") or []) if c.get("id")}
        if m["role"] not in ("user", "tool"):
            out.append(m)
            continue
        block = ((1, order.get(m.get("tool_call_id"), 0), f"<tool_result>{m.get('content') or ''}</tool_result>")
                 if m["role"] == "tool" else (0, 0, m.get("content") or ""))
        if out and out[-1]["role"] == "user":
            out[-1]["blocks"].append(block)
        else:
            out.append({"role": "user", "blocks": [block]})
    for m in out:
        if m["role"] == "user":  # stable: tool results keep their slots, sorted among themselves
            results = iter(sorted((b for b in m["blocks"] if b[0]), key=lambda b: b[1]))
            m["content"] = "\n\n".join((next(results) if b[0] else b)[2] for b in m["blocks"])
    return out


def _last_user(messages: list[dict]) -> int:
    """Index of the last turn that asks for an answer: a user turn or a system turn past the first."""
    return max((i for i, m in enumerate(messages) if m["role"] == "user" or (m["role"] == "system" and i > 0)),
               default=-1)


def _turn(i: int, msgs: list[dict], thinking: bool, keep: bool, last_user: int, effort_line: str) -> str:
    m, role = msgs[i], msgs[i]["role"]
    text = SYSTEM + effort_line if i == 0 and (effort_line or role == "system") else ""
    if role == "system":
        text += (SYSTEM if i > 0 else "") + (m.get("content") or "")
        if m.get("tools"):
            text += "\n\n" + render_tools(m["tools"], DSML, THINK, END_THINK)
    elif role == "user":
        text += USER + m["content"]
    else:
        if thinking and (keep or i > last_user):
            text += (m.get("reasoning_content") or "") + END_THINK
        text += (m.get("content") or "") + render_tool_calls(m.get("tool_calls"), DSML, f"messages[{i}]") + EOS
    follows = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
    if follows in (None, "assistant") and (role == "user" or (role == "system" and i > 0)):
        text += ASSISTANT + (THINK if thinking and (keep or i >= last_user) else END_THINK)
    return text


def render(messages, *, thinking: bool = True, effort=None, tools=None, drop_thinking: bool = True,
           add_bos: bool = True) -> str:
    """The prompt text of ``messages``; when the last turn is a user turn it ends with the
    assistant header, ready for generation. ``tools``: OpenAI tool definitions, added to the
    first system turn (one is inserted when there is none)."""
    budget = effort_budget(effort)  # checked in both modes
    effort_line = EFFORT_LINE.format(budget) if thinking else ""
    msgs = _merge_user_turns(_checked(messages, tools))
    keep = not drop_thinking or any(m.get("tools") for m in msgs)
    last_user = _last_user(msgs)
    return (BOS if add_bos else "") + "".join(_turn(i, msgs, thinking, keep, last_user, effort_line)
                                              for i in range(len(msgs)))


def check_tokenizer(tokenizer) -> None:
    """``ValueError`` unless each control token of the format is one entry of ``tokenizer``."""
    missing = [t for t in REQUIRED_TOKENS if tokenizer.token_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer: the chat format needs the tokens {missing} as single entries; "
                         f"{tokenizer.describe()} has none of them")


def encode(tokenizer, messages, **options) -> list[int]:
    """Token ids of :func:`render` ``(messages, **options)`` (the text carries its own BOS)."""
    check_tokenizer(tokenizer)
    return tokenizer.encode(render(messages, **options), add_special_tokens=False)


def _lenient(text: str, thinking: bool) -> dict:
    reasoning, sep, rest = text.partition(END_THINK) if thinking else ("", "", text)
    if thinking and not sep:
        reasoning, rest = reasoning.split(EOS, 1)[0], ""
    content = rest.split(EOS, 1)[0]
    calls = []
    if TOOL_CALLS_START in content:
        head, _, block = content.partition(TOOL_CALLS_START)
        try:
            calls, tail = parse_tool_calls(block, DSML)
            content = head + tail
        except ChatFormatError:
            calls = []
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls}


def parse(text: str, *, thinking: bool = True, strict: bool = True) -> dict:
    """The assistant message of generated ``text`` (what follows the assistant header): reasoning
    up to ``</think>`` (thinking mode), content, DSML tool calls, then ``EOS`` or the end.

    ``strict``: a malformed text raises :class:`ChatFormatError`; otherwise the best reading
    (unclosed reasoning is all reasoning, an unparsable tool-call block stays in the content)."""
    if not isinstance(text, str):
        raise ValueError(f"text: expected a str, got {type(text).__name__}")
    if not strict:
        return _lenient(text, thinking)
    reasoning, rest = "", text
    if thinking:
        reasoning, sep, rest = text.partition(END_THINK)
        if not sep or TOOL_CALLS_START in reasoning:
            raise ChatFormatError(f"reasoning is not closed by {END_THINK}")
    content, sep, tail = rest.partition(EOS)
    if tail:
        raise ChatFormatError(f"text continues after {EOS}: {tail[:40]!r}")
    calls = []
    if TOOL_CALLS_START in content:
        content, _, block = content.partition(TOOL_CALLS_START)
        calls, after = parse_tool_calls(block, DSML)
        if after:
            raise ChatFormatError(f"text continues after the tool calls: {after[:40]!r}")
    for token in (BOS, EOS, THINK, END_THINK, DSML):
        if token in content or token in reasoning:
            raise ChatFormatError(f"unexpected {token} in the {'content' if token in content else 'reasoning'}")
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls}


def decode_message(tokenizer, ids, *, thinking: bool = True, strict: bool = False) -> dict:
    """:func:`parse` of the text of generated ``ids`` (special tokens kept)."""
    return parse(tokenizer.decode(ids, skip_special_tokens=False), thinking=thinking, strict=strict)

