"""Engram n-gram hashing: bucket layout (:class:`EngramLayout`), compressed-token map
(:class:`TokenMap`) and the rolling hash (:class:`EngramHasher`). Each position hashes the n-grams
(sizes 2..max_ngram) ending there, per head, into prime-sized row ranges of its layer's table."""
from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashrt import checks, ops

DEAD = -1  # history marker: no token (before the sequence start) or a dead position (image token)
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for n < 3.3e24


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin primality test (exact for every 64-bit ``n``)."""
    if n < 2 or any(n % p == 0 for p in _MR_BASES):
        return n in _MR_BASES
    r = ((n - 1) & (1 - n)).bit_length() - 1  # n - 1 = d * 2**r with d odd
    d = (n - 1) >> r
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(n_layers: int, max_ngram: int, n_heads: int, vocab_size: int) -> list[list[int]]:
    """Flat primes per layer in (n-gram size, head) order: for each layer, n-gram size and head,
    the smallest prime above ``current`` never handed out before (in any layer); ``current``
    restarts at ``vocab_size - 1`` for each (layer, n-gram size) and advances to each prime found."""
    used: set[int] = set()
    out: list[list[int]] = [[] for _ in range(n_layers)]
    for flat in out:
        for _ in range(max_ngram - 1):
            current = vocab_size - 1
            for _ in range(n_heads):
                current += 1
                while current in used or not is_prime(current):
                    current += 1
                used.add(current)
                flat.append(current)
    return out


def hash_multipliers(layer_id: int, max_ngram: int, compressed_vocab_size: int) -> tuple[int, ...]:
    """The ``max_ngram`` odd multipliers of one Engram layer (a numpy RNG seeded by the layer id)."""
    bound = max(1, (int(np.iinfo(np.int64).max) // compressed_vocab_size) // 2)
    draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=max_ngram, dtype=np.int64)
    return tuple(int(v) for v in draws * 2 + 1)


@dataclass(frozen=True)
class EngramLayout:
    """Per Engram layer: multipliers ``[max_ngram]``, primes and offsets ``[n_cols]``.

    ``primes[l]`` / ``offsets[l]`` are flat, n-gram-size-major and head-minor; the offsets are the
    exclusive running sum of the primes and ``num_embeddings[l]`` (table rows) is their sum.
    ``pad_id`` is a token id; its compressed id fills blocked lookback slots."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    head_dim: int
    compressed_vocab_size: int
    pad_id: int
    multipliers: tuple[tuple[int, ...], ...]
    primes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    num_embeddings: tuple[int, ...]

    @property
    def n_cols(self) -> int:
        """Hash ids per position and layer: ``(max_ngram - 1) * n_heads``."""
        return (self.max_ngram - 1) * self.n_heads

    @classmethod
    def from_config(cls, cfg) -> "EngramLayout | None":
        """The layout of ``cfg`` (a ``ModelConfig``), or None when it has no Engram layers.
        ``ValueError`` naming the key when ``engram_num_embeddings`` disagrees with the primes."""
        if not cfg.engram_layer_ids:
            return None
        for key in ("engram_compressed_vocab_size", "engram_vocab_size", "engram_n_heads"):
            if getattr(cfg, key) <= 0:
                raise ValueError(f"config key {key!r}: expected > 0, got {getattr(cfg, key)!r}")
        n, heads, cv = cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_compressed_vocab_size
        primes = bucket_primes(len(cfg.engram_layer_ids), n, heads, cfg.engram_vocab_size)
        rows = tuple(sum(p) for p in primes)
        if tuple(cfg.engram_num_embeddings) != rows:
            raise ValueError(f"config key 'engram_num_embeddings': expected {list(rows)} (sums of the "
                             f"bucket primes), got {list(cfg.engram_num_embeddings)}")
        return cls(layer_ids=tuple(cfg.engram_layer_ids), max_ngram=n, n_heads=heads,
                   head_dim=cfg.engram_head_dim, compressed_vocab_size=cv, pad_id=cfg.engram_pad_id,
                   multipliers=tuple(hash_multipliers(lid, n, cv) for lid in cfg.engram_layer_ids),
                   primes=tuple(map(tuple, primes)), num_embeddings=rows,
                   offsets=tuple(tuple(int(v) for v in np.cumsum([0, *p[:-1]])) for p in primes))


