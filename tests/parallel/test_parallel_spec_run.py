"""``flashrt run --tp / --ep --speculative dspark`` (gloo on CPU): every rank drafts with its replica
of the draft layers and verifies in lockstep; greedy tokens are one process's without speculation.

With random weights the real draft is almost never accepted, so the launch-level test replaces
the draft's proposals on every rank by the same oracle (the plain run's continuation with one
wrong draft per round, a random id at a position that cycles through the block): rounds then
accept none, some or all of their drafts and roll back the rest, and every rank must count the
same acceptances and keep the same tokens.

Greedy speculative output can part from plain output at a near-tie, because the CPU reference
rounds a verify chunk's rows differently from a one-token step; each test first checks that one
process's speculative tokens equal its plain ones on the drawn prompt and skips (naming the seed)
in the rare case they do not: that is a one-device property, not what these tests are about.
Ranks sum attention and expert outputs in another order than one process, which can flip a
near-tie with or without speculation, so the prompts are drawn without near-ties (``_clear``).
"""
import json

import pytest
from parallel_text import random_text
import torch

from flashrt.cli import commands as cli
from flashrt.engine.generation import generate
from flashrt.engine.launch import launch
from flashrt.engine.parallel_run import run_parallel
from flashrt.engine.parallel_whole import generate_whole
from flashrt.engine.run import load_model, run
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.graphs.parallel import Layout, Parallel
from flashrt.graphs.shard import shard_weights

NEW = 9
PAIRS = 2 * 8  # (token, expert) pairs per token in tiny: top-2 experts, 8 layers
TIE = 0.1  # a greedy token whose lead over the runner-up is below this may flip under another sum order


def _clear(model, ids: list[int], new: int) -> bool:
    """Whether each of the last ``new`` tokens of ``ids`` leads the runner-up by ``TIE`` or more
    (ranks sum in another order than one process: a near-tie may flip)."""
    top = model.forward(torch.tensor([ids[:-1]]), all_positions=True)[0, -new:].topk(2).values
    return float((top[:, 0] - top[:, 1]).min()) >= TIE


class OracleDraft:
    """The real draft runs (its collectives and rings as always); its proposals are replaced by
    ``reference`` (the prompt's plain greedy continuation) with draft ``calls % (K + 1) + 1`` (none
    when past the block) turned into a random other id. Its confidence scores alternate between all
    high and only the first high (an adaptive k of the whole block, then of 1); ``skew``: this
    rank's scores are turned around (an adaptive k of its own would differ from rank 0's)."""

    def __init__(self, model, prompt_len: int, reference: list[int], seed: int, skew: bool = False):
        self.real, self.V, self.skew = model.drafts.draft, model.cfg.vocab_size, skew
        self.prompt_len, self.reference, self.calls, self.first = prompt_len, reference, 0, None
        self.rng = torch.Generator().manual_seed(seed)

    def __call__(self, next_ids, state, temperature=0.0, generator=None):
        out, logits, confidence = self.real(next_ids, state, temperature, generator)
        if self.first is None:  # the real draft's first logits and scores
            self.first = (logits.clone(), confidence.clone())
        out, K = out.clone(), out.shape[1] - 1
        t = state.host_positions[0] - self.prompt_len  # next_ids is new token t
        wrong, self.calls = self.calls % (K + 1) + 1, self.calls + 1
        for j in range(1, K + 1):
            want = self.reference[t + j] if t + j < len(self.reference) else 0
            if j == wrong:
                want = (want + 1 + int(torch.randint(0, self.V - 1, (1,), generator=self.rng))) % self.V
            out[0, j] = want
        scores = torch.full_like(confidence, 4.0 if self.calls % 2 else -4.0)
        scores[:, 0] = 4.0
        return out, logits, -scores if self.skew else scores


def _job(**kw):
    job = dict(max_new_tokens=NEW, temperature=0.0, prefill="exact", seed=3, eos=None, kv_budget=None,
               prefill_chunk=None, cuda_graph=False, speculative="dspark", draft_tokens="auto")
    job.update(kw)
    return job


def _rank(rank, device, cases, seed, prompt, reference, report):
    """Every case on this rank: (new tokens, the speculative statistics without timers, the real
    draft's first logits and confidence scores)."""
    torch.set_num_threads(1)
    cfg, out = shipped_config("tiny"), {}
    for name, tp, ep, job in cases:
        layout = Layout(tp, ep, rank)
        model = Model(cfg, shard_weights(init_weights(cfg, seed=seed), cfg, layout), parallel=Parallel(layout))
        oracle = model.drafts.draft = OracleDraft(model, len(prompt), reference, seed,
                                                  skew=name.endswith("skewed") and rank)
        r = generate_whole(model, prompt, job, report)
        out[name] = (r.tokens[0], _decisions(r.speculative), [t.numpy() for t in oracle.first])
    return out


def _decisions(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if not k.endswith("_seconds")}


