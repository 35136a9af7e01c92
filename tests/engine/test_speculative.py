"""Greedy speculative decoding (DSpark) gives the target's own greedy output, token for token.

Ragged batches of random prompts on the tiny model (CPU, reference ops), each ``k`` and ``auto``,
with the real draft (acceptance ~0 with random weights: every round rolls back) and with an
oracle draft (the target's continuation, partly corrupted: ragged acceptance across the batch),
with and without the cold KV tier. Also the options' errors and the run statistics.
"""
import pytest
import torch
from spec_helpers import OracleDraft, assert_same_greedy

from flashrt.engine import generate
from flashrt.kv.sizes import entry_bytes, fixed_bytes_for


def ragged_prompts(rng, model, lengths):
    return [torch.randint(0, model.cfg.vocab_size, (n,), generator=rng).tolist() for n in lengths]


def lengths(rng, n=3, lo=3, hi=24):
    return [int(x) for x in torch.randint(lo, hi, (n,), generator=rng)]


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_real_draft_greedy_equals_plain(model, rng, k):
    prompts = ragged_prompts(rng, model, lengths(rng))
    want = generate(model, prompts, 12)
    got = generate(model, prompts, 12, speculative="dspark", draft_tokens=k)
    assert_same_greedy(model, prompts, want.tokens, got.tokens)
    assert torch.equal(want.first_logits, got.first_logits)
    s = got.speculative
    assert s["rounds"] + s["plain_steps"] > 0 and s["accepted"] <= s["drafted"]
    assert s["draft_seconds"] > 0 and s["verify_seconds"] > 0


@pytest.mark.parametrize("k, corrupt", [(2, 0.3), (3, 0.2), (3, 0.6)])
def test_oracle_draft_ragged_acceptance_equals_plain(model, rng, monkeypatch, k, corrupt):
    prompts = ragged_prompts(rng, model, lengths(rng, 4))
    want = generate(model, prompts, 16)
    monkeypatch.setattr(model.drafts, "draft", OracleDraft(model, prompts, want.tokens, rng, corrupt))
    got = generate(model, prompts, 16, speculative="dspark", draft_tokens=k)
    assert_same_greedy(model, prompts, want.tokens, got.tokens)
    s = got.speculative
    assert 0 < s["accepted"] < s["drafted"]  # both accepted and rejected drafts happened
    assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted"] / (s["rounds"] * len(prompts)))
    # fewer target steps than tokens: each round gains the accepted drafts too
    assert s["rounds"] + s["plain_steps"] < 16


def test_eos_stops_rows(model, rng, monkeypatch):
    prompts = ragged_prompts(rng, model, [7, 11])
    want = generate(model, prompts, 14)
    eos = want.tokens[0][5]
    plain = generate(model, prompts, 14, eos_token_id=eos)
    monkeypatch.setattr(model.drafts, "draft", OracleDraft(model, prompts, want.tokens, rng, 0.2))
    got = generate(model, prompts, 14, eos_token_id=eos, speculative="dspark", draft_tokens=3)
    assert_same_greedy(model, prompts, plain.tokens, got.tokens)
    assert got.tokens[0][-1] == eos and len(got.tokens[0]) <= 6


def test_cold_tier_greedy_equals_plain(model, rng, monkeypatch):
    """Main-KV pages spill to the host tier (a budget of ~10% of the context's pages); the reference
    is the plain run with every page on the device (the cold tier does not change the output)."""
    cfg = model.cfg
    prompts = ragged_prompts(rng, model, [150, 190])
    cap = 190 + 10 + cfg.dspark_block_size
    main = sum(-(-cap // cfg.ratio(l)) for l in cfg.kv_source_layers) * entry_bytes(cfg.head_dim, "fp4_b16") * 2
    budget = fixed_bytes_for(cfg, 2, cap, page_entries=8) + main // 10
    kw = dict(prefill_chunk=32, kv_page_entries=8)
    want = generate(model, prompts, 10, **kw)
    monkeypatch.setattr(model.drafts, "draft", OracleDraft(model, prompts, want.tokens, rng, 0.3))
    got = generate(model, prompts, 10, speculative="dspark", draft_tokens=3, kv_budget=budget, **kw)
    assert got.state.tier_stats()["cold_pages"] > 0
    assert_same_greedy(model, prompts, want.tokens, got.tokens)
    assert got.speculative["accepted"] > 0


def test_options_are_checked(model, cfg, weights):
    from flashrt.graphs.model import Model
    import dataclasses

    with pytest.raises(ValueError, match="speculative: expected one of"):
        generate(model, [[1, 2]], 2, speculative="medusa")
    for bad in (0, cfg.dspark_block_size + 1, "many", True, 1.5):
        with pytest.raises(ValueError, match="draft_tokens"):
            generate(model, [[1, 2]], 2, speculative="dspark", draft_tokens=bad)
    plain = Model(dataclasses.replace(cfg, dspark_block_size=0, n_mtp_layers=0), weights)
    with pytest.raises(ValueError, match="speculative: the model has no DSpark draft layers"):
        generate(plain, [[1, 2]], 2, speculative="dspark")


@pytest.fixture(scope="module")
def small_shaped(cfg):
    """The ``small`` config's layer layout (12 layers, its ratios, sources, candidates, Engram
    layers) at the tiny sizes, with a 5-token draft block and a 16-token window."""
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model
    import dataclasses

    s = shipped_config("small")
    shaped = dataclasses.replace(cfg, n_layers=s.n_layers, compress_ratios=s.compress_ratios,
                                 kv_source_layers=s.kv_source_layers, index_source_layers=s.index_source_layers,
                                 candidate_source_layer=s.candidate_source_layer, engram_layer_ids=s.engram_layer_ids,
                                 dspark_target_layer_ids=[9, 10, 11], dspark_block_size=5, window_size=16)
    return Model(shaped, init_weights(shaped, seed=1))


# (k, seed): fresh inputs (seed None), and seeds whose speculative output diverged (with either k)
# while the reference rounded a verify chunk's rows unlike one-token steps
@pytest.mark.parametrize("k, seed", [(5, None), ("auto", None), (5, 448491446), ("auto", 2)])
def test_small_shaped_ragged_greedy_equals_plain(small_shaped, rng, monkeypatch, k, seed):
    model = small_shaped
    rng = rng if seed is None else torch.Generator().manual_seed(seed)
    prompts = ragged_prompts(rng, model, lengths(rng, 3, 5, 40))
    want = generate(model, prompts, 14)
    monkeypatch.setattr(model.drafts, "draft", OracleDraft(model, prompts, want.tokens, rng, 0.25))
    got = generate(model, prompts, 14, speculative="dspark", draft_tokens=k)
    # the reference gives a row the same bits in a verify chunk as in a one-token step: no near-tie
    # allowance, the tokens are equal
    assert got.tokens == want.tokens
    assert 0 < got.speculative["accepted"] < got.speculative["drafted"]
