"""The serving engine with DSpark speculation (``Engine(model, speculative="dspark")``) on the tiny model (CPU).

- Greedy: staggered, ragged requests served with speculation get the tokens they get without it
  (the real draft, acceptance ~0 with random weights; and an oracle draft proposing the plain
  run's continuation, partly corrupted, so rows accept raggedly). Greedy outputs are compared
  with the near-tie rule of tests/engine/test_speculative.py (``assert_same_greedy``): a verify
  chunk and a one-token step round differently, so a row may part from the plain run only where
  the target's two best logits are within 0.05. Requests with a repetition penalty or logprobs
  decode plainly inside the speculating batch and match too.
- Stops: with every draft accepted, stop ids, stop strings and max_tokens still cut exactly.
- Sampling: the per-row rule is lossless for processed distributions (temperature, top_k, top_p,
  min_p), alone and end to end through a verify round of the model.
- Statistics in Engine.stats and /metrics; errors naming the option.
"""
import dataclasses
import math

import pytest
import torch

from prometheus_client.parser import text_string_to_metric_families

from flashrt import cli
from flashrt.engine import Engine, EngineConfig, SamplingParams
from flashrt.engine.outputs import request_output, visible_text
from flashrt.engine.sampling import SamplerRow, apply_penalties, make_generator
from flashrt.engine.server.metrics import Metrics
from flashrt.engine.spec_serve import ServeSpeculator, accept_sampled, processed_probs

SMALL = dict(prefill_chunk=16, max_step_tokens=40, max_running=8)
MAX = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX)
PLAIN_ROWS = (SamplingParams(temperature=0, max_tokens=MAX, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=MAX, logprobs=2))


def serve(engine, arrivals, deltas=None):
    """``arrivals``: step -> [(prompt, params)]; the finished requests' sequences in arrival order.
    ``deltas``: filled with each request's streamed token deltas, one per step that touched it."""
    core, reqs, done, step = engine.step_loop, [], {}, 0
    deltas = {} if deltas is None else deltas
    while step <= max(arrivals) or core.has_work:
        for prompt, params in arrivals.get(step, []):
            req = core.add(f"r{len(reqs)}", prompt, params)
            reqs.append(req)
        for req in core.step():
            deltas.setdefault(req.id, []).append(request_output(req).outputs[0].delta_token_ids)
            if req.finished:
                done[req.id] = req.seqs[0]
        step += 1
    return [done[r.id] for r in reqs]


class OracleDraft:
    """Proposes each decode row's continuation from ``reference`` (prompt -> plain greedy output),
    each position corrupted with probability ``corrupt``."""

    def __init__(self, engine, reference, rng, corrupt):
        self.engine, self.real, self.reference, self.rng, self.corrupt = engine, engine.model.drafts.draft, reference, rng, corrupt

    def __call__(self, next_ids, state, temperature=0.0, generator=None):
        out, logits, confidence = self.real(next_ids, state, temperature, generator)
        out, V = out.clone(), self.engine.model.cfg.vocab_size
        for row, seq in enumerate(self.engine.step_loop.slots.owner):
            if seq is None:
                continue
            ref, t = self.reference[tuple(seq.request.prompt)], seq.computed - seq.prompt_len
            for j in range(1, out.shape[1]):
                want = ref[t + j] if t + j < len(ref) else 0
                if float(torch.rand(1, generator=self.rng)) < self.corrupt:
                    want = (want + 1 + int(torch.randint(0, V - 1, (1,), generator=self.rng))) % V
                out[row, j] = want
        return out, logits, confidence


@pytest.fixture(scope="module")
def workload():
    rng = torch.Generator().manual_seed(2024)
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (21, 6, 13, 9, 17)]
    params = [GREEDY, GREEDY, PLAIN_ROWS[0], GREEDY, PLAIN_ROWS[1]]
    return {0: [(prompts[0], params[0]), (prompts[1], params[1])], 2: [(prompts[2], params[2])],
            3: [(prompts[3], params[3]), (prompts[4], params[4])]}


@pytest.fixture(scope="module")
def plain(model, workload):
    return serve(Engine(model, **SMALL), workload)


def check_same(model, workload, plain, got):
    """Token for token, with the near-tie rule of ``assert_same_greedy`` judged on the logits the
    request's sampler sees (penalized for a penalized request)."""
    for want, seq in zip(plain, got):
        w, g, params = want.output, seq.output, want.request.params
        j = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), None)
        if j is None:
            assert w == g
            continue
        prompt = want.request.prompt
        logits = model.forward(torch.tensor([prompt + w[:j]]))
        logits = apply_penalties(logits, [SamplerRow(params, None, prompt, w[:j])])[0]
        short = [float(logits.max() - logits[t]) for t in (w[j], g[j])]
        assert max(short) < 0.05, f"token {j} is {g[j]}, expected {w[j]} (below the best by {short}: no tie)"
    for s, g in zip(plain, got):
        assert g.finish_reason == s.finish_reason == "length"
        if s.logprobs is not None:
            assert len(g.logprobs) == len(s.logprobs) and all(len(lp.top) == 2 for lp in g.logprobs)


