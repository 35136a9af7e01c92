"""Per-request sampling (engine/sampling.py) against independent float64 computations: parameter
checks, greedy = ops.sample at temperature 0, the sets top_k / top_p / min_p leave and the
frequencies inside them, penalties on hand-built logits, per-row seeds, logprobs."""
import numpy as np
import pytest
import torch

from flashrt import ops
from flashrt.engine.sampling import SamplerRow, SamplingParams, filter_logits, sample


def rows_for(params, B, seed=None, prompt=(), output=()):
    gens = [torch.Generator().manual_seed(seed + i) if seed is not None else None for i in range(B)]
    return [SamplerRow(params, gens[i], list(prompt), list(output)) for i in range(B)]


@pytest.mark.parametrize("field, value, expected", [
    ("n", 0, "an int >= 1"), ("n", 1.5, "an int >= 1"), ("temperature", -0.1, "a number >= 0"),
    ("temperature", float("nan"), "a number >= 0"), ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"),
    ("top_k", -2, "0 / -1 for no limit"), ("top_k", 2.0, "an int"), ("min_p", 1.2, "[0, 1]"),
    ("max_tokens", 0, "an int >= 1"), ("max_tokens", True, "an int >= 1"), ("min_tokens", -1, "an int >= 0"),
    ("stop", [""], "non-empty string"), ("stop", 3, "non-empty string"), ("stop_token_ids", [-1], "token ids"),
    ("seed", "7", "an int or None"), ("repetition_penalty", 0, "a number > 0"),
    ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -3, "[-2, 2]"), ("logprobs", 21, "[0, 20]"),
    ("ignore_eos", 1, "a bool"),
])
def test_bad_params_name_field_expected_and_given(field, value, expected):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert msg.startswith(f"{field}: expected") and expected in msg and repr(value) in msg


def test_min_tokens_above_max_and_vocab_checks():
    with pytest.raises(ValueError, match="min_tokens: expected at most max_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    p = SamplingParams(stop="x", stop_token_ids=[5, 400])
    assert p.stop == ("x",) and p.stop_token_ids == (5, 400)
    with pytest.raises(ValueError, match=r"stop_token_ids: expected ids below the vocabulary size 320, got \[400\]"):
        p.check_vocab(320)


def test_greedy_is_exactly_ops_sample_at_zero(rng):
    logits = torch.randn(9, 300, generator=rng) * 3
    logits[2, :2] = logits[2].max() + 1  # a tie: the lower id wins
    got = [s.token for s in sample(logits, rows_for(SamplingParams(temperature=0), 9))]
    assert got == ops.sample(logits, 0.0).tolist() == logits.argmax(-1).tolist()
    assert got[2] == 0
    # top_k = 1 is greedy too, whatever the temperature
    assert [s.token for s in sample(logits, rows_for(SamplingParams(top_k=1, temperature=2.0), 9))] == got


def allowed_set(logits: np.ndarray, T, top_k, top_p, min_p) -> np.ndarray:
    """The tokens that may be drawn, computed independently in float64."""
    z = logits.astype(np.float64) / T
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    keep = p >= min_p * p[0]
    if top_k > 0:
        keep[top_k:] = False
    q = np.where(keep, p, 0)
    q /= q.sum()
    before = np.cumsum(q) - q
    keep &= before < top_p
    keep[0] = True
    return np.sort(order[keep])


def renormalized(logits, T, allowed):
    z = logits.astype(np.float64)[allowed] / T
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.mark.parametrize("T, top_k, top_p, min_p", [
    (1.0, 0, 0.7, 0.0), (0.8, 5, 1.0, 0.0), (1.3, 0, 1.0, 0.2), (1.0, 6, 0.6, 0.05), (2.0, 0, 0.9, 0.0)])
def test_filters_keep_the_right_set_with_the_right_frequencies(rng, T, top_k, top_p, min_p):
    V, n = 24, 4000
    logits = torch.randn(V, generator=rng) * 2
    allowed = allowed_set(logits.numpy(), T, top_k, top_p, min_p)
    params = SamplingParams(temperature=T, top_k=top_k, top_p=top_p, min_p=min_p)
    filt = filter_logits((logits / T).expand(1, V), torch.tensor([top_k]), torch.tensor([top_p]),
                         torch.tensor([min_p]))
    assert np.flatnonzero(torch.isfinite(filt[0]).numpy()).tolist() == allowed.tolist()
    # n draws: one batch of n identical rows with a generator each (seeded from the fixture)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    draws = np.array([s.token for s in sample(logits.expand(n, V).clone(), rows_for(params, n, seed))])
    assert set(draws.tolist()) <= set(allowed.tolist())
    p = renormalized(logits.numpy(), T, allowed)
    freq = np.array([(draws == a).mean() for a in allowed])
    bound = 5 * np.sqrt(p * (1 - p) / n) + 1.0 / n
    assert np.all(np.abs(freq - p) <= bound), (freq, p)


def test_penalties_on_hand_built_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.2]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = SamplerRow(p, None, prompt=[0, 1], output=[3, 3, 4])
    want = logits.clone()[0]
    for t in {0, 1, 3, 4}:  # repetition: prompt and output tokens
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    want[3] -= 0.5 * 2 + 0.25  # frequency x count + presence
    want[4] -= 0.5 * 1 + 0.25
    from flashrt.engine.sampling import apply_penalties

    got = apply_penalties(logits, [row])[0]
    assert torch.allclose(got, want)
    assert sample(logits, [row])[0].token == int(want.argmax())  # 5: the penalties moved the argmax
    assert int(want.argmax()) == 5 and int(logits.argmax()) == 3


