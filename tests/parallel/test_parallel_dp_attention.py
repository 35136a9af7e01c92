"""Data-parallel attention over expert-parallel groups (engine/parallel_groups.py, parallel_place.py):
offline runs on CPU processes, the placement rule, and what ``serve --dp-attention`` refuses."""
import pytest
from parallel_text import random_text
import torch

from flashrt.engine import Engine, EngineConfig, SamplingParams
from flashrt.engine.launch import launch
from flashrt.engine.parallel_groups import pool_bytes
from flashrt.engine.parallel_place import Placer
from flashrt.engine.parallel_run import checkpoint_path
from flashrt.engine.parallel_serve_run import ServeJob, check, group_engine
from flashrt.engine.run import load_model

CONFIG = dict(max_running=4, prefill_chunk=8, max_step_tokens=16, max_model_len=128, kv_budget=1 << 24)


def _rank(rank, device, path, prompts, params, bad, report=None):
    from flashrt.graphs.loader import load
    from flashrt.graphs.parallel import Layout, Parallel

    torch.set_num_threads(1)
    model = load(path, device=device, parallel=Parallel(Layout(1, 2, rank), "gather"))
    engine = group_engine(model, EngineConfig(**CONFIG), 2)
    loop, bad_ids = engine.step_loop, engine.encode(bad)
    prefill = loop._prefill

    def failing(seqs, n):  # the bad prompt's second chunk fails on the group that runs it
        if any(s.request.prompt == bad_ids and s.computed > 0 for s in seqs):
            raise RuntimeError("chunk failed")
        return prefill(seqs, n)
    loop._prefill = failing
    outs = engine.generate(prompts + [bad], params + params[:1])
    return {"tokens": [[c.token_ids for c in o.outputs] for o in outs[:-1]], "errors": [o.error for o in outs],
            "owners": [loop.placed], "pool": pool_bytes(loop.pool), "failed": loop.counters["failed"]}


def test_groups_generate_like_one_process_and_mirror_every_request(cache, rng):
    """Offline generate on two groups: every rank returns every request's completions (its own
    group's and the mirrored ones, forks of n=2 included) with one process's greedy tokens, a
    request whose chunk fails on its group fails on every rank with that error while the others go
    on, the requests are spread over both groups, and each rank's pool is one process's for half
    of max_running."""
    prompts = [random_text(rng, n) for n in (21, 5, 13, 9, 30)]
    params = [SamplingParams(max_tokens=5, temperature=0, n=2 if i % 2 else 1) for i in range(len(prompts))]
    torch.set_num_threads(1)
    model = load_model("tiny", torch.device("cpu"), 0, quiet=True)
    want = [[c.token_ids for c in o.outputs] for o in Engine(model, **CONFIG).generate(prompts, params)]
    half = pool_bytes(Engine(model, **dict(CONFIG, max_running=2)).step_loop.pool)
    whole = pool_bytes(Engine(model, **CONFIG).step_loop.pool)
    path = str(checkpoint_path("tiny", 0, True))
    bad = random_text(rng, 11)  # a lone 3-token second chunk (no other prompt shares its call)
    ranks = launch(_rank, 2, (path, prompts, params, bad), device="cpu", timeout_s=60)
    for r in ranks:
        assert r["tokens"] == want
        assert r["errors"] == [None] * len(prompts) + ["RuntimeError: chunk failed"] and r["failed"] == 1
        assert r["owners"] == ranks[0]["owners"] and min(r["owners"][0]) >= 2, r["owners"]
        assert r["pool"] == half < whole


