"""The built-in tiny model's tokenizer (a byte-level BPE of 320 ids with the chat tokens), built
once per test process without touching the checkpoint cache."""
import functools


@functools.cache
def tiny_tokenizer():
    from flashrt.graphs.builtin_tokenizer import build, tokenizer_config
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.tokenizer import Tokenizer

    cfg = shipped_config("tiny")
    return Tokenizer(build(cfg.vocab_size), tokenizer_config(cfg.max_seq_len), "built-in tiny")


def byte_ids(tok, text: str) -> list[int]:
    """``text`` as one token per UTF-8 byte (the BPE's byte tokens): multi-byte characters arrive
    in pieces."""
    from flashrt.graphs.tokenizer import byte_level_chars

    char_of = {b: c for c, b in byte_level_chars().items()}
    return [tok.token_id(char_of[b]) for b in text.encode()]