_WS_RUN = re.compile(r"[ \t\r\n]+")
# Unicode White_Space (what Strip removes); unlike str.strip() this leaves U+001C..U+001F alone
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + \
    "\u2028\u2029\u202f\u205f\u3000"


def normalize_token(text: str) -> str:
    """The compressed-vocabulary key of a decoded token (see :meth:`TokenMap.from_tokens`)."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = _WS_RUN.sub(" ", "".join(c.lower() for c in s if not unicodedata.category(c).startswith("M")))
    if s == " ":
        return s  # a token that is only whitespace keeps one space instead of stripping to ""
    return s.strip(_WHITE_SPACE) or text


class TokenMap:
    """Token id -> compressed id: the identity (``table`` None) or a lookup table."""

    def __init__(self, compressed_vocab_size: int, table=None):
        self.compressed_vocab_size = int(compressed_vocab_size)
        self.table = None if table is None else torch.as_tensor(np.asarray(table, dtype=np.int64))
        self._on: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def identity(cls, compressed_vocab_size: int) -> "TokenMap":
        """Ids pass through unchanged; they must lie in ``[0, compressed_vocab_size)``."""
        return cls(compressed_vocab_size)

    @classmethod
    def from_tokens(cls, tokens: list[str], raw: list[str] | None = None) -> "TokenMap":
        """Build the map from each token id's decoded text, ids in first-seen order of the keys.

        Key: NFKC, NFD, drop combining marks (general category M*), lowercase (per character),
        runs of space/tab/CR/LF to one space, strip Unicode White_Space (a token that is exactly
        one space by then keeps ``" "``; one that strips to nothing is keyed by its text). Text
        containing U+FFFD (a partial UTF-8 byte token) is keyed by its raw token string,
        ``raw[i]`` when given, else the text itself."""
        if raw is not None and len(raw) != len(tokens):
            raise ValueError(f"raw: expected {len(tokens)} entries, got {len(raw)}")
        keys: dict[str, int] = {}
        table: list[int] = []
        for i, text in enumerate(tokens):
            key = (text if raw is None else raw[i]) if "\ufffd" in text else normalize_token(text)
            table.append(keys.setdefault(key, len(keys)))
        return cls(len(keys), table)

    @classmethod
    def from_file(cls, path: str, cfg) -> "TokenMap":
        """Load ``map[token_id] = compressed_id`` from a JSON list or ``.npy`` int array, checked
        against ``cfg.vocab_size`` (length) and ``cfg.engram_compressed_vocab_size`` (values)."""
        is_npy = str(path).endswith(".npy")
        arr = np.load(path, allow_pickle=False) if is_npy else np.asarray(json.loads(Path(path).read_text()))
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"{path}: expected a 1-D int array, got shape {arr.shape} dtype {arr.dtype}")
        if len(arr) != cfg.vocab_size:
            raise ValueError(f"{path}: expected vocab_size={cfg.vocab_size} entries, got {len(arr)}")
        cv = cfg.engram_compressed_vocab_size
        if len(arr) and (arr.min() < 0 or arr.max() >= cv):
            raise ValueError(f"{path}: values must lie in [0, engram_compressed_vocab_size={cv})")
        return cls(cv, arr)

    def __call__(self, ids: torch.Tensor, name: str = "tokens") -> torch.Tensor:
        """Compressed ids (int64, same shape); ``ValueError`` naming ``name`` for an id out of range."""
        limit = self.compressed_vocab_size if self.table is None else len(self.table)
        lo, hi = checks.value_range(ids) if ids.numel() and checks.values_checked() else (0, -1)
        if lo < 0 or hi >= limit:
            raise ValueError(f"{name}: token ids must lie in [0, {limit}), got [{lo}, {hi}]")
        if self.table is None:
            return ids.to(torch.int64)
        if ids.device not in self._on:
            self._on[ids.device] = self.table.to(ids.device)
        return self._on[ids.device][ids]


def _need(name: str, x, dtype: torch.dtype, shape: tuple | None) -> None:
    """``ValueError`` naming ``name`` unless ``x`` is a ``dtype`` tensor of ``shape`` (None: any 2-D)."""
    if not (isinstance(x, torch.Tensor) and x.dtype == dtype
            and (x.dim() == 2 if shape is None else tuple(x.shape) == shape)):
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a {dtype} tensor {shape or '[B, S]'}, got {got}")


class EngramHasher:
    """Hash ids of the n-grams ending at each position, for every Engram layer of ``layout``."""

    def __init__(self, layout: EngramLayout, token_map: TokenMap):
        if token_map.compressed_vocab_size != layout.compressed_vocab_size:
            raise ValueError(f"token_map: compressed vocab size {token_map.compressed_vocab_size} != "
                             f"engram_compressed_vocab_size {layout.compressed_vocab_size}")
        self.layout, self.token_map = layout, token_map
        self.pad = int(token_map(torch.tensor([layout.pad_id]), "engram_pad_id")[0])
        # multipliers [L, N], primes [L, C], offsets [L, C]; copies per device in _on
        self._cpu = tuple(torch.tensor(t) for t in (layout.multipliers, layout.primes, layout.offsets))
        self._on: dict[torch.device, tuple] = {}

    def start_history(self, batch: int, device=None) -> torch.Tensor:
        """History of fresh sequences: ``[batch, max_ngram - 1]`` all DEAD (no earlier token)."""
        return torch.full((batch, self.layout.max_ngram - 1), DEAD, dtype=torch.int64, device=device)

    def hash_ids(self, tokens: torch.Tensor, history: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Hash ids ``[B, S, n_layers, n_cols]`` of ``tokens [B, S]`` and the next chunk's history.

        ``history [B, max_ngram-1]``: compressed ids of the tokens before this chunk, oldest first,
        DEAD (-1) where there is none (None: fresh sequences). ``mask [B, S]``: False marks dead
        positions (image tokens); they enter the history as DEAD, so a lookback shift reaching one,
        and every older shift, reads pad. Dead positions still get ids (the model zeroes their
        gate). The rolling hash and buckets are ``flashrt.ops.engram_hash`` (products wrap in
        int64; the bucket is ``torch.remainder(h, prime) + offset``, non-negative for a positive
        prime even when ``h`` is negative)."""
        _need("tokens", tokens, torch.int64, None)
        if history is None:
            history = self.start_history(tokens.shape[0], tokens.device)
        _need("history", history, torch.int64, (tokens.shape[0], self.layout.max_ngram - 1))
        cv = self.layout.compressed_vocab_size
        lo, hi = checks.value_range(history) if history.numel() and checks.values_checked() else (DEAD, DEAD)
        if lo < DEAD or hi >= cv:
            raise ValueError(f"history: values must be -1 (DEAD) or compressed ids below {cv}")
        comp = self.token_map(tokens, "tokens")
        if mask is not None:
            _need("mask", mask, torch.bool, tuple(tokens.shape))
            comp = torch.where(mask.to(comp.device), comp, DEAD)
        seq = torch.cat([history.to(comp.device), comp], dim=1)  # [B, N-1+S]
        if comp.device not in self._on:
            self._on[comp.device] = tuple(t.to(comp.device) for t in self._cpu)
        mult, primes, offsets = self._on[comp.device]
        ids = ops.engram_hash(seq, mult, primes, offsets, self.pad)
        return ids, seq[:, seq.shape[1] - history.shape[1]:]