def test_placement_weighs_held_tokens_against_the_cached_prefix():
    p = Placer(3, chunk=4)
    a = list(range(10))
    assert p.choose("a", a, [5, 0, 0], [1, 0, 0]) == 1  # fewest tokens, then fewest requests, then index
    assert p.pending_tokens(1) == 10
    assert p.choose("b", [7] * 3, [5, 0, 0], [1, 0, 0]) == 2  # group 1 counts the pending 10 tokens
    p.settle("a")
    p.settle("b")
    assert p.pending_tokens(1) == 0
    c = a[:9] + [99]  # shares two blocks (8 tokens) with "a", on group 1
    assert p.cached(p._prefixes(c)) == [0, 8, 0]
    assert p.choose("c", c, [10, 15, 30], [1, 1, 1]) == 1  # 15 - 8 < 10
    assert p.choose("d", c, [10, 19, 30], [1, 1, 1]) == 0  # 19 - 8 > 10: the prefix does not pull it over
    assert p.cached(p._prefixes(c)) == [8, 8, 0]  # both groups may hold it now
    assert p.choose("e", a[:3] + [99] * 5, [12, 10, 30], [1, 1, 1]) == 1  # less than a block shared: by load
    assert Placer(2, chunk=None).choose("f", a, [3, 9], [0, 0]) == 0  # no prefix cache: by load alone
    small = Placer(2, chunk=1, keep=4)
    small.choose("g", a, [0, 0], [0, 0])
    assert len(small.holders) == 4  # the oldest prefixes are forgotten


def test_dp_attention_is_refused_where_it_cannot_run(cache, capsys):
    from flashrt.cli.commands import main

    assert main(["serve", "--dp-attention"]) == 2
    assert "dp_attention: spreads the requests over the expert-parallel groups, expected --ep >= 2, got --ep 1" \
        in capsys.readouterr().err
    with pytest.raises(ValueError, match="cuda_graph: decode steps with --dp-attention run eagerly"):
        check(ServeJob("tiny", 1, 2, EngineConfig(cuda_graphs=True), dp_attention=True))
    with pytest.raises(ValueError, match="dp_attention: expected a bool, got 'yes'"):
        check(ServeJob("tiny", 1, 2, EngineConfig(), dp_attention="yes"))
    with pytest.raises(ValueError, match="speculative: with --dp-attention the groups run different requests"):
        check(ServeJob("tiny", 1, 2, EngineConfig(speculative="dspark"), dp_attention=True))


def test_speculative_serving_across_ranks_asks_for_eager_steps_on_cuda(monkeypatch):
    """Speculative rounds across ranks run eagerly: on a CUDA device the graphs must be turned off."""
    import flashrt.engine.parallel_serve_run as psr

    monkeypatch.setattr(psr, "pick_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(psr.torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="cuda_graph: speculative rounds across ranks .* pass --no-cuda-graph"):
        check(ServeJob("tiny", 2, 1, EngineConfig(speculative="dspark")))
    assert check(ServeJob("tiny", 2, 1, EngineConfig(speculative="dspark", cuda_graphs=False))).world == 2
    assert check(ServeJob("tiny", 2, 1, EngineConfig())).world == 2  # plain steps replay from graphs


def test_digests_cover_the_shared_state_and_skip_the_timers():
    """The turn's digest (every rank alike) covers every request's tokens and the server-wide
    counters; the group digest covers the group's own counters; neither sees the ``*_seconds`` timers."""
    from flashrt.engine.parallel_groups import GroupedEngine
    from flashrt.engine.parallel_serve import state_digest
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model
    from flashrt.graphs.parallel import Layout, Parallel

    cfg = shipped_config("tiny")
    model = Model(cfg, init_weights(cfg, seed=0), parallel=Parallel(Layout(), "gather"))
    engine = GroupedEngine(model, **CONFIG)
    loop = engine.step_loop
    engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0))
    loop.add("open", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    loop.step()
    shared, group = state_digest(engine), loop.group_digest()
    loop.counters["step_seconds"] += 1.5
    assert (state_digest(engine), loop.group_digest()) == (shared, group)
    loop.counters["preemptions"] += 1  # one group's own work: its ranks compare it, the others cannot
    assert state_digest(engine) == shared and loop.group_digest() != group
    loop.requests["open"].seqs[0].tokens.append(4)
    assert state_digest(engine) != shared
