"""``flashrt serve --tp / --ep`` with DSpark speculation, and a 4-rank ``--tp 2 --ep 2`` server (gloo on CPU).

The engines of the ranks run in lockstep (engine/parallel_serve.py): every turn rank 0 sends its
commands and a digest of its requests, and a rank whose digest differs stops. A speculative round
accepts a different number of drafts per row, so every rank must take the same decisions for the
digests to stay equal. With random weights the real draft is almost never accepted: the
launch-level test gives every rank the same oracle (each row's plain continuation with one wrong
draft per round, at a position cycling with the round and the row), so rows accept raggedly.

Greedy speculative output can part from plain output at a near-tie (the CPU reference rounds a
verify chunk's rows differently from a one-token step); the launch-level test checks one process
first and skips, naming the seed, in the rare case its speculative tokens differ from its plain ones.
The HTTP tests draw prompts whose greedy tokens lead the runner-up clearly (``_clear_prompts``):
ranks sum the attention and expert outputs in another order than one process, which can flip a
near-tie with or without speculation.
"""
import os
import re
import signal
import threading

import pytest
from parallel_text import random_text
from serve_client import get as _get, gone as _gone, post as _post, serve
from test_parallel_serve import CONFIG
import torch

from flashrt.engine import Engine, EngineConfig, SamplingParams
from flashrt.engine.launch import free_port, launch
from flashrt.engine.parallel_serve import Lockstep, follow
from flashrt.engine.parallel_serve_run import ServeJob, serve_parallel
from flashrt.engine.run import load_model
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.graphs.parallel import Layout, Parallel
from flashrt.graphs.shard import shard_weights

MAX = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX)


class EngineOracle:
    """Proposes each decode row's continuation from ``reference`` (prompt -> plain greedy output);
    draft ``(calls + row) % (K + 1) + 1`` of a row (none when past the block) is a random other id.
    The confidence scores alternate between all high and only the first high (an adaptive k of the
    whole block, then of 1); ``skew``: this rank's are turned around (its own k would differ)."""

    def __init__(self, engine, reference: dict, seed: int, skew: bool = False):
        self.engine, self.real, self.reference = engine, engine.model.drafts.draft, reference
        self.rng, self.calls, self.skew = torch.Generator().manual_seed(seed), 0, skew

    def __call__(self, next_ids, state, temperature=0.0, generator=None):
        out, logits, confidence = self.real(next_ids, state, temperature, generator)
        out, V, K = out.clone(), self.engine.model.cfg.vocab_size, out.shape[1] - 1
        for row, seq in enumerate(self.engine.step_loop.slots.owner):
            if seq is None:
                continue
            ref, t = self.reference[tuple(seq.request.prompt)], seq.computed - seq.prompt_len
            wrong = (self.calls + row) % (K + 1) + 1
            for j in range(1, K + 1):
                want = ref[t + j] if t + j < len(ref) else 0
                if j == wrong:
                    want = (want + 1 + int(torch.randint(0, V - 1, (1,), generator=self.rng))) % V
                out[row, j] = want
        self.calls += 1
        scores = torch.full_like(confidence, 4.0 if self.calls % 2 else -4.0)
        scores[:, 0] = 4.0
        return out, logits, -scores if self.skew else scores


def _lockstep_rank(rank, device, cases, seed, prompts, params, reference, report):
    """Every case: rank 0 leads an engine through ``Engine.generate``, the others follow it; rank
    0's tokens and every rank's speculative decisions (the statistics without timers)."""
    torch.set_num_threads(1)
    cfg, out = shipped_config("tiny"), {}
    for name, tp, ep, draft_tokens in cases:
        layout = Layout(tp, ep, rank)
        weights = shard_weights(init_weights(cfg, seed=seed), cfg, layout)
        engine = Engine(Model(cfg, weights, parallel=Parallel(layout, "replicated")), speculative="dspark",
                        draft_tokens=draft_tokens, **CONFIG)
        engine.model.drafts.draft = EngineOracle(engine, reference, seed, skew=name.endswith("skewed") and rank)
        tokens = None
        if rank == 0:
            engine.lockstep = lockstep = Lockstep(engine, tick_s=0.5)
            engine.start()
            done = engine.generate(prompts, params)
            engine.shutdown(grace_s=0)
            lockstep.close()
            assert lockstep.failed is None, lockstep.failed
            tokens = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in done]
        else:
            follow(engine)
        stats = engine.step_loop.spec.stats.as_dict()
        out[name] = (tokens, {k: v for k, v in stats.items() if not k.endswith("_seconds")})
    return out


