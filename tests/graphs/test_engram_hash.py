"""Engram hashing (graphs/engram_hash.py) against independent Python-int computations."""
import dataclasses
import json
import random
import time

import numpy as np
import pytest
import torch

from flashrt.graphs.config import ModelConfig, shipped_config
from flashrt.graphs.engram_hash import DEAD, EngramHasher, EngramLayout, TokenMap, is_prime

MASK64 = (1 << 64) - 1


def _wrap(x: int) -> int:
    """Python int -> the signed 64-bit value with the same low 64 bits."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def _trial_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def _naive_primes(n_layers, n_ngram, n_heads, vocab):
    """Primes per layer by the published rule, written as plainly as possible."""
    seen, out = [], []
    for _layer in range(n_layers):
        row = []
        for _ngram in range(2, n_ngram + 1):
            cur = vocab - 1
            for _head in range(n_heads):
                cand = cur + 1
                while cand in seen or not _trial_prime(cand):
                    cand += 1
                seen.append(cand)
                row.append(cand)
                cur = cand
        out.append(row)
    return out


def _config(layers=(1, 3), n=4, heads=2, vocab=1000, cv=320, pad=2):
    """The tiny config with other Engram settings and matching row counts."""
    rows = [sum(r) for r in _naive_primes(len(layers), n, heads, vocab)]
    return shipped_config("tiny").replace(
        engram_layer_ids=layers, engram_num_embeddings=rows, engram_max_ngram_size=n, engram_n_heads=heads,
        engram_vocab_size=vocab, engram_compressed_vocab_size=cv, engram_pad_id=pad)


def _ref_ids(layout, seq, positions, pad):
    """Ids at ``positions`` of ``seq`` (compressed ids, None = dead) with Python ints, looping."""
    out = []
    for p in positions:
        toks, blocked = [], False
        for s in range(layout.max_ngram):
            blocked = blocked or p - s < 0 or seq[p - s] is None
            toks.append(pad if blocked else seq[p - s])
        per_layer = []
        for li in range(len(layout.layer_ids)):
            m = layout.multipliers[li]
            h, cols = _wrap(toks[0] * m[0]), []
            for k in range(1, layout.max_ngram):
                h ^= _wrap(toks[k] * m[k])
                for head in range(layout.n_heads):
                    c = (k - 1) * layout.n_heads + head
                    cols.append(h % layout.primes[li][c] + layout.offsets[li][c])
            per_layer.append(cols)
        out.append(per_layer)
    return out


def test_is_prime_matches_trial_division():
    assert [n for n in range(-3, 30000) if is_prime(n)] == [n for n in range(30000) if _trial_prime(n)]


@pytest.mark.parametrize("n,want", [(2**61 - 1, True), (2**64 - 59, True), (16000057, True),
                                    (3215031751, False), (3825123056546413051, False), (561, False),
                                    ((2**31 - 1) * (2**31 - 1), False), (999999000001 * 3, False)])
def test_is_prime_large(n, want):
    assert is_prime(n) is want


@pytest.mark.parametrize("kw", [{}, dict(layers=(0, 2, 4), n=3, heads=3, vocab=500, cv=300),
                                dict(layers=(2,), n=2, heads=5, vocab=97, cv=50)])
def test_layout_matches_published_rule(kw):
    cfg = _config(**kw)
    lay = EngramLayout.from_config(cfg)
    primes = _naive_primes(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                           cfg.engram_vocab_size)
    assert [list(p) for p in lay.primes] == primes
    for li, lid in enumerate(cfg.engram_layer_ids):
        assert lay.offsets[li] == tuple(sum(primes[li][:c]) for c in range(len(primes[li])))
        assert lay.num_embeddings[li] == sum(primes[li]) == cfg.engram_num_embeddings[li]
        bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
        want = np.random.default_rng(10007 * lid).integers(0, bound, size=cfg.engram_max_ngram_size,
                                                           dtype=np.int64) * 2 + 1
        assert lay.multipliers[li] == tuple(int(v) for v in want)
        assert all(m % 2 == 1 for m in lay.multipliers[li])
    assert lay.n_cols == (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads


def test_shipped_configs_agree_and_released_numbers():
    t0 = time.perf_counter()
    lay = EngramLayout.from_config(shipped_config("v4.1-flash"))
    assert time.perf_counter() - t0 < 1.0
    assert lay.num_embeddings == (384006168, 384016682)
    assert lay.layer_ids == (1, 14) and lay.n_cols == 24 and lay.compressed_vocab_size == 99092
    flat = [p for layer in lay.primes for p in layer]
    assert len(flat) == len(set(flat)) == 48 and min(flat) > 16_000_000
    assert all(is_prime(p) for p in flat)
    assert EngramLayout.from_config(shipped_config("tiny")).num_embeddings == (6126, 6332)
    assert EngramLayout.from_config(shipped_config("small")) is not None


def test_layout_none_and_config_errors():
    assert EngramLayout.from_config(ModelConfig()) is None
    cfg = shipped_config("tiny")
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramLayout.from_config(cfg.replace(engram_num_embeddings=(6126, 6333)))
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramLayout.from_config(cfg.replace(engram_vocab_size=1010))
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramLayout.from_config(cfg.replace(engram_compressed_vocab_size=0))


def _random_inputs(rng, b, s, vocab, with_mask):
    tokens = torch.randint(0, vocab, (b, s), generator=rng)
    mask = torch.rand(b, s, generator=rng) > 0.25 if with_mask else None
    return tokens, mask


@pytest.mark.parametrize("kw", [{}, dict(layers=(0, 2, 4), n=3, heads=3, vocab=500, cv=300),
                                dict(layers=(2,), n=2, heads=5, vocab=97, cv=50)])
@pytest.mark.parametrize("b,s", [(1, 1), (2, 7), (3, 19)])
@pytest.mark.parametrize("mapped,with_mask", [(False, False), (True, True), (False, True)])
def test_hash_matches_python(rng, kw, b, s, mapped, with_mask):
    cfg = _config(**kw)
    lay = EngramLayout.from_config(cfg)
    cv = cfg.engram_compressed_vocab_size
    table = torch.randint(0, cv, (cfg.vocab_size,), generator=rng).tolist() if mapped else None
    hasher = EngramHasher(lay, TokenMap(cv, table))
    tokens, mask = _random_inputs(rng, b, s, cfg.vocab_size if mapped else cv, with_mask)
    ids, hist = hasher.hash_ids(tokens, mask=mask)
    assert ids.dtype == torch.int64 and tuple(ids.shape) == (b, s, len(lay.layer_ids), lay.n_cols)
    pad = table[cfg.engram_pad_id] if mapped else cfg.engram_pad_id
    for i in range(b):
        comp = [table[t] if mapped else t for t in tokens[i].tolist()]
        seq = [None if mask is not None and not mask[i, j] else c for j, c in enumerate(comp)]
        assert ids[i].tolist() == _ref_ids(lay, seq, range(s), pad)
        padded = [-1] * (lay.max_ngram - 1) + [DEAD if t is None else t for t in seq]
        assert hist[i].tolist() == padded[len(padded) - (lay.max_ngram - 1):]
    for li in range(len(lay.layer_ids)):  # every id falls in its own (ngram, head) range
        lo, hi = torch.tensor(lay.offsets[li]), torch.tensor(lay.offsets[li]) + torch.tensor(lay.primes[li])
        assert bool(((ids[:, :, li] >= lo) & (ids[:, :, li] < hi)).all())
        assert int(ids[:, :, li].max()) < lay.num_embeddings[li]


def test_random_history_matches_python(rng):
    cfg = _config()
    lay = EngramLayout.from_config(cfg)
    hasher = EngramHasher(lay, TokenMap.identity(320))
    tokens = torch.randint(0, 320, (4, 6), generator=rng)
    history = torch.randint(-1, 320, (4, 3), generator=rng)
    history[0] = DEAD
    ids, _ = hasher.hash_ids(tokens, history)
    for i in range(4):
        seq = [None if h == DEAD else h for h in history[i].tolist()] + tokens[i].tolist()
        assert ids[i].tolist() == _ref_ids(lay, seq, range(3, 9), 2)


def test_wrapping_products_and_negative_hashes(rng):
    """Multipliers over the whole int64 range: products wrap and hashes go negative."""
    cfg = _config()
    lay = EngramLayout.from_config(cfg)
    bits = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    mults = tuple(tuple(_wrap(bits.getrandbits(64) | 1) for _ in range(4)) for _ in lay.layer_ids)
    lay = dataclasses.replace(lay, multipliers=mults)
    hasher = EngramHasher(lay, TokenMap.identity(320))
    tokens = torch.randint(0, 320, (2, 33), generator=rng)
    ids, _ = hasher.hash_ids(tokens)
    negative = 0
    for i in range(2):
        seq = tokens[i].tolist()
        assert ids[i].tolist() == _ref_ids(lay, seq, range(33), 2)
        m0, m1 = mults[0][:2]
        negative += sum(_wrap(seq[p] * m0) ^ _wrap(seq[p - 1] * m1) < 0 for p in range(1, 33))
    assert negative > 0  # the remainder of a negative hash was exercised


@pytest.mark.parametrize("with_mask", [False, True])
def test_chunked_equals_whole(rng, with_mask):
    cfg = _config()
    lay = EngramLayout.from_config(cfg)
    hasher = EngramHasher(lay, TokenMap(320, torch.randperm(320, generator=rng).tolist()))
    tokens, mask = _random_inputs(rng, 3, 23, 320, with_mask)
    whole, whole_hist = hasher.hash_ids(tokens, mask=mask)
    for cuts in ([1] * 23, [5, 1, 1, 9, 7], [2, 0, 21]):
        hist, parts, start = hasher.start_history(3), [], 0
        for n in cuts:
            m = None if mask is None else mask[:, start:start + n]
            part, hist = hasher.hash_ids(tokens[:, start:start + n], hist, m)
            parts.append(part)
            start += n
        assert torch.equal(torch.cat(parts, dim=1), whole) and torch.equal(hist, whole_hist)


def test_dead_position_blocks_older_shifts(rng):
    """After a dead position, a token hashes as at the sequence start; dead ones still get ids."""
    lay = EngramLayout.from_config(_config())
    hasher = EngramHasher(lay, TokenMap.identity(320))
    tokens = torch.randint(0, 320, (1, 8), generator=rng)
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, 4] = False
    ids, hist = hasher.hash_ids(tokens, mask=mask)
    alone, _ = hasher.hash_ids(tokens[:, 5:6])
    assert torch.equal(ids[0, 5], alone[0, 0])
    dead_alone, _ = hasher.hash_ids(torch.tensor([[0]]), mask=torch.tensor([[False]]))
    assert torch.equal(ids[0, 4], dead_alone[0, 0])  # everything pad
    three, _ = hasher.hash_ids(tokens[:, 5:8])
    assert torch.equal(ids[0, 5:8], three[0])
    assert hist.tolist() == [[tokens[0, 5].item(), tokens[0, 6].item(), tokens[0, 7].item()]]


def test_from_tokens_normalisation():
    toks = ["The", " the", "THE", "thé", "Thé\u00a0", "  ", "\t", "\n \r", "ﬁ", "fi", "a\u0301", "á",
            "\ufffd", "x\ufffd", "\x0b", "", "\u3000", "a  b", "a\tb", "Ǆ", "dž", "ΣΑΣ", "σασ"]
    tm = TokenMap.from_tokens(toks)
    c = tm.table.tolist()
    assert c[0] == c[1] == c[2] == c[3] == c[4] == 0  # case, spaces and accents fold
    assert c[5] == c[6] == c[7] == c[16] == 1  # whitespace-only tokens keep one space key
    assert c[8] == c[9] and c[10] == c[11] != c[9]  # NFKC ligature, combining accent
    assert len({c[12], c[13], c[14], c[15]}) == 4 and c[12] not in c[:12]  # raw keys, distinct
    assert c[17] == c[18] and c[19] == c[20] and c[21] == c[22]
    assert max(c) + 1 == tm.compressed_vocab_size == len(set(c))
    first = [c.index(k) for k in range(tm.compressed_vocab_size)]
    assert first == sorted(first)  # ids handed out in first-seen order
    raw = TokenMap.from_tokens(["\ufffd", "\ufffd", "ab"], raw=["<0xE2>", "<0xE3>", "ab"])
    assert raw.table.tolist() == [0, 1, 2] and raw.compressed_vocab_size == 3
    with pytest.raises(ValueError, match="raw"):
        TokenMap.from_tokens(["a"], raw=[])


def test_from_file(tmp_path):
    cfg = shipped_config("tiny")
    arr = np.arange(320)[::-1] % 100
    (tmp_path / "m.json").write_text(json.dumps(arr.tolist()))
    np.save(tmp_path / "m.npy", arr)
    for name in ("m.json", "m.npy"):
        tm = TokenMap.from_file(str(tmp_path / name), cfg)
        assert tm.table.tolist() == arr.tolist() and tm.compressed_vocab_size == 320
        assert tm(torch.tensor([[0, 319]])).tolist() == [[19, 0]]
    bad = {"short.json": list(range(319)), "neg.json": [-1] + [0] * 319, "big.json": [320] * 320,
           "float.json": [0.5] * 320, "twod.json": [[0] * 320]}
    for name, data in bad.items():
        (tmp_path / name).write_text(json.dumps(data))
        with pytest.raises(ValueError, match=name):
            TokenMap.from_file(str(tmp_path / name), cfg)


def test_bad_inputs():
    lay = EngramLayout.from_config(_config())
    hasher = EngramHasher(lay, TokenMap.identity(320))
    ok = torch.zeros(2, 3, dtype=torch.int64)
    cases = [
        ("tokens", dict(tokens=ok.float())), ("tokens", dict(tokens=ok[0])), ("tokens", dict(tokens=[[1]])),
        ("tokens", dict(tokens=ok + 320)), ("tokens", dict(tokens=ok - 1)),
        ("history", dict(history=torch.zeros(2, 2, dtype=torch.int64))),
        ("history", dict(history=torch.zeros(2, 3, dtype=torch.int32))),
        ("history", dict(history=torch.full((2, 3), -2))), ("history", dict(history=torch.full((2, 3), 320))),
        ("mask", dict(mask=torch.ones(2, 3))), ("mask", dict(mask=torch.ones(2, 4, dtype=torch.bool))),
    ]
    for name, kw in cases:
        args = dict(tokens=ok, history=None, mask=None) | kw
        with pytest.raises(ValueError, match=f"^{name}"):
            hasher.hash_ids(**args)
    with pytest.raises(ValueError, match="token_map"):
        EngramHasher(lay, TokenMap.identity(321))
    with pytest.raises(ValueError, match="engram_pad_id"):
        EngramHasher(dataclasses.replace(lay, pad_id=5), TokenMap(320, [0, 1, 2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu(rng):
    lay = EngramLayout.from_config(shipped_config("v4.1-flash"))
    hasher = EngramHasher(lay, TokenMap.identity(99092))
    tokens = torch.randint(0, 99092, (2, 64), generator=rng)
    mask = torch.rand(2, 64, generator=rng) > 0.1
    cpu, cpu_hist = hasher.hash_ids(tokens, mask=mask)
    gpu, gpu_hist = hasher.hash_ids(tokens.cuda(), mask=mask.cuda())
    assert torch.equal(gpu.cpu(), cpu) and torch.equal(gpu_hist.cpu(), cpu_hist)
