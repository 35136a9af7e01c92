"""sample: greedy, reproducibility, and the empirical distribution against softmax(logits / T)
computed independently in float64 (5-sigma binomial bounds per category)."""

import numpy as np
import pytest
import torch

from flashrt import ops


def _softmax64(logits, T):
    z = np.asarray(logits, dtype=np.float64) / T
    e = np.exp(z - z.max())
    return e / e.sum()


def _check_freqs(draws, p, V, sigmas=5.0):
    """Each category count ~ Binomial(n, p_v): |freq - p| <= sigmas * sqrt(p (1-p) / n) (plus a
    1/n slack for p ~ 0). With 5 sigma per category the false-failure rate is < 1e-5 per call."""
    n = draws.numel()
    counts = np.bincount(draws.numpy(), minlength=V)
    assert counts.size == V, "a draw fell outside [0, V)"
    freq = counts / n
    bound = sigmas * np.sqrt(p * (1 - p) / n) + 1.0 / n
    assert np.all(np.abs(freq - p) <= bound), (freq, p, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype, rng):
    g = rng
    for B, V in ((1, 1), (3, 7), (16, 1000), (2, 33)):
        logits = (torch.randn(B, V, generator=g) * 4).to(dtype)
        want = [int(np.argmax(row)) for row in logits.double().numpy()]  # first max
        for temp in (0, 0.0, torch.zeros(B)):
            out = ops.sample(logits, temp)
            assert out.dtype == torch.int64 and tuple(out.shape) == (B,)
            assert out.tolist() == want


def test_greedy_ties_to_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -1.0]])
    assert ops.sample(logits, 0.0).tolist() == [1, 0, 0]
    assert ops.sample(logits.to(torch.bfloat16), torch.zeros(3)).tolist() == [1, 0, 0]


def test_seeded_generator_reproducible(rng):
    logits = torch.randn(64, 50, generator=rng)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    a = ops.sample(logits, 1.0, torch.Generator().manual_seed(seed))
    b = ops.sample(logits, 1.0, torch.Generator().manual_seed(seed))
    c = ops.sample(logits, 1.0, torch.Generator().manual_seed(seed + 1))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # 64 rows of 50 near-uniform choices: equal only by accident
    temps = torch.rand(64, generator=rng) + 0.5
    temps[::3] = 0
    a = ops.sample(logits, temps, torch.Generator().manual_seed(9))
    b = ops.sample(logits, temps, torch.Generator().manual_seed(9))
    assert torch.equal(a, b)
    # the generator state advances: two successive draws from one generator differ
    gen = torch.Generator().manual_seed(5)
    assert not torch.equal(ops.sample(logits, 1.0, gen), ops.sample(logits, 1.0, gen))


def test_does_not_mutate():
    logits = torch.randn(4, 9)
    temps = torch.tensor([0.0, 1.0, 0.5, 2.0])
    lc, tc = logits.clone(), temps.clone()
    ops.sample(logits, temps, torch.Generator().manual_seed(0))
    assert torch.equal(logits, lc) and torch.equal(temps, tc)


@pytest.mark.parametrize("T", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_distribution_matches_softmax(T, dtype, rng):
    V, n = 5, 20000
    row = torch.tensor([1.0, -0.5, 0.25, 2.0, -3.0]).to(dtype)
    logits = row.expand(n, V).contiguous()
    draws = ops.sample(logits, T, rng)
    _check_freqs(draws, _softmax64(row.double().numpy(), T), V)


def test_distribution_per_row_temperature_tensor(rng):
    # one batched call: rows with T = 0 are greedy, the others sample at their own temperature
    V, n = 5, 12000
    row = torch.tensor([0.3, 1.1, -0.7, 1.0, 0.0])
    logits = row.expand(3 * n, V).contiguous()
    temps = torch.tensor([0.0, 0.5, 3.0]).repeat(n)  # interleaved: 0, 0.5, 3, 0, 0.5, 3, ...
    draws = ops.sample(logits, temps, rng)
    greedy = draws[0::3]
    assert (greedy == 1).all()
    _check_freqs(draws[1::3], _softmax64(row.numpy(), 0.5), V)
    _check_freqs(draws[2::3], _softmax64(row.numpy(), 3.0), V)


def test_distribution_distinct_rows(rng):
    # different logits per row, each row's picks follow its own softmax (checked per row pattern)
    V, n = 4, 10000
    rows = torch.tensor([[0.0, 0.0, 0.0, 0.0], [4.0, 0.0, 0.0, 0.0], [-1.0, 1.0, -1.0, 2.0]])
    logits = rows.repeat(n, 1)
    draws = ops.sample(logits, 1.0, rng)
    for r in range(3):
        _check_freqs(draws[r::3], _softmax64(rows[r].numpy(), 1.0), V)


def test_masked_logits_never_sampled(rng):
    V, n = 6, 5000
    row = torch.tensor([0.0, float("-inf"), 1.0, float("-inf"), -0.5, 0.5])
    draws = ops.sample(row.expand(n, V).contiguous(), 1.3, rng)
    assert not ((draws == 1) | (draws == 3)).any()
    p = np.exp(np.where(np.isinf(row.numpy()), -np.inf, row.numpy() / 1.3))
    _check_freqs(draws, p / p.sum(), V)


def test_low_temperature_is_nearly_greedy(rng):
    logits = torch.randn(200, 30, generator=rng) * 3
    top2 = logits.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1  # gap / T = 100: exp(-100) odds of a miss
    out = ops.sample(logits, 1e-3, rng)
    assert torch.equal(out[clear], logits.argmax(-1)[clear])


def test_errors():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="temperature"):
        ops.sample(logits, -0.5)
    with pytest.raises(ValueError, match="temperature"):
        ops.sample(logits, torch.tensor([0.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="temperature"):
        ops.sample(logits, torch.ones(4))  # wrong B
    with pytest.raises(ValueError, match="temperature"):
        ops.sample(logits, torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="temperature"):
        ops.sample(logits, "1.0")
    with pytest.raises(ValueError, match="logits"):
        ops.sample(logits[0], 1.0)  # rank 1
    with pytest.raises(ValueError, match="logits"):
        ops.sample(logits.unsqueeze(0), 1.0)  # rank 3
    with pytest.raises(ValueError, match="logits"):
        ops.sample(logits.to(torch.int64), 1.0)
    with pytest.raises(ValueError, match="generator"):
        ops.sample(logits, 1.0, generator=123)