def test_lockstep_engines_accept_alike_on_every_rank(rng):
    """tp 2 (k = 3) and ep 2 (adaptive k, rank 1's scores skewed): greedy requests get one
    process's plain tokens, a seeded sampled request completes, and every rank counts the same
    drafts, acceptances and rounds (a rank out of step would have stopped at the digest)."""
    cfg = shipped_config("tiny")
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=rng).tolist() for n in (13, 5, 9)]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.9, max_tokens=MAX, seed=11)]
    one = Engine(Model(cfg, init_weights(cfg, seed=seed)), **CONFIG)
    plain = [o.outputs[0].token_ids for o in one.generate(prompts[:2], GREEDY)]
    reference = {tuple(p): r for p, r in zip(prompts, plain + [[]])}
    single = Engine(Model(cfg, init_weights(cfg, seed=seed)), speculative="dspark", draft_tokens=3, **CONFIG)
    single.model.drafts.draft = EngineOracle(single, reference, seed)
    if [o.outputs[0].token_ids for o in single.generate(prompts[:2], GREEDY)] != plain:
        pytest.skip(f"seed {seed}: one process's speculative tokens part from its plain ones (a near-tie)")
    cases = [("tp2", 2, 1, 3), ("ep2-auto-skewed", 1, 2, "auto")]
    results = launch(_lockstep_rank, 2, (cases, seed, prompts, params, reference), timeout_s=240)
    for name, *_ in cases:
        tokens, stats = results[0][name]
        assert [t for t, _ in tokens[:2]] == plain, name
        assert len(tokens[2][0]) == MAX and tokens[2][1] == "length", name
        assert results[1][name][1] == stats, f"{name}: rank 1 decided otherwise than rank 0"
        assert 0 < stats["accepted"] < stats["drafted"], (name, stats)  # kept some, rolled back some
    assert set(results[0]["tp2"][1]["k_counts"]) <= {1, 2, 3}


def _serve(tp, ep, port, client, config):
    """Run the server until ``client()`` is done, then SIGTERM it; the ranks' process ids and its
    exit status (or the launcher's error)."""
    def client_then_stop(pids):
        try:
            client()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the parent hands it to rank 0, which drains and stops all
    job = ServeJob("tiny", tp, ep, config, port=port, log_level="warning", timeout_s=60, threads=1)
    return serve(job, client_then_stop)


TIE = 0.1  # a greedy token whose lead over the runner-up is below this may flip under another sum order


def _clear_prompts(rng, lengths, max_tokens):
    """Random prompts of ``lengths`` characters whose one-process greedy continuations lead the
    runner-up token by at least ``TIE`` at every step (redrawn otherwise: several ranks sum in
    another order, which may flip a near-tie), and those continuations' text."""
    torch.set_num_threads(1)
    model = load_model("tiny", torch.device("cpu"), 0, quiet=True)
    one = Engine(model, **CONFIG)
    prompts, texts = [], []
    for n in lengths:
        for _ in range(20):
            text = random_text(rng, n)
            out = one.generate([text], SamplingParams(max_tokens=max_tokens, temperature=0))[0].outputs[0]
            ids = one.encode(text) + out.token_ids
            top = model.forward(torch.tensor([ids[:-1]]), all_positions=True)[0, -len(out.token_ids):].topk(2).values
            if float((top[:, 0] - top[:, 1]).min()) >= TIE:
                break
        prompts.append(text)
        texts.append(out.text)
    return prompts, texts


def test_speculative_server_on_two_ranks_answers_like_one_process(cache, rng):
    """``serve --tp 2 --speculative dspark``: greedy completions are one process's (without
    speculation), the speculative counters show verify rounds, SIGTERM ends every rank with 0."""
    prompts, want = _clear_prompts(rng, (17, 6), 7)
    got = []

    def client():
        for p in prompts:
            status, body = _post(port, {"model": "tiny", "prompt": p, "max_tokens": 7, "temperature": 0})
            assert status == 200, body
            got.append(body["choices"][0]["text"])
        rounds = re.search(r"^flashrt_spec_rounds_total (\S+)", _get(port, "/metrics"), re.M)
        plain = re.search(r"^flashrt_spec_plain_steps_total (\S+)", _get(port, "/metrics"), re.M)
        assert rounds and plain and float(rounds.group(1)) + float(plain.group(1)) >= 1

    port = free_port()
    config = EngineConfig(**CONFIG, speculative="dspark", draft_tokens="auto")
    pids, box = _serve(2, 1, port, client, config)
    assert box.get("exit") == 0, box
    assert got == want
    _gone(pids)


def test_server_on_four_ranks_answers_concurrent_requests_like_one_process(cache, rng):
    """``serve --tp 2 --ep 2`` (4 processes): concurrent greedy completions get one process's text."""
    prompts, want = _clear_prompts(rng, (19, 7, 12), 5)
    got = {}

    def ask(i):
        got[i] = _post(port, {"model": "tiny", "prompt": prompts[i], "max_tokens": 5, "temperature": 0})

    def client():
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    port = free_port()
    pids, box = _serve(2, 2, port, client, EngineConfig(**CONFIG))
    assert box.get("exit") == 0, box
    for i, (status, body) in sorted(got.items()):
        assert status == 200, body
        assert body["choices"][0]["text"] == want[i], f"prompt {i}"
    assert len(got) == len(prompts) and len(pids) == 4
    _gone(pids)


def test_speculative_serve_without_draft_layers_is_refused_before_any_rank_starts(cache, tmp_path):
    import dataclasses

    cfg = dataclasses.replace(shipped_config("tiny"), dspark_block_size=0, n_mtp_layers=0)
    weights = {k: v for k, v in init_weights(shipped_config("tiny"), seed=0).items() if not k.startswith("mtp.")}
    Model(cfg, weights).save(tmp_path / "plain")
    job = ServeJob(str(tmp_path / "plain"), 2, 1, EngineConfig(speculative="dspark"), log_level="warning")
    with pytest.raises(ValueError, match="speculative: the model has no DSpark draft layers"):
        serve_parallel(job)
