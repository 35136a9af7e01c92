"""``/v1/chat/completions`` in the model's chat format (``flashrt.graphs.chat_format``).

Requests: OpenAI messages (``developer`` is a system turn; content a string or text parts, in user
turns also ``image_url`` parts (:mod:`.images`), rendered as image placeholders where they stand;
assistant ``reasoning_content`` and ``tool_calls``; ``tool`` results), ``tools`` (function
definitions), ``reasoning_effort`` and ``chat_template_kwargs`` (``thinking`` / ``enable_thinking``,
``drop_thinking``) become :class:`ChatOptions` and prompt ids. Responses: the generated text split
into ``reasoning_content`` (vLLM's field), ``content`` and OpenAI ``tool_calls`` whole
(:func:`message`) or as stream deltas (:class:`ChatStream`), which add up to the whole message.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from flashrt.graphs import chat_format
from flashrt.graphs.chat_format import END_THINK, EOS, TOOL_CALLS_START

from .images import has_images
from .protocol import BadRequest

# OpenAI's levels onto the model's (low / high / max = 50 / 75 / 100): OpenAI's default "medium"
# is the model's default "high"; "none" turns thinking off
EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
TEMPLATE_KWARGS = ("thinking", "enable_thinking", "drop_thinking")


@dataclass
class ChatOptions:
    thinking: bool = True
    effort: str | int | None = None
    tools: list | None = None
    drop_thinking: bool = True


def options(req) -> ChatOptions:
    """The chat-format options of a ChatCompletionRequest (BadRequest naming the field)."""
    kwargs = req.chat_template_kwargs or {}
    for key, value in kwargs.items():
        if key not in TEMPLATE_KWARGS:
            raise BadRequest(f"chat_template_kwargs.{key}", f"chat_template_kwargs.{key}: unknown key "
                             f"(expected one of {list(TEMPLATE_KWARGS)})")
        if not isinstance(value, bool):
            raise BadRequest(f"chat_template_kwargs.{key}", f"chat_template_kwargs.{key}: expected a bool, got {value!r}")
    if "thinking" in kwargs and "enable_thinking" in kwargs and kwargs["thinking"] != kwargs["enable_thinking"]:
        raise BadRequest("chat_template_kwargs", "chat_template_kwargs: thinking and enable_thinking disagree")
    effort, thinking = req.reasoning_effort, kwargs.get("thinking", kwargs.get("enable_thinking"))
    if effort == "none":
        effort, thinking = None, False if thinking is None else thinking
    elif isinstance(effort, str) and effort in EFFORTS:
        effort = EFFORTS[effort]
    try:
        chat_format.effort_budget(effort)
    except ValueError:
        raise BadRequest("reasoning_effort", f"reasoning_effort: expected one of {['none', *EFFORTS]} or an int "
                         f"in 1..100, got {effort!r}") from None
    if req.tool_choice not in (None, "auto", "none"):
        raise BadRequest("tool_choice", f"tool_choice: only 'auto' and 'none' are supported, got {req.tool_choice!r:.80}")
    tools = None if req.tool_choice == "none" else req.tools
    return ChatOptions(thinking=True if thinking is None else thinking, effort=effort, tools=tools or None,
                       drop_thinking=kwargs.get("drop_thinking", True))


def _content(content, where: str, images: bool = False) -> str | list | None:
    """A message's content as the chat format takes it: a string, or (``images``: a user turn
    with image parts, checked by :mod:`.images`) the parts themselves."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if images and has_images(content):
        return content
    raise BadRequest(f"{where}.content", f"{where}.content: expected a string or a list of text parts (and "
                     f"image_url parts in a user turn), got {content!r:.80}")


def format_messages(messages) -> list[dict]:
    """OpenAI chat messages (dicts) -> the chat format's message dicts."""
    out = []
    for i, m in enumerate(messages):
        where, role = f"messages[{i}]", m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"{where}.role", f"{where}.role: expected one of ['system', 'developer', 'user', "
                             f"'assistant', 'tool'], got {role!r:.80}")
        msg = {"role": "system" if role == "developer" else role,
               "content": _content(m.get("content"), where, images=role == "user")}
        if role == "assistant":
            if m.get("reasoning_content") is not None:
                msg["reasoning_content"] = _content(m["reasoning_content"], where)
            if m.get("tool_calls"):
                msg["tool_calls"] = m["tool_calls"]
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    return out


def prompt_ids(tokenizer, messages, opts: ChatOptions) -> list[int]:
    """The prompt of a chat request: ``chat_format.encode`` of its messages and options."""
    try:
        return chat_format.encode(tokenizer, format_messages(messages), thinking=opts.thinking, effort=opts.effort,
                                  tools=opts.tools, drop_thinking=opts.drop_thinking)
    except BadRequest:
        raise
    except ValueError as exc:
        text = str(exc)
        param = text.split(":", 1)[0] if text.startswith(("messages", "tools")) else "messages"
        raise BadRequest(param.split(".")[0] if param.startswith("tools") else param, text) from None


def tool_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls with OpenAI ids."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", **c} for c in calls]


def message(text: str, thinking: bool) -> dict:
    """The assistant message of generated ``text`` (lenient: unclosed reasoning stays reasoning,
    a malformed tool-call block stays in the content)."""
    parsed = chat_format.parse(text, thinking=thinking, strict=False)
    calls = tool_calls(parsed["tool_calls"])
    msg = {"role": "assistant", "content": parsed["content"] if parsed["content"] or not calls else None}
    if thinking:
        msg["reasoning_content"] = parsed["reasoning_content"]
    if calls:
        msg["tool_calls"] = calls
    return msg


def finish_reason(reason: str | None, msg: dict) -> str | None:
    """OpenAI's "tool_calls" when a sequence that stopped by itself called tools."""
    return "tool_calls" if reason == "stop" and msg.get("tool_calls") else reason


def _held(text: str, markers) -> str:
    """``text`` without a tail that could still grow into one of ``markers``."""
    cut = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                cut = max(cut, k)
                break
    return text[:len(text) - cut]


def split_partial(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, content) of an unfinished ``text``: prefixes of what :func:`message` gives for
    any continuation (partial ``</think>``, tool-call or EOS markers held back)."""
    if thinking:
        reasoning, sep, rest = text.partition(END_THINK)
        if not sep:
            return _held(reasoning.split(EOS, 1)[0], (END_THINK, EOS)), ""
    else:
        reasoning, rest = "", text
    content = rest.split(EOS, 1)[0]
    if TOOL_CALLS_START in content:
        return reasoning, content.partition(TOOL_CALLS_START)[0]
    return reasoning, content if EOS in rest else _held(content, (TOOL_CALLS_START, EOS))


class ChatStream:
    """Stream deltas of one choice: ``delta(text, finished)`` -> (reasoning, content, final message or None)."""

    def __init__(self, thinking: bool):
        self.thinking = thinking
        self.sent_reasoning = self.sent_content = 0

    def delta(self, text: str, finished: bool) -> tuple[str, str, dict | None]:
        if finished:
            msg = message(text, self.thinking)
            reasoning, content = msg.get("reasoning_content") or "", msg["content"] or ""
        else:
            msg, (reasoning, content) = None, split_partial(text, self.thinking)
        out = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out[0], out[1], msg
