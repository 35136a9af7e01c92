"""Tool definitions and DSML tool calls of the DeepSeek-V4.1 chat format (see chat_format.py).

A call block, after the content and a blank line::

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="NAME">
    <｜DSML｜ parameter name="KEY" string="true">raw text</｜DSML｜ parameter>
    <｜DSML｜ parameter name="KEY2" string="false">JSON value</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

Tool definitions go into the system turn: a ``## Tools`` section that explains the block and lists
each function's schema as one JSON line. The explanation here is this project's wording; the
structure (tags, attribute names, string flag, schema lines) is the release's.
"""
from __future__ import annotations

import json
import re


class ChatFormatError(ValueError):
    """Generated text that does not follow the chat format (names what was expected)."""


TOOLS_SECTION = """## Tools

You can call the tools listed below. To call tools, write one block of this form:

<{d} calls>
<{d} invoke name="TOOL_NAME">
<{d} parameter name="PARAMETER_NAME" string="true|false">VALUE</{d} parameter>
</{d} invoke>
</{d} calls>

Write one invoke element per call and one parameter element per argument. A string argument is \
written as is with string="true"; any other value (number, boolean, array, object) is written as \
JSON with string="false".

When reasoning is on ({think}), finish it with {end_think} before any tool call or answer; \
otherwise answer or call tools right after {end_think}.

### Tool schemas

{schemas}

Call only these tools, with the parameters their schemas define.
"""


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _function(tool, where: str) -> dict:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}: expected {{'type': 'function', 'function': {{'name': ..., ...}}}}, got {tool!r}")
    return fn


def render_tools(tools, dsml: str, think: str, end_think: str) -> str:
    """The ``## Tools`` section for OpenAI-format ``tools`` (or bare function dicts)."""
    schemas = "\n".join(_json(_function(t, f"tools[{i}]")) for i, t in enumerate(tools))
    return TOOLS_SECTION.format(d=dsml, think=think, end_think=end_think, schemas=schemas)


def call_arguments(call, where: str) -> tuple[str, dict]:
    """(name, arguments dict) of an OpenAI-format tool call (``arguments`` a JSON object text or a dict)."""
    fn = _function(call, where)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as exc:
            raise ValueError(f"{where}.function.arguments: not JSON ({exc})") from exc
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments: expected a JSON object, got {args!r}")
    return fn["name"], args


def render_tool_calls(calls, dsml: str, where: str) -> str:
    """The DSML block of ``calls`` with its leading blank line ('' for no calls)."""
    if not calls:
        return ""
    invokes = []
    for k, call in enumerate(calls):
        name, args = call_arguments(call, f"{where}.tool_calls[{k}]")
        params = [f'<{dsml} parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
                  f"{v if isinstance(v, str) else _json(v)}</{dsml} parameter>" for key, v in args.items()]
        invokes.append(f'<{dsml} invoke name="{name}">\n' + "\n".join(params) + f"\n</{dsml} invoke>")
    return f"\n\n<{dsml} calls>\n" + "\n".join(invokes) + f"\n</{dsml} calls>"


def _expect(text: str, pos: int, what: str) -> int:
    if not text.startswith(what, pos):
        raise ChatFormatError(f"tool calls: expected {what!r} at {text[pos:pos + 40]!r}")
    return pos + len(what)


def parse_tool_calls(text: str, dsml: str) -> tuple[list[dict], str]:
    """Parse a call block from just after ``<｜DSML｜ calls`` -> (OpenAI-format calls, the text after it)."""
    d = re.escape(dsml)
    invoke = re.compile(rf'<{d} invoke name="([^"\n]*)">\n')
    param = re.compile(rf'<{d} parameter name="([^"\n]*)" string="(true|false)">(.*?)</{d} parameter>\n', re.S)
    end_invoke, end_calls = f"</{dsml} invoke>", f"</{dsml} calls>"
    pos, calls = _expect(text, 0, ">\n"), []
    while not text.startswith(end_calls, pos):
        m = invoke.match(text, pos)
        if not m:
            raise ChatFormatError(f"tool calls: expected <{dsml} invoke name=\"...\"> at {text[pos:pos + 40]!r}")
        pos, args = m.end(), {}
        if text.startswith("\n" + end_invoke, pos):  # a call without arguments
            pos += 1
        while not text.startswith(end_invoke, pos):
            p = param.match(text, pos)
            if not p:
                raise ChatFormatError(f"tool calls: expected a parameter of {m.group(1)!r} at {text[pos:pos + 40]!r}")
            key, is_str, value = p.groups()
            if key in args:
                raise ChatFormatError(f"tool calls: parameter {key!r} of {m.group(1)!r} given twice")
            try:
                args[key] = value if is_str == "true" else json.loads(value)
            except ValueError as exc:
                raise ChatFormatError(f"tool calls: parameter {key!r} of {m.group(1)!r} is not JSON: {value!r}") from exc
            pos = p.end()
        pos = _expect(text, pos + len(end_invoke), "\n")
        calls.append({"type": "function", "function": {"name": m.group(1), "arguments": _json(args)}})
    return calls, text[pos + len(end_calls):]
