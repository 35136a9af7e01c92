"""Serving-engine step efficiency on the tiny model (CPU): prefill chunks of several requests run as
one forward call with the same greedy tokens as each request alone; a decode step copies to the
host once (one sampled-token transfer for the whole batch); a decode batch whose size goes back and
forth across bucket boundaries reuses its per-bucket step runners (no new captures)."""
import collections
from importlib import resources

import pytest
import torch

from flashrt.engine import Engine, SamplingParams
from flashrt.engine import slots as slots_mod

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def prompts_for(rng, lengths):
    return [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths]


def test_batched_prefill_equals_each_request_alone(model, rng):
    # ragged lengths; equal-length and multi-chunk prompts (chunk 16) share forward calls
    n_same = int(torch.randint(17, 40, (1,), generator=rng))
    lengths = [n_same, n_same, n_same + 9, 16, 16, 11, 11, 3, 40]
    prompts = prompts_for(rng, lengths)
    cfg = dict(prefill_chunk=16, max_step_tokens=512, max_running=16, prefix_cache_bytes=0)
    engine = Engine(model, **cfg)
    alone = [engine.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    batched = Engine(model, **cfg)
    outs = batched.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    chunks = sum(-(-n // 16) for n in lengths)
    forwards = batched.step_loop.counters["prefill_forwards"]
    # the first step alone: six chunks [0, 16) in two calls (4 + 2 rows), two [0, 11) in one
    assert forwards <= chunks - 5, (forwards, chunks)
    assert batched.step_loop.pool.pages_in_use == 0


def test_a_failed_group_fails_its_requests_and_frees_their_pages(model, rng, monkeypatch):
    engine = Engine(model, prefill_chunk=16, max_step_tokens=128, max_running=8, prefix_cache_bytes=0)
    core = engine.step_loop
    for i, p in enumerate(prompts_for(rng, (20, 20, 9))):
        core.add(f"r{i}", p, GREEDY)
    real = model.forward

    def boom(ids, **kw):
        if ids.shape[0] > 1:
            raise RuntimeError("device error")
        return real(ids, **kw)
    monkeypatch.setattr(model, "forward", boom)
    core.step()
    monkeypatch.setattr(model, "forward", real)
    assert sorted(core.requests) == ["r2"]  # the group of two failed; the lone 9-token prompt went on
    while core.has_work:
        core.step()
    assert core.pool.pages_in_use == 0


class SyncCounter:
    """Counts device->host reads outside the model's own forward / run (where the reference
    backend's host-side loops would count too)."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch, model):
        self.count, self.inside = collections.Counter(), 0
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        for name in ("forward", "run"):
            monkeypatch.setattr(model, name, self._enter(getattr(model, name)))

    def _wrap(self, name, orig):
        def f(t, *a, **k):
            if not self.inside:
                self.count[name] += 1
            return orig(t, *a, **k)
        return f

    def _enter(self, orig):
        def f(*a, **k):
            self.inside += 1
            try:
                return orig(*a, **k)
            finally:
                self.inside -= 1
        return f


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_decode_step_syncs_once(model, rng, monkeypatch, graphs, temperature):
    engine = Engine(model, prefill_chunk=16, max_step_tokens=256, max_running=8, cuda_graphs=graphs,
                    prefix_cache_bytes=0)
    core = engine.step_loop
    params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=1)
    for i, p in enumerate(prompts_for(rng, (9, 14, 5, 12, 7))):
        core.add(f"r{i}", p, params)
    core.step()  # every prompt (one forward per length); all join the decode batch
    assert len(core.scheduler.running) == 5
    counter = SyncCounter(monkeypatch, model)
    for _ in range(4):
        counter.count.clear()
        core.step()
        assert dict(counter.count) == {"tolist": 1}


def test_bucket_changes_reuse_the_step_runners(model, rng, monkeypatch):
    made = []

    class Counting(slots_mod.StepCapture):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self.state.batch)
    monkeypatch.setattr(slots_mod, "StepCapture", Counting)
    engine = Engine(model, prefill_chunk=16, max_step_tokens=512, max_running=12, cuda_graphs=True,
                    prefix_cache_bytes=0)
    core, ids = engine.step_loop, iter(range(10 ** 6))
    short, long_ = SamplingParams(temperature=0, max_tokens=2), SamplingParams(temperature=0, max_tokens=6)
    # waves of requests: the running count crosses the 4/8/16 bucket boundaries up and down
    for wave in range(5):
        for p in prompts_for(rng, [5] * (10 if wave % 2 == 0 else 3)):
            core.add(f"r{next(ids)}", p, short if wave % 2 == 0 else long_)
        while core.has_work:
            core.step()
        if wave == 1:
            warm = list(made)
    assert sorted(set(warm)) == [4, 8, 16] and made == warm  # one runner per bucket, made once
    assert core.pool.pages_in_use == 0


def test_prefill_groups_run_whole(model, rng):
    """Chunks at one position with one length run as one call whatever their number; a short
    chunk (fewer than 4 tokens) and one at another position run alone."""
    from flashrt.engine.scheduler import Plan

    engine = Engine(model, prefill_chunk=16, max_step_tokens=512, max_running=32, prefix_cache_bytes=0)
    core = engine.step_loop
    k = int(torch.randint(3, 20, (1,), generator=rng))
    for i, p in enumerate(prompts_for(rng, [16] * k + [5, 5, 2])):
        core.add(f"r{i}", p, GREEDY)
    waiting = list(core.scheduler.waiting)
    waiting[1].computed = 16  # a chunk further on: its own call
    plan = Plan(prefill=[(s, min(16, s.prompt_len)) for s in waiting])
    groups = plan.prefill_groups()
    assert [len(g) for g in groups] == [k - 1, 1, 2, 1]
    assert [s for g in groups for s, _ in g] == [waiting[0], *waiting[2:k], waiting[1], *waiting[k:]]
    assert all(len({(s.computed, n) for s, n in g}) == 1 for g in groups)


def test_step_budget_comes_from_the_profile(model, monkeypatch):
    import dataclasses

    from flashrt import profiles
    from flashrt.errors import ProfileError

    import yaml

    shipped = yaml.safe_load(resources.files("flashrt.hwconfigs").joinpath("h200.yaml").read_text())
    assert profiles.load_profile("h200").serve_max_step_tokens == shipped["serve_max_step_tokens"] > 2048
    base = profiles.active_profile()
    budget = int(torch.randint(600, 5000, (1,)))
    monkeypatch.setattr(model, "profile", dataclasses.replace(base, serve_max_step_tokens=budget), raising=False)
    assert Engine(model, prefill_chunk=512).config.max_step_tokens == budget
    assert Engine(model, prefill_chunk=512, max_step_tokens=1024).config.max_step_tokens == 1024  # given wins
    monkeypatch.setattr(model, "profile", dataclasses.replace(base, serve_max_step_tokens=100))
    assert Engine(model, prefill_chunk=512).config.max_step_tokens == 512  # a step holds one chunk
    monkeypatch.setattr(model, "profile", None)
    assert Engine(model).config.max_step_tokens == 2048
    data = {**base.to_dict(), "name": "bad", "serve_max_step_tokens": 0}
    with pytest.raises(ProfileError, match="serve_max_step_tokens"):
        profiles.profile_from_mapping(data, "bad")
