"""The step context's integers and rotary factors from one table (graphs/step_rows.py) equal their
direct computation bit for bit on fresh random positions: each index ratio's visible counts, the
window and compressed factors, and in a decode step each KV source's completed-entry factors
(``compress_decode``'s entry times the ratio); a longer chunk carries no entry factors."""
import pytest
import torch

from flashrt import ops
from flashrt.graphs.config import shipped_config
from flashrt.graphs.context import RopeCache, StepNeeds


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(torch.view_as_real(a), torch.view_as_real(b))


@pytest.mark.parametrize("model", ["tiny", "small"])
@pytest.mark.parametrize("B,S", [(1, 1), (5, 1), (3, 7)])
def test_rows_equal_their_direct_computation(model, B, S, rng):
    cfg = shipped_config(model)
    # ratio 4 as in the published model in place of 2, so that an entry row of ratio > 2 is covered
    cfg = cfg.replace(compress_ratios=[4 if r == 2 else r for r in cfg.compress_ratios])
    needs, rope = StepNeeds.of(cfg), RopeCache(cfg, "cpu")
    positions = torch.randint(0, 5000, (B, 1), generator=rng) + torch.arange(S)
    visible, factors = rope.rows(needs, S == 1)(positions)
    assert sorted(visible) == sorted(needs.index_ratios)
    for r, got in visible.items():
        assert got.dtype == torch.int32 and torch.equal(got, ((positions + 1) // r).to(torch.int32))
    assert _same(factors["window"], rope.factors(False, positions)) == needs.window_rope
    assert _same(factors["compressed"], rope.factors(True, positions))
    entries = {r for r in factors if isinstance(r, int)}
    assert entries == (set(needs.entry_ratios) if S == 1 else set())
    assert 4 in entries or S > 1
    for r in entries:
        D = 8
        kv = torch.randn(B, D)
        _, entry, _ = ops.compress_decode(kv, kv, torch.zeros(B, r, D), torch.zeros(B, r, D), positions[:, 0],
                                          torch.ones(D), 1e-6, torch.float32)
        assert _same(factors[r], rope.factors(True, entry * r))


def test_needs_not_made_at_build_get_their_own_rows(rng):
    cfg = shipped_config("tiny")
    rope = RopeCache(cfg, "cpu")
    needs = StepNeeds(cfg.window_size, (3,), (3,), False, (3,))
    positions = torch.randint(0, 100, (2, 1), generator=rng)
    visible, factors = rope.rows(needs, True)(positions)
    assert torch.equal(visible[3], ((positions + 1) // 3).to(torch.int32))
    assert sorted(factors, key=str) == [3, "compressed"]
    assert _same(factors[3], rope.factors(True, ((positions + 1) // 3 - 1) * 3))
