"""Text <-> token ids: a checkpoint's ``tokenizer.json`` + ``tokenizer_config.json`` through the
``tokenizers`` library, or UTF-8 bytes (ids 0-255) when the checkpoint has no ``tokenizer.json``.

BOS / EOS handling follows ``tokenizer_config.json``: with ``add_bos_token`` / ``add_eos_token``
present, :meth:`Tokenizer.encode` adds exactly those (and nothing the file's post-processor would
add); without them the post-processor of ``tokenizer.json`` decides. Special tokens are the
added tokens marked ``special``; ``bos_token`` / ``eos_token`` / ``pad_token`` name theirs (a
string or an ``AddedToken`` dict). :meth:`Tokenizer.stream` decodes one id at a time and never
emits part of a UTF-8 character; its pieces joined equal :meth:`Tokenizer.decode` of all ids.
"""
from __future__ import annotations

import codecs
import functools
import json
import logging
from pathlib import Path

TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
log = logging.getLogger("flashrt")


@functools.cache
def byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet: the printable character standing for each byte -> that byte
    (printable Latin-1 bytes stand for themselves, the others for code points 256 and up)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in kept:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_text(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{CONFIG_FILE}: {key} must be a string or an AddedToken object, got {value!r}")
    return value


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the BOS / EOS rules and special tokens of its config."""

    kind = "tokenizer.json"

    def __init__(self, backend, config: dict | None = None, source: str = ""):
        self.backend, self.config, self.source = backend, dict(config or {}), source
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0  # ids lie in [0, vocab_size)
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.bos_token, self.eos_token, self.pad_token = (_token_text(self.config, k)
                                                          for k in ("bos_token", "eos_token", "pad_token"))
        self.bos_id, self.eos_id, self.pad_id = (self._id_of(t, k) for t, k in (
            (self.bos_token, "bos_token"), (self.eos_token, "eos_token"), (self.pad_token, "pad_token")))
        self.explicit = "add_bos_token" in self.config or "add_eos_token" in self.config
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_id is not None
        self.add_eos = bool(self.config.get("add_eos_token", False)) and self.eos_id is not None
        self._bytes = None

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        """``tokenizer.json`` (and ``tokenizer_config.json`` when present) of directory ``path``."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        try:
            backend = Backend.from_file(str(path / TOKENIZER_FILE))
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exception for a bad file
            raise ValueError(f"{path / TOKENIZER_FILE}: not a tokenizers file ({exc})") from exc
        config = {}
        if (path / CONFIG_FILE).exists():
            try:
                config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path / CONFIG_FILE}: not JSON ({exc})") from exc
            if not isinstance(config, dict):
                raise ValueError(f"{path / CONFIG_FILE}: expected a JSON object, got {type(config).__name__}")
        return cls(backend, config, str(path / TOKENIZER_FILE))

    def _id_of(self, token: str | None, key: str) -> int | None:
        if token is None:
            return None
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise ValueError(f"{CONFIG_FILE}: {key} {token!r} is not in the vocabulary of {TOKENIZER_FILE}")
        return tid

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` when it is one vocabulary entry, else None."""
        return self.backend.token_to_id(token)

    def describe(self) -> str:
        return f"{self.source} ({self.vocab_size:,} ids)"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS / EOS as the config says."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        if not self.explicit:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            ids = [self.bos_id] * self.add_bos + ids + [self.eos_id] * self.add_eos
        return ids

    def check_ids(self, ids) -> list[int]:
        ids = list(ids)
        bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"ids: expected ints in [0, {self.vocab_size}), got {bad!r}")
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return self.backend.decode(self.check_ids(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        """An incremental decoder: ``push(id)`` returns the text that token completes."""
        if self._byte_level():
            return ByteStream(self, self._token_bytes(), skip_special_tokens)
        return WindowStream(self, skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (under a byte-level decoder possibly part of a UTF-8
        character; otherwise the UTF-8 of its decoded text)."""
        token_id = self.check_ids([token_id])[0]
        if self._byte_level():
            return self._token_bytes()[token_id]
        return self.backend.decode([token_id], skip_special_tokens=False).encode()

    def _byte_level(self) -> bool:
        from tokenizers import decoders

        return isinstance(self.backend.decoder, decoders.ByteLevel)

    def _token_bytes(self) -> list[bytes]:
        """Each id's bytes under the byte-level decoder (a token spelled in the byte alphabet maps
        through it, any other token, e.g. an added one, is its own UTF-8)."""
        if self._bytes is None:
            chars, table = byte_level_chars(), [b""] * self.vocab_size
            for token, i in self.backend.get_vocab(with_added_tokens=True).items():
                table[i] = bytes(chars[c] for c in token) if all(c in chars for c in token) else token.encode()
            self._bytes = table
        return self._bytes


class ByteTokenizer:
    """The fallback without ``tokenizer.json``: UTF-8 bytes are the ids; an id above 255 decodes
    to U+FFFD (no special tokens, no BOS)."""

    kind = "utf-8 bytes"
    vocab_size, special_ids = 256, frozenset()
    bos_id = eos_id = pad_id = bos_token = eos_token = pad_token = None

    def __init__(self, source: str = ""):
        self.source = source

    def describe(self) -> str:
        return "UTF-8 bytes (no tokenizer.json)"

    def token_id(self, token: str) -> int | None:
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        stream = self.stream()
        return "".join(stream.push(i) for i in ids) + stream.finish()

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return ByteStream(self, [bytes([b]) for b in range(256)], skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The byte of an id below 256; the UTF-8 of U+FFFD (what it decodes to) above."""
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"token_id: expected an int >= 0, got {token_id!r}")
        return bytes([token_id]) if token_id < 256 else "\ufffd".encode()


class StreamDecoder:
    """Incremental detokenization: ``push(id)`` -> newly completed text ('' while a character is
    incomplete), ``finish()`` -> what is left (a trailing incomplete sequence becomes U+FFFD)."""

    def push(self, token_id: int) -> str:
        raise NotImplementedError

    def finish(self) -> str:
        raise NotImplementedError


class ByteStream(StreamDecoder):
    """Byte-level tokenizers: each id's bytes through an incremental UTF-8 decoder."""

    def __init__(self, tokenizer, table: list[bytes], skip_special_tokens: bool):
        self.tokenizer, self.table = tokenizer, table
        self.skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"token_id: expected an int >= 0, got {token_id!r}")
        if token_id >= len(self.table):
            if isinstance(self.tokenizer, ByteTokenizer):  # not a byte: one replacement character
                return self.utf8.decode(b"", final=True) + "\ufffd"
            raise ValueError(f"token_id: expected an id below {len(self.table)}, got {token_id}")
        return "" if token_id in self.skip else self.utf8.decode(self.table[token_id])

    def finish(self) -> str:
        return self.utf8.decode(b"", final=True)


class WindowStream(StreamDecoder):
    """Any other decoder: decode a short window of ids and emit its new text once it no longer
    ends in U+FFFD (an incomplete character); ``finish`` emits the rest as a full decode would."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.start = self.read = 0  # window start; end of the ids already emitted

    def _text(self, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[self.start:end], skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(self.tokenizer.check_ids([token_id])[0])
        done, text = self._text(self.read), self._text()
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.start, self.read = self.read, len(self.ids)
        return text[len(done):]

    def finish(self) -> str:
        return self._text()[len(self._text(self.read)):]


def load_tokenizer(path) -> Tokenizer | ByteTokenizer:
    """The tokenizer of checkpoint directory ``path``; UTF-8 bytes (with a warning) without one."""
    path = Path(path)
    if (path / TOKENIZER_FILE).exists():
        return Tokenizer.from_dir(path)
    log.warning("%s has no %s: text is encoded as UTF-8 bytes (ids 0-255) and ids above 255 decode to U+FFFD",
                path, TOKENIZER_FILE)
    return ByteTokenizer(str(path))


def attach_tokenizer(model, path) -> Tokenizer | ByteTokenizer:
    """Set ``model.tokenizer`` from checkpoint directory ``path``; a tokenizer whose ids reach past
    the model's ``vocab_size`` is an error."""
    tok = load_tokenizer(path)
    if isinstance(tok, Tokenizer) and tok.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"{tok.source}: token ids reach {tok.vocab_size - 1}, past the model's "
                         f"vocab_size {model.cfg.vocab_size}")
    model.tokenizer = tok
    return tok