def test_banned_ids_are_never_drawn(rng):
    logits = torch.randn(3, 10, generator=rng)
    top = logits.argmax(-1).tolist()
    rows = [SamplerRow(SamplingParams(temperature=t), torch.Generator().manual_seed(1), [], [], banned=(b,))
            for t, b in zip((0, 0, 1.0), top)]
    out = sample(logits, rows)
    assert out[0].token != top[0] and out[1].token != top[1] and out[2].token != top[2]


def test_seeded_rows_reproduce_whatever_else_is_in_the_batch(rng):
    V = 50
    target = torch.randn(V, generator=rng)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)

    def draws(others: int, steps: int = 12):
        gen = torch.Generator().manual_seed(seed)
        got = []
        for _ in range(steps):
            logits = torch.cat([torch.randn(others, V, generator=rng), target[None]])
            rows = rows_for(SamplingParams(temperature=0.7), others, seed=99) + [SamplerRow(p, gen, [], [])]
            got.append(sample(logits, rows)[-1].token)
        return got

    a, b = draws(0), draws(5)
    assert a == b
    gen = torch.Generator().manual_seed(seed + 1)
    c = [sample(target[None], [SamplerRow(p, gen, [], [])])[0].token for _ in range(12)]
    assert c != a  # 12 draws over ~40 tokens: equal only by accident


def test_logprobs_are_the_raw_distribution(rng):
    logits = torch.randn(4, 40, generator=rng) * 2
    rows = [SamplerRow(SamplingParams(temperature=t, logprobs=k, repetition_penalty=1.5),
                       torch.Generator().manual_seed(i), [1, 2], [])
            for i, (t, k) in enumerate(((0, 3), (1.0, 0), (0.5, 5), (0, None)))]
    out = sample(logits, rows)
    lp = logits.double() - torch.logsumexp(logits.double(), -1, keepdim=True)
    for i, k in enumerate((3, 0, 5)):
        assert abs(out[i].logprob - float(lp[i, out[i].token])) < 1e-5
        want = torch.argsort(-lp[i], stable=True)[:k].tolist()
        assert [t for t, _ in out[i].top] == want
        assert all(abs(v - float(lp[i, t])) < 1e-5 for t, v in out[i].top)
    assert out[3].logprob is None and out[3].top is None