def test_real_draft_greedy_equals_plain(model, workload, plain):
    engine = Engine(model, speculative="dspark", draft_tokens="auto", **SMALL)
    got = serve(engine, workload)
    check_same(model, workload, plain, got)
    s = engine.stats()
    assert s["spec_rounds"] + s["spec_plain_steps"] > 0 and s["spec_accepted"] <= s["spec_drafted"]
    assert engine.step_loop.pool.pages_in_use == 0


def test_oracle_draft_ragged_acceptance_equals_plain_and_metrics(model, workload, plain, monkeypatch):
    engine = Engine(model, speculative="dspark", draft_tokens=3, **SMALL)
    reference = {tuple(s.request.prompt): s.output for s in plain}
    monkeypatch.setattr(model.drafts, "draft", OracleDraft(engine, reference, torch.Generator().manual_seed(7), 0.3))
    deltas = {}
    got = serve(engine, workload, deltas)
    check_same(model, workload, plain, got)
    for seq in got:  # a step streams the tokens it accepted together
        assert sum(deltas[seq.request.id], []) == seq.output
    assert max(len(d) for seq in got[:2] for d in deltas[seq.request.id]) > 1
    s = engine.stats()
    assert 0 < s["spec_accepted"] < s["spec_drafted"]
    assert s["spec_acceptance_rate"] == pytest.approx(s["spec_accepted"] / s["spec_drafted"])
    assert s["spec_mean_accepted_length"] > 1 and s["spec_verify_seconds"] > 0 and s["spec_draft_seconds"] > 0
    assert s["decode_rows"] < 5 * (MAX - 1)  # accepted drafts save steps (plain: one per token after the first)
    scraped = metric_values(Metrics(engine).render())
    for name in ("rounds", "plain_steps", "drafted", "accepted", "draft_seconds", "verify_seconds"):
        assert scraped[f"flashrt_spec_{name}_total"] == pytest.approx(s["spec_" + name])
    for name in ("acceptance_rate", "mean_accepted_length"):
        assert scraped[f"flashrt_spec_{name}"] == pytest.approx(s["spec_" + name])
    assert not any(k.startswith("flashrt_spec") for k in metric_values(Metrics(Engine(model, **SMALL)).render()))


