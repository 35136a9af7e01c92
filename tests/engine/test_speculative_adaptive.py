"""Adaptive verification length: the choice of k against an independent computation, the cost
table of a device profile (parsed, checked, used by generate)."""
import dataclasses
import itertools

import pytest
import torch
import yaml

from flashrt import profiles
from flashrt.engine import adaptive, generate
from flashrt.errors import ProfileError
from flashrt.profiles import profile_from_mapping


def brute_force_k(conf: torch.Tensor, verify: list, draft: float) -> int:
    """Expected tokens by enumerating every accept / reject pattern of the k drafts of each row
    (draft i accepted with probability sigmoid(conf) given the ones before were)."""
    c = torch.sigmoid(conf.double()).tolist()
    best, best_rate = 0, -1.0
    for k in range(conf.shape[1] + 1):
        total = 0.0
        for row in c:
            for pattern in itertools.product([True, False], repeat=k):
                prob = 1.0
                for ok, ci in zip(pattern, row):
                    prob *= ci if ok else 1 - ci
                accepted = next((i for i, ok in enumerate(pattern) if not ok), k)
                total += prob * (accepted + 1)
        rate = total / (verify[k] + (draft if k else 0.0))
        if rate > best_rate + 1e-9:
            best, best_rate = k, rate
    return best


def test_choice_matches_enumeration(rng):
    for _ in range(40):
        B, K = int(torch.randint(1, 5, (1,), generator=rng)), int(torch.randint(1, 6, (1,), generator=rng))
        conf = torch.randn(B, K, generator=rng) * 3
        steps = (torch.rand(K, generator=rng) * 0.6).tolist()
        verify = [1.0]
        for s in steps:
            verify.append(verify[-1] + s)
        draft = float(torch.rand(1, generator=rng)) * 0.5
        costs = adaptive.CostCurve((B,), (tuple(verify),), (draft,))
        assert adaptive.choose_k(conf, costs, B) == brute_force_k(conf, verify, draft)


def test_cost_curve_buckets_and_extension():
    c = adaptive.CostCurve.from_table({8: {"verify": [1.0, 1.2], "draft": 0.3},
                                       1: {"verify": [1.0, 1.1, 1.15], "draft": 0.2}})
    assert c.at(1, 2) == ([1.0, 1.1, 1.15], 0.2)
    assert c.at(5, 3) == ([1.0, 1.2, 1.4, pytest.approx(1.6)], 0.3)  # next bucket up, extended
    assert c.at(64, 1) == ([1.0, 1.2], 0.3)  # past the table: the largest bucket
    with pytest.raises(ValueError, match="speculative costs"):
        adaptive.CostCurve((1, 8), ((1.0, 1.1),), (0.2,))


def cpu_profile_data():
    with open(profiles.available_profiles()["cpu"]) as f:
        return yaml.safe_load(f)


def test_profile_table_is_read_and_checked():
    data = cpu_profile_data()
    data["speculative_costs"] = {1: {"verify": [1, 1.1, 1.2], "draft": 0.25}}
    p = profile_from_mapping(data, "cpu.yaml")
    assert p.speculative_costs == {1: {"verify": [1.0, 1.1, 1.2], "draft": 0.25}}
    assert p.to_dict()["speculative_costs"] == p.speculative_costs
    for bad, where in (({0: {"verify": [1, 2], "draft": 0.1}}, "speculative_costs"),
                       ({1: {"verify": [1], "draft": 0.1}}, "speculative_costs.1.verify"),
                       ({1: {"verify": [1, -2], "draft": 0.1}}, "speculative_costs.1.verify"),
                       ({1: {"verify": [1, 2], "draft": float("nan")}}, "speculative_costs.1.draft"),
                       ({1: {"verify": [1, 2]}}, "speculative_costs.1")):
        data["speculative_costs"] = bad
        with pytest.raises(ProfileError, match=f"key {where}"):
            profile_from_mapping(data, "cpu.yaml")


@pytest.mark.parametrize("verify, want", [([1.0, 0.8, 0.6, 0.4], {3}), ([1.0, 50.0, 99.0, 148.0], set())])
def test_generate_auto_follows_the_profile_costs(model, rng, monkeypatch, verify, want):
    """Verify steps cheaper with every drafted token: always the full block, whatever the
    confidences (expected tokens never fall as k grows); very costly ones: plain steps only."""
    base = profile_from_mapping(cpu_profile_data(), "cpu.yaml")
    monkeypatch.setattr(model, "profile", dataclasses.replace(base, speculative_costs={
        64: {"verify": verify, "draft": 0.0}}), raising=False)
    prompts = [torch.randint(0, model.cfg.vocab_size, (9,), generator=rng).tolist()]
    got = generate(model, prompts, 9, speculative="dspark", draft_tokens="auto", kv_page_entries=64)
    ks = set(got.speculative["k_counts"])
    assert ks - {1, 2} == want  # the last rounds are capped by the tokens still wanted
    assert (got.speculative["plain_steps"] == 8) == (not want)
