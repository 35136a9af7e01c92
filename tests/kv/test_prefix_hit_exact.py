"""A prefix-cache hit gives the same answer as a run without the cache: logits, greedy tokens and
the state left after decoding are bit-identical (the reference backend does not depend on where
a prefill is split)."""
import pytest
import torch

from flashrt.engine import generate
from flashrt.kv.prefix_cache import PrefixCache

STEPS = 8


def prompts(rng, model, batch, length):
    return torch.randint(0, model.cfg.vocab_size, (batch, length), generator=rng).tolist()


def assert_same_state(a, b):
    """Every byte a continuation reads: positions, rings (draft layers too) and their starts,
    compressed main KV and index K, compressor partial groups, Engram history."""
    assert a.host_positions == b.host_positions and torch.equal(a.positions, b.positions)
    u8 = torch.uint8
    for l in a.rings:
        assert torch.equal(a.rings[l].data.view(u8), b.rings[l].data.view(u8)), f"ring {l}"
        assert torch.equal(a.rings[l].scale.view(u8), b.rings[l].scale.view(u8)), f"ring {l} scale"
        assert torch.equal(a.ring_start[l], b.ring_start[l])
    for l, c in a.compressed.items():
        d, r = b.compressed[l], a.cfg.ratio(l)
        for row, pos in enumerate(a.host_positions):
            for x, y in ((c.main.read_row(row, pos // r), d.main.read_row(row, pos // r)),
                         (c.index_k.read_row(row, 0, pos // r), d.index_k.read_row(row, 0, pos // r))):
                assert torch.equal(x.data.view(u8), y.data.view(u8)) and torch.equal(x.scale.view(u8), y.scale.view(u8))
        if c.kv_state is not None:
            assert torch.equal(c.kv_state, d.kv_state) and torch.equal(c.score_state, d.score_state)
    assert torch.equal(a.engram_history, b.engram_history)


@pytest.mark.parametrize("length", [64, 100, 128, 150])
def test_hit_is_bit_identical_to_no_cache(model, rng, tmp_path, length):
    ids = prompts(rng, model, 2, length)
    want = generate(model, ids, STEPS)
    cache = PrefixCache(tmp_path)
    miss = generate(model, ids, STEPS, prefix_cache=cache)
    assert cache.hits == 0 and len(cache.entries()) == 2
    hit = generate(model, ids, STEPS, prefix_cache=cache)
    assert cache.hits == 2
    for got in (miss, hit):
        assert got.tokens == want.tokens
        assert torch.equal(got.first_logits, want.first_logits)
        assert_same_state(got.state, want.state)


def test_mixed_batch_of_hits_and_misses_is_bit_identical(model, rng, tmp_path):
    a, b = prompts(rng, model, 1, 150)[0], prompts(rng, model, 1, 100)[0]
    cache = PrefixCache(tmp_path)
    generate(model, [a, b], 1, prefix_cache=cache)  # stores a[:128] and b[:64]
    batch = [a + prompts(rng, model, 1, 80)[0],  # hit 128, stores 192 on the way
             b,  # hit 64
             prompts(rng, model, 1, 90)[0],  # miss, same length as the next row
             b[:64] + prompts(rng, model, 1, 26)[0]]  # hit 64 from another prompt's entry
    hits = cache.hits
    got = generate(model, batch, STEPS, prefix_cache=cache)
    want = generate(model, batch, STEPS)
    assert cache.hits - hits == 3
    # the decode batch's row order follows the prefill groups, which differ with and without hits:
    # later greedy tokens may flip on a near-tie (fp32 sum order), so the first token is compared
    assert [t[0] for t in got.tokens] == [t[0] for t in want.tokens]
    # rows 0 and 1 are prefilled alone in every run: bit-identical
    assert torch.equal(got.first_logits[:2], want.first_logits[:2])
    # rows 2 and 3 share a length but not a hit: prefilled as two groups of one, not one group of
    # two as without the cache, and the reference backend's matmuls round by batch shape
    torch.testing.assert_close(got.first_logits[2:], want.first_logits[2:], rtol=1e-5, atol=1e-5)
    again = generate(model, [batch[0]], STEPS, prefix_cache=cache)  # now a hit at 192
    assert cache.hits - hits == 4
    assert again.tokens[0][0] == want.tokens[0][0] and torch.equal(again.first_logits, want.first_logits[:1])


def test_chunked_prefill_and_ced_hits_are_bit_identical(model, rng, tmp_path):
    ids = prompts(rng, model, 1, 200)
    want = generate(model, ids, 4, prefill_chunk=48)
    cache = PrefixCache(tmp_path / "chunked")
    for _ in range(2):
        got = generate(model, ids, 4, prefill_chunk=48, prefix_cache=cache)
        assert got.tokens == want.tokens and torch.equal(got.first_logits, want.first_logits)
    assert cache.hits == 1
    ced = prompts(rng, model, 1, 128)  # ced stores prompts of an aligned length
    want = generate(model, ced, 4, prefill="ced")
    cache = PrefixCache(tmp_path / "ced")
    for _ in range(2):
        got = generate(model, ced, 4, prefill="ced", prefix_cache=cache)
        assert got.tokens == want.tokens and torch.equal(got.first_logits, want.first_logits)
    assert cache.hits == 1
    assert generate(model, ced, 1, prefix_cache=cache) and cache.hits == 1  # exact never reads a ced entry


def test_bounded_replay_is_an_explicit_option(model, rng, tmp_path):
    ids = prompts(rng, model, 1, 150)
    cache = PrefixCache(tmp_path)
    want = generate(model, ids, 2, prefix_cache=cache)
    entries = len(cache.entries())
    got = generate(model, [ids[0] + ids[0][:60]], 2, prefix_cache=cache, prefix_replay=model.cfg.window_size)
    assert cache.hits == 1 and len(cache.entries()) == entries  # an approximate state is not stored
    replayed = generate(model, ids, 2, prefix_cache=cache, prefix_replay=model.cfg.window_size)
    assert not torch.equal(replayed.first_logits, want.first_logits) and torch.isfinite(got.first_logits).all()
    whole = generate(model, ids, 2, prefix_cache=cache, prefix_replay=128)  # the whole prefix: exact again
    assert torch.equal(whole.first_logits, want.first_logits)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="prefix_replay"):
            generate(model, ids, 1, prefix_cache=cache, prefix_replay=bad)