def metric_values(body: bytes) -> dict:
    return {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def test_stops_cut_inside_accepted_drafts(model, workload, plain, monkeypatch):
    engine = Engine(model, speculative="dspark", draft_tokens=3, **SMALL)
    reference = {tuple(s.request.prompt): s.output for s in plain}
    monkeypatch.setattr(model.drafts, "draft", OracleDraft(engine, reference, torch.Generator().manual_seed(8), 0.0))
    prompt, ref = plain[0].request.prompt, plain[0].output
    first = ref.index(ref[4])
    text = engine.tokenizer.decode(ref)
    cut = next((text[i:i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2]), None)
    asks = {0: [(prompt, dataclasses.replace(GREEDY, stop_token_ids=(ref[4],))),
                (prompt, dataclasses.replace(GREEDY, max_tokens=6))]}
    if cut:
        asks[0].append((prompt, dataclasses.replace(GREEDY, stop=(cut,))))
    got = serve(engine, asks)
    assert got[0].output == ref[:first + 1] and got[0].finish_reason == "stop" and got[0].stop_reason == ref[4]
    assert got[1].output == ref[:6] and got[1].finish_reason == "length"
    if cut:
        assert got[2].finish_reason == "stop" and visible_text(got[2]) == text[:text.find(cut)]
        assert len(got[2].output) < MAX  # the tokens accepted past the stop string were dropped
    assert engine.stats()["spec_accepted"] > 0
    assert engine.step_loop.pool.pages_in_use == 0


def reference_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The sampling distribution as docs/serving.md states it, computed row by row in fp64 Python
    (independent of the engine's tensor code): softmax at the temperature; ``min_p`` (against the
    most likely token) and ``top_k`` drop tokens; ``top_p`` then keeps, most likely first, tokens
    of what is left until the kept mass reaches p of it (the most likely always stays)."""
    rows = []
    for row in logits.to(torch.float64).tolist():
        z = [v / params.temperature for v in row]
        m = max(z)
        e = [math.exp(v - m) for v in z]
        p = [x / sum(e) for x in e]
        order = sorted(range(len(p)), key=lambda i: -p[i])
        cand = [i for r, i in enumerate(order)
                if (params.top_k <= 0 or r < params.top_k) and p[i] >= params.min_p * p[order[0]]]
        mass, acc, keep = sum(p[i] for i in cand), 0.0, []
        for i in cand:
            if keep and acc >= params.top_p * mass:
                break
            keep.append(i)
            acc += p[i]
        rows.append([p[i] / acc if i in keep else 0.0 for i in range(len(p))])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
                                    SamplingParams(temperature=1.3, min_p=0.05),
                                    SamplingParams(temperature=0.5, top_p=0.6, min_p=0.02)])
def test_processed_probs_follow_the_stated_rules(params, rng):
    target = torch.randn(6, 50, generator=rng) * 2
    assert torch.allclose(processed_probs(target, params).to(torch.float64), reference_probs(target, params),
                          atol=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
                                    SamplingParams(temperature=1.3, min_p=0.05)])
def test_row_rule_is_lossless(params):
    g = torch.Generator().manual_seed(99)
    N, V, k = 20_000, 8, 2
    target = torch.randn(k + 1, V, generator=g) * 1.5
    drafts = torch.randint(0, V, (k,), generator=g)
    drafts[0] = int(target[0].argmax())  # a likely draft: acceptances and rejections both happen
    p = reference_probs(target, params)
    row = SamplerRow(params, make_generator(5, "cpu"), [1], [])
    joint, accepted = torch.zeros(V * V, dtype=torch.float64), 0
    for _ in range(N):
        a, t = accept_sampled(drafts, target, row)
        first = int(drafts[0]) if a > 0 else t
        second = int(drafts[1]) if a > 1 else t if a == 1 else int(torch.multinomial(p[1], 1, generator=g))
        joint[first * V + second] += 1
        accepted += a
    want = (p[0].unsqueeze(1) * p[1].unsqueeze(0)).reshape(-1)
    assert 0.5 * float((joint / N - want).abs().sum()) < 0.03
    assert 0 < accepted < k * N


def test_model_round_first_token_follows_processed_target(cfg):
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    small = dataclasses.replace(cfg, vocab_size=12, engram_compressed_vocab_size=12)
    model = Model(small, init_weights(small, seed=0))
    N, V, params = 1200, 12, SamplingParams(temperature=0.9, top_k=6)
    state = model.new_state(N, 16)
    model.forward(torch.tensor([[4, 9]]).expand(N, 2), state=state)
    rows = {r: SamplerRow(params, make_generator(1000 + r, "cpu"), [4, 9], []) for r in range(N)}
    probe = model.new_state(1, 16)
    model.forward(torch.tensor([[4, 9]]), state=probe)
    p = reference_probs(model.forward(torch.tensor([[5]]), state=probe), params)[0]
    real = model.drafts.draft

    def draft(*args):  # the first draft: the target's most likely token (the random draft's is often filtered out)
        out, logits, confidence = real(*args)
        out[:, 1] = int(p.argmax())
        return out, logits, confidence
    model.drafts.draft = draft
    spec = ServeSpeculator(model, 2)
    counts, _, emitted = spec.round(state, torch.full((N,), 5), rows, 2)
    assert 0.1 < float(p.max()) < 0.9  # the point-mass draft alone would fail the bound
    first = torch.bincount(torch.tensor([emitted[r][0] for r in range(N)]), minlength=V).to(torch.float64)
    assert 0.5 * float((first / N - p).abs().sum()) < 0.07
    assert 0 < spec.stats.accepted < spec.stats.drafted and counts == [len(emitted[r]) for r in range(N)]


def test_errors_name_the_option(cfg, weights, model, tmp_path, capsys):
    from flashrt.graphs.model import Model

    plain = Model(dataclasses.replace(cfg, dspark_block_size=0, n_mtp_layers=0), weights)
    with pytest.raises(ValueError, match="speculative: the model has no DSpark draft layers"):
        Engine(plain, speculative="dspark")
    with pytest.raises(ValueError, match="speculative: expected one of"):
        EngineConfig(speculative="eagle")
    for bad in (0, "many", True):
        with pytest.raises(ValueError, match="draft_tokens"):
            EngineConfig(speculative="dspark", draft_tokens=bad)
    with pytest.raises(ValueError, match=r"draft_tokens: expected an int in \[1, "):
        Engine(model, speculative="dspark", draft_tokens=cfg.dspark_block_size + 1)
    # with --tp the parent refuses a bad --draft-tokens before any rank starts
    assert cli.main(["serve", "--speculative", "dspark", "--draft-tokens", "9", "--tp", "2", "--device", "cpu"]) != 0
    err = capsys.readouterr().err
    assert "draft_tokens: expected an int in [1, 3]" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--speculative", "dspark", "--draft-tokens", "zero"])
    assert "--draft-tokens" in capsys.readouterr().err
    keep = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    Model(dataclasses.replace(cfg, dspark_block_size=0, n_mtp_layers=0), keep).save(tmp_path / "plain")
    assert cli.main(["serve", "--model", str(tmp_path / "plain"), "--speculative", "dspark", "--device", "cpu"]) != 0
    err = capsys.readouterr().err
    assert "no DSpark draft layers" in err and "--speculative" in err and "Traceback" not in err
