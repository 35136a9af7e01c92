"""The serving engine's text interface: which tokenizer it uses and how a token reads in logprobs.

The engine speaks the interface of ``flashrt.graphs.tokenizer`` (``encode`` with the config's BOS
rule, ``decode``, ``stream()`` for incremental text, ``eos_id``, ``token_bytes``): the model's own
tokenizer (``model.tokenizer``, set by ``flashrt.load``), else UTF-8 bytes
(:class:`~flashrt.graphs.tokenizer.ByteTokenizer`). Everything the engine and the server need
beyond that interface lives here.
"""
from __future__ import annotations

from flashrt.graphs.tokenizer import ByteTokenizer

REQUIRED = ("encode", "decode", "stream", "token_bytes")


def tokenizer_for(model, tokenizer=None):
    """``tokenizer`` if given, else the model's, else UTF-8 bytes; ValueError when it lacks the interface."""
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    tok = tok if tok is not None else ByteTokenizer()
    missing = [name for name in REQUIRED if not callable(getattr(tok, name, None))]
    if missing:
        raise ValueError(f"tokenizer: expected a flashrt.graphs.tokenizer tokenizer (with {list(REQUIRED)}), "
                         f"got a {type(tok).__name__} without {missing}")
    return tok


def eos_id(tokenizer) -> int | None:
    """The id that ends generation by default (None: no EOS)."""
    return getattr(tokenizer, "eos_id", None)


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The bytes of one token, None for an id past the tokenizer's vocabulary."""
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None and token_id >= vocab and not isinstance(tokenizer, ByteTokenizer):
        return None
    return tokenizer.token_bytes(token_id)


def token_str(tokenizer, token_id: int) -> str:
    """One token as text for logprobs, distinct for distinct tokens: its text when its bytes are
    whole UTF-8, else ``bytes:\\xNN...`` (part of a character), ``token_id:N`` for an id the
    tokenizer has no bytes for (vLLM's spellings)."""
    data = token_bytes(tokenizer, token_id)
    if data is None or (isinstance(tokenizer, ByteTokenizer) and token_id >= 256):
        return f"token_id:{token_id}"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
