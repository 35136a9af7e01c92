"""The engine's warm-up (engine/warmup.py): its rounds cover every decode batch-size bucket a run can
meet and every token-count class of a prefill, and running it leaves nothing behind: outputs,
counters, prefix store and page pool are those of an engine that never warmed up.
(tests/kernels_cuda/test_serve_variants.py checks what it is for: no kernel variant is met after it.)"""
import random

import pytest
import torch

from flashrt.engine import Engine, EngineConfig, SamplingParams
from flashrt.engine.slots import bucket_for
from flashrt.engine.warmup import buckets, rounds

SMALL = dict(prefill_chunk=16, max_step_tokens=48, max_running=6)


@pytest.mark.parametrize("trial", range(6))
def test_buckets_are_every_decode_batch_size_a_run_can_meet(trial):
    max_running = random.Random().randrange(1, 400)
    sizes = buckets(max_running)
    assert sizes == sorted(sizes, reverse=True)
    assert set(sizes) == {bucket_for(n) for n in range(1, max_running + 1)}  # what DecodeSlots can resize to


@pytest.mark.parametrize("trial", range(6))
def test_rounds_cover_each_token_count_class_rows_and_bucket(trial):
    rng = random.Random()
    chunk, max_rows = rng.randrange(1, 700), rng.randrange(1, 40)
    sizes = buckets(rng.randrange(1, 100))
    plan = rounds(chunk, max_rows, sizes)
    alone = {lengths[0] for what, lengths in plan if what == "prefill"}
    for start in (0, chunk):
        # every (power-of-two class, % 16 class, == 1) a prefill of 1 .. chunk tokens falls in
        want = {((n - 1).bit_length(), n % 16 == 0, n == 1) for n in range(1, chunk + 1)}
        have = {((n - start - 1).bit_length(), (n - start) % 16 == 0, n - start == 1)
                for n in alone if start < n <= start + chunk}
        assert want <= have, (start, sorted(want - have))
    groups = [len(lengths) for what, lengths in plan if what == "group"]
    assert all(1 <= g <= max_rows for g in groups)
    assert {(g - 1).bit_length() for g in groups} == {(r - 1).bit_length() for r in range(1, max_rows + 1)}
    assert [len(lengths) for what, lengths in plan if what == "decode"] == sizes
    assert any(what == "prefix" and lengths[0] > chunk for what, lengths in plan)


def _workload(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(torch.randint(1, 40, (), generator=g)),), generator=g).tolist()
               for _ in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0.9, max_tokens=6),
              SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=6, logprobs=2)] * 3
    return prompts, params[:7]


def _outputs(results):
    return [[(c.token_ids, c.logprobs) for c in r.outputs] for r in results]


def test_warm_up_leaves_no_trace(model):
    seed = random.Random().randrange(1 << 30)
    prompts, params = _workload(model.cfg.vocab_size, seed)
    fresh = Engine(model, **SMALL, seed=11)
    want = _outputs(fresh.generate(prompts, params))

    engine = Engine(model, **SMALL, seed=11)
    seen = []
    report = engine.warm_up(lambda done, total, what, rows: seen.append((done, total, what, rows)))
    assert report["requests"] > 0 and len(seen) == report["rounds"] == seen[-1][1]
    stats = engine.stats()
    for key in ("prompt_tokens", "generation_tokens", "finished", "steps", "prefill_forwards", "decode_steps",
                "prefix_queries", "prefix_hits", "kv_pages_device", "kv_pages_index", "requests"):
        assert stats[key] == 0, (key, stats[key])
    assert not engine.step_loop.prefix.entries
    assert _outputs(engine.generate(prompts, params)) == want, f"seed={seed}"  # the engine's seed stream untouched too


def test_warm_up_refuses_a_started_or_busy_engine(model):
    engine = Engine(model, **SMALL)
    engine.step_loop.add("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warm_up()


def test_warmup_setting_checked_and_on_with_graphs(model):
    with pytest.raises(ValueError, match="warmup: expected a bool or None, got 'yes'"):
        EngineConfig(warmup="yes")
    assert EngineConfig().warmup_on(model) is False  # CPU: no captured decode, no warm-up by default
    assert EngineConfig(cuda_graphs=True).warmup_on(model) is True
    assert EngineConfig(cuda_graphs=True, warmup=False).warmup_on(model) is False
