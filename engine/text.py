"""Text in and out of the serving engine: the byte-level codec used until the model's tokenizer is
wired in, and the chat template (one function, :func:`chat_prompt`, so the model's real chat format
can replace it)."""
from __future__ import annotations

ROLES = ("system", "user", "assistant", "tool", "developer")


class ByteTokenizer:
    """Text as UTF-8 bytes (ids 0-255), like ``flashrt run``; ids >= 256 decode to nothing."""

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"vocab_size: byte-level prompts need a vocabulary of >= 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_str(self, token: int) -> str:
        """One token as text for logprobs: its character, else ``<0xNN>`` (a byte that is not a
        character alone) or ``<|id|>`` (an id past the bytes), so distinct tokens stay distinct."""
        if token < 128:
            return chr(token)
        return f"<0x{token:02X}>" if token < 256 else f"<|{token}|>"


def chat_prompt(messages: list[dict]) -> str:
    """The built-in chat template: one ``<|role|>`` line per message, then the assistant's turn.

    ``messages``: OpenAI-style dicts with ``role`` and ``content`` (a string, or a list of
    ``{"type": "text", "text": ...}`` parts)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages: expected a non-empty list of messages, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role: expected one of {list(ROLES)}, got {m.get('role') if isinstance(m, dict) else m!r:.80}")
        out.append(f"<|{m['role']}|>{message_text(m.get('content'), i)}\n")
    return "".join(out) + "<|assistant|>"


def message_text(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"messages[{i}].content: expected a string or a list of text parts, got {content!r:.80}")
