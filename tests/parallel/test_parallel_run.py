"""One model across 2 and 4 CPU processes (gloo): tensor and expert parallelism against one process.

Each test draws fresh weights and prompts; every rank cuts its shards from the same weights.
Greedy tokens must be identical to one process and the first logits equal within 1e-3 (the only
difference allowed is the order of fp32 sums: expert outputs and attention's output projection
are summed across ranks)."""
import dataclasses

import pytest
import torch

from flashrt.engine.generation import generate
from flashrt.engine.launch import launch
from flashrt.engine.parallel import parallel_generate
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.graphs.parallel import Layout, Parallel
from flashrt.graphs.shard import nbytes, shard_weights
from flashrt.kv.state import fixed_bytes_for

NEW = 5
TOLERANCE = 1e-3


def _rank(rank, device, cases, seed, report):
    """Every case on this rank: (tokens, rows, first logits, load, KV tiers, bytes held)."""
    torch.set_num_threads(1)
    out = {}
    for name, cfg, tp, ep, prompts, kv in cases:
        layout, dispatch = Layout(tp, ep, rank), kv.pop("dispatch", "gather")
        weights = shard_weights(init_weights(cfg, seed=seed), cfg, layout)
        held = (sum(nbytes(v) for v in weights.values()), _expert_bytes(weights))
        model = Model(cfg, weights, parallel=Parallel(layout, dispatch))
        r = parallel_generate(model, prompts, NEW, progress=report, **kv)
        tiers = r.state.tier_stats() if r.state is not None else {}
        first = None if r.first_logits is None else r.first_logits.numpy()  # plain data back to the launcher
        out[name] = (r.tokens, r.rows, first, r.load, tiers, held, r.step_capture)
    return out


def _expert_bytes(weights):
    return sum(nbytes(v) for k, v in weights.items() if k.startswith("layers.") and ".ffn.experts." in k)


def _prompts(rng, cfg, lengths):
    return [torch.randint(0, cfg.vocab_size, (n,), generator=rng).tolist() for n in lengths]


def _check(results, name, cfg, seed, prompts, reference=None):
    ref = reference or generate(Model(cfg, init_weights(cfg, seed=seed)), prompts, NEW)
    full = sum(nbytes(v) for v in init_weights(cfg, seed=seed).values())
    seen = []
    for rank, by_case in enumerate(results):
        tokens, rows, first, load, _, held, _ = by_case[name]
        assert tokens == ref.tokens, f"{name}: rank {rank} tokens differ from one process"
        if rows:
            err = (torch.from_numpy(first) - ref.first_logits[rows]).abs().max().item()
            assert err <= TOLERANCE, f"{name}: rank {rank} first logits differ by {err}"
        seen += rows
        # every MoE layer routes each token to top-k experts: the per-rank counts add up to that
        assert sum(load[-1]) == len(prompts) * cfg.n_activated_experts * cfg.n_layers
        assert held[0] < full  # every rank holds less than the whole model
    assert sorted(set(seen)) == list(range(len(prompts)))  # each sequence ran on some group
    return ref


def test_two_ranks_tensor_and_expert_parallel(rng):
    cfg = shipped_config("tiny")
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    prompts, long = _prompts(rng, cfg, (13, 6, 9)), _prompts(rng, cfg, (40, 40))  # ep2: group 1 idles a round
    budget = fixed_bytes_for(cfg, 1, 40 + NEW, page_entries=4) + 1024  # 7 main-KV pages on the device
    cases = [("tp2", cfg, 2, 1, prompts, {}), ("ep2", cfg, 1, 2, prompts, {}),
             ("ep2-cold", cfg, 1, 2, long, {"kv_budget": budget, "kv_page_entries": 4, "prefill_chunk": 8}),
             # decode through StepCapture's static-buffer steps and the fixed-shape MoE dispatch
             ("tp2-static", cfg, 2, 1, prompts, {"static_steps": True}),
             ("ep2-static-a2a", cfg, 1, 2, prompts[:1], {"static_steps": True, "dispatch": "all_to_all"})]
    results = launch(_rank, 2, (cases, seed), timeout_s=180)
    ref = _check(results, "tp2", cfg, seed, prompts)
    _check(results, "ep2", cfg, seed, prompts, ref)
    _check(results, "tp2-static", cfg, seed, prompts, ref)
    _check(results, "ep2-static-a2a", cfg, seed, prompts[:1])  # group 1 has no sequence: it serves its experts
    assert [r["tp2-static"][6]["eager"] for r in results] == [NEW - 1] * 2  # every decode step ran static
    assert [r["ep2-static-a2a"][6].get("eager", 0) for r in results] == [NEW - 1, 0]
    assert all(r["tp2"][6] is None for r in results)
    _check(results, "ep2-cold", cfg, seed, long)
    assert all(r["ep2-cold"][4]["cold_pages"] > 0 for r in results)  # pages spilled to host memory


def test_four_ranks_on_sixteen_experts(rng):
    cfg = dataclasses.replace(shipped_config("tiny"), n_routed_experts=16, n_activated_experts=4, name="tiny-16e")
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    prompts = _prompts(rng, cfg, (11, 11, 4))  # 3 sequences over 4 groups: one group only serves experts
    cases = [("tp2ep2", cfg, 2, 2, prompts, {}), ("ep4-a2a", cfg, 1, 4, prompts, {"dispatch": "all_to_all"}),
             ("tp2ep2-a2a", cfg, 2, 2, prompts, {"dispatch": "all_to_all"})]
    results = launch(_rank, 4, (cases, seed), timeout_s=120)
    ref = _check(results, "tp2ep2", cfg, seed, prompts)
    _check(results, "ep4-a2a", cfg, seed, prompts, ref)
    _check(results, "tp2ep2-a2a", cfg, seed, prompts, ref)
    assert [r["tp2ep2-a2a"][3] for r in results] == [r["tp2ep2"][3] for r in results]  # the same load, counted apart
    experts = _expert_bytes(init_weights(cfg, seed=seed))
    for name in ("tp2ep2", "ep4-a2a"):  # the routed experts are spread over the 4 ranks
        assert [r[name][5][1] for r in results] == [experts // 4] * 4