def _one_process(cfg, seed, prompt, job):
    model = Model(cfg, init_weights(cfg, seed=seed))
    oracle = model.drafts.draft = OracleDraft(model, len(prompt), job.pop("reference"), seed)
    r = generate(model, [prompt], NEW, temperature=job["temperature"], seed=job["seed"], speculative="dspark",
                 draft_tokens=job["draft_tokens"])
    return r.tokens[0], _decisions(r.speculative), oracle.first


def test_oracle_acceptance_and_rollback_agree_on_every_rank(rng):
    """tp 2 and ep 2, fixed and adaptive k, greedy and seeded sampling: every rank keeps the same
    tokens, accepts and rolls back the same drafts as one process does; greedy tokens are the
    plain ones. With rank 1's confidence scores skewed, every rank still verifies rank 0's k."""
    cfg = shipped_config("tiny")
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    one = Model(cfg, init_weights(cfg, seed=seed))
    for _ in range(20):  # a prompt without near-ties
        prompt = torch.randint(0, cfg.vocab_size, (11,), generator=rng).tolist()
        plain = generate(one, [prompt], NEW).tokens[0]
        if _clear(one, prompt + plain, NEW):
            break
    cases = [("tp2-k2", 2, 1, _job(draft_tokens=2)), ("ep2-auto", 1, 2, _job()),
             ("tp2-sampled", 2, 1, _job(temperature=0.8)), ("tp2-auto-skewed", 2, 1, _job())]
    want = {name: _one_process(cfg, seed, prompt, dict(job, reference=plain)) for name, _, _, job in cases}
    if want["tp2-k2"][0] != plain or want["ep2-auto"][0] != plain:
        pytest.skip(f"seed {seed}: one process's speculative tokens part from its plain ones (a near-tie)")
    results = launch(_rank, 2, (cases, seed, prompt, plain), timeout_s=240)
    for name, _, _, _ in cases:
        for rank, by_case in enumerate(results):
            assert by_case[name][:2] == want[name][:2], f"{name}: rank {rank} differs from one process"
            for got, ref in zip(by_case[name][2], want[name][2]):  # the replicated draft's logits and scores
                err = (torch.from_numpy(got) - ref).abs().max().item()
                assert err <= 1e-3, f"{name}: rank {rank}'s draft differs from one process's by {err}"
        stats = want[name][1]
        assert stats["rounds"] >= 1 and stats["drafted"] >= stats["rounds"]
    for name in ("tp2-k2", "ep2-auto", "tp2-auto-skewed"):
        assert results[0][name][0] == plain
        assert 0 < want[name][1]["accepted"] < want[name][1]["drafted"], want[name]  # some kept, some rolled back
    assert set(want["tp2-k2"][1]["k_counts"]) <= {1, 2}


def test_run_speculative_on_two_ranks_matches_one_process(cache, rng, capsys):
    """The real draft through ``flashrt run --tp 2`` (the CLI) and ``run_parallel(ep=2)``: one
    process's plain tokens, a speculative report, one MoE load entry per verify round or plain step."""
    model = load_model("tiny", torch.device("cpu"), 0, quiet=True)
    for _ in range(20):  # a prompt without near-ties
        prompt = random_text(rng, 23)
        plain = run("tiny", prompt, NEW, quiet=True)
        if _clear(model, model.tokenizer.encode(prompt) + plain["new_token_ids"], NEW):
            break
    spec = run("tiny", prompt, NEW, quiet=True, speculative="dspark", draft_tokens=2)
    if spec["new_token_ids"] != plain["new_token_ids"]:
        pytest.skip("one process's speculative tokens part from its plain ones on this prompt (a near-tie)")
    assert cli.main(["run", "--json", "--tp", "2", "--prompt", prompt, "--max-new-tokens", str(NEW),
                     "--speculative", "dspark", "--collective-timeout", "120"]) == 0
    tp = json.loads(capsys.readouterr().out)
    ep = run_parallel("tiny", prompt, NEW, quiet=True, ep=2, speculative="dspark", draft_tokens=2, timeout_s=120)
    for out in (tp, ep):
        assert out["new_token_ids"] == plain["new_token_ids"]
        s = out["speculative"]
        assert s["rounds"] >= 1
        steps = out["parallel"]["expert_pairs_per_rank_per_decode_step"]
        assert len(steps) == s["rounds"] + s["plain_steps"]
        ks = {int(k) for k in s["k_counts"]}
        assert {sum(p) for p in steps} <= {PAIRS * (k + 1) for k in ks | {0}}
    assert set(ep["speculative"]["k_counts"]) <= {1, 2}
    assert ep["speculative"]["k_counts"] == spec["speculative"]["k_counts"]
    assert ep["parallel"]["moe_dispatch"] == "replicated"


def test_bad_speculative_options_are_refused_before_any_rank_starts(cache, tmp_path):
    with pytest.raises(ValueError, match=r"draft_tokens: expected an int in \[1, 3\]"):
        run_parallel("tiny", "a fox", 2, tp=2, speculative="dspark", draft_tokens=7)
    with pytest.raises(ValueError, match="speculative: expected one of \\['dspark'\\]"):
        run_parallel("tiny", "a fox", 2, tp=2, speculative="medusa")
