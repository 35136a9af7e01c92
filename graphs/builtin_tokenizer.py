"""The tokenizer of the built-in models: a byte-level BPE trained with ``tokenizers`` on a text
generated here, deterministically, with exactly the model's ``vocab_size`` ids.

Layout, as the published vocabulary: ids 0, 1, 2 are BOS, EOS and pad; then the 256 byte tokens
and the learned merges; then the chat-format tokens (``chat_format.CHAT_TOKENS``); a text too
small for the merges asked for is topped up with ``<｜place▁holder▁no▁N｜>`` special tokens. The
training text: a few English sentences (repeated, so the first merges are English ones), numbers,
code, Chinese characters, emoji and pseudo-words in proportion to the vocabulary.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from flashrt.jit import atomic_write

from .chat_format import BOS, CHAT_TOKENS, EOS, PAD
from .tokenizer import CONFIG_FILE, TOKENIZER_FILE
from .verify import SUMS, add_to_sums

FIRST = (BOS, EOS, PAD)
MIN_VOCAB = len(FIRST) + 256 + len(CHAT_TOKENS)
ENGLISH = """The quick brown fox jumps over the lazy dog. A model reads the prompt, then writes one token
at a time. Each answer should be short, clear and correct. What is the weather like today? It is
sunny in the morning and it rains in the evening. Please count from one to ten, and then tell me
a story about a small cat that lives near the river. The tokenizer turns text into numbers and the
numbers back into text. Thank you for the help; I will try again tomorrow."""
CODE = """def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, 1))\n"""


def training_text(vocab_size: int, seed: int = 0) -> list[str]:
    """The lines the built-in BPE learns from (deterministic in ``vocab_size`` and ``seed``)."""
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    han = [chr(c) for c in range(0x4E00, 0x4E00 + 600)]
    emoji = [chr(c) for c in range(0x1F600, 0x1F640)]
    lines = [ENGLISH] * 8 + [CODE] * 4 + [" ".join(str(n) for n in range(k, k + 50)) for k in range(0, 1000, 50)]
    words = []
    for _ in range(max(64, vocab_size * 7 // 10)):
        kind = rng.random()
        if kind < 0.8:
            words.append("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(2, 6))))
        elif kind < 0.95:
            words.append("".join(rng.choice(han) for _ in range(rng.randint(1, 4))))
        else:
            words.append("".join(rng.choice(emoji) for _ in range(rng.randint(1, 2))))
    lines += [" ".join(words[i:i + 16]) for i in range(0, len(words), 16)]
    lines += [" ".join(rng.choice(words) for _ in range(12)) for _ in range(len(words) // 20)]
    return lines


def build(vocab_size: int, seed: int = 0):
    """A ``tokenizers.Tokenizer`` with ids ``0 .. vocab_size - 1`` (see the module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size: the built-in tokenizer needs at least {MIN_VOCAB} ids, got {vocab_size!r}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(CHAT_TOKENS), show_progress=False,
                                  special_tokens=[AddedToken(t, special=True, normalized=False) for t in FIRST],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(vocab_size, seed), trainer)
    for token, special in CHAT_TOKENS:
        tok.add_tokens([AddedToken(token, special=special, normalized=False)])
    filler = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    tok.add_tokens([AddedToken(f"<｜place▁holder▁no▁{k}｜>", special=True, normalized=False) for k in range(filler)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def tokenizer_config(max_length: int) -> dict:
    return {"add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
            "clean_up_tokenization_spaces": False, "model_max_length": max_length,
            "tokenizer_class": "PreTrainedTokenizerFast"}


def ensure_builtin_tokenizer(path, cfg, seed: int = 0, tok=None) -> bool:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` for ``cfg`` into checkpoint directory
    ``path`` unless ``tokenizer.json`` is there; True when written. Each file is written whole
    or not at all; the config goes first, so a present ``tokenizer.json`` means both are.
    ``tok``: ``build(cfg.vocab_size, seed)`` when already made (e.g. on a thread while the weights
    were made); built here otherwise."""
    path = Path(path)
    if (path / TOKENIZER_FILE).exists():
        return False
    if tok is None:
        tok = build(cfg.vocab_size, seed)
    elif tok.get_vocab_size(with_added_tokens=True) != cfg.vocab_size:
        raise ValueError(f"tok: expected a tokenizer of {cfg.vocab_size} ids (the config's vocab_size), "
                         f"got {tok.get_vocab_size(with_added_tokens=True)}")
    atomic_write(path / CONFIG_FILE, (json.dumps(tokenizer_config(cfg.max_seq_len), ensure_ascii=False, indent=1)
                                      + "\n").encode())
    atomic_write(path / TOKENIZER_FILE, tok.to_str().encode())
    if (path / SUMS).exists():  # the tokenizer decides the output: verify=True checks it too
        add_to_sums(path, [CONFIG_FILE, TOKENIZER_FILE])
    return True
