"""Speculative ``generate`` / ``Decoder`` through the static-buffer steps (engine/spec_capture.py).

On the CPU the static steps run eagerly and :class:`TensorRecorder` stands in for CUDA graphs (a
replay re-runs the body into the recorded outputs, as a graph replay writes its memory), so the
wiring, the keys and the hand-back of what a verify step stages are exercised; the results are
compared bit for bit with the eager path. ``-m gpu``: the real CUDA-graph replays.
"""
import types

import pytest
import torch

from flashrt.engine import adaptive, generate, generation, speculative as spec
from flashrt.engine.spec_capture import SpecRunners, graphs_on
from flashrt.formats import QTensor
from flashrt.kv.staged import Staged

from spec_helpers import assert_same_greedy
from test_verify_capture import _cuda_model, _pair, _same_caches


def _copy_into(dst, src) -> None:
    """Copy every tensor of ``src`` into the same place of ``dst`` (tuples, lists, QTensor, Staged)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, QTensor):
        dst.data.copy_(src.data)
        dst.scale.copy_(src.scale)
    elif isinstance(dst, Staged):
        _copy_into(dst.rings, src.rings)
        _copy_into(dst.partials, src.partials)
    elif isinstance(dst, (tuple, list)):
        assert len(dst) == len(src)
        for a, b in zip(dst, src):
            _copy_into(a, b)


class TensorRecorder:
    """``record(body) -> (replay, outputs)`` on the CPU for any body: replay re-runs ``body`` and
    copies its results into the recorded outputs. A body without outputs (a captured commit) is
    counted in ``commits`` and replayed by running it again."""

    def __init__(self):
        self.recorded = self.replayed = self.commits = 0

    def __call__(self, body):
        out = body()
        if out is None:
            self.commits += 1
            return body, None
        self.recorded += 1

        def replay():
            self.replayed += 1
            _copy_into(out, body())
        return replay, out


def test_graphs_on_follows_the_plain_decode_switch(model):
    """The one switch for plain and speculative decode: ``cuda_graph`` when given, else CUDA."""
    cuda = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert graphs_on(cuda, None) is True and graphs_on(cuda, False) is False
    assert graphs_on(model, None) is False and graphs_on(model, True) is True
    with pytest.raises(ValueError, match="cuda_graph: expected True, False or None, got 'yes'"):
        graphs_on(model, "yes")


def test_generate_picks_the_static_path_with_the_switch(model, rng, monkeypatch):
    """generate(speculative=...) builds SpecRunners exactly when graphs_on says so (here forced on for a
    CPU model, as on CUDA by default), replays through them, and emits the eager run's tokens."""
    built = []

    class Runners(SpecRunners):
        def __init__(self, model, state):
            super().__init__(model, state, record=TensorRecorder())
            built.append(self)

    monkeypatch.setattr(generation, "SpecRunners", Runners)
    monkeypatch.setattr(generation, "graphs_on", lambda m, g: True if g is None else g)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=rng).tolist() for n in (9, 5, 12)]
    eager = generate(model, prompts, 9, speculative="dspark", cuda_graph=False)
    assert not built and eager.step_capture is None
    static = generate(model, prompts, 9, speculative="dspark")  # the default: the static path
    assert len(built) == 1
    assert static.tokens == eager.tokens and static.speculative["k_counts"] == eager.speculative["k_counts"]
    g = static.step_capture
    # every round's verify ran from its static buffers (captured on a shape's first round, replayed
    # after: whether a shape repeats depends on the prompts), as did the drafts; plain steps eagerly
    v, d, rounds = g["verify"], g["draft"], static.speculative["rounds"]
    assert rounds > 0 and v["eager"] == v["fallback"] == 0 and v["captured"] + v["replayed"] == rounds
    assert d["eager"] == 0 and d["captured"] + d["replayed"] >= rounds
    assert g["plain"]["eager"] == static.speculative["plain_steps"]
    assert g["replayed"] == g["verify"]["replayed"] + g["draft"]["replayed"]
    _same_caches(model, eager.state, static.state)


def test_generate_static_steps_on_the_cpu(model, rng):
    """cuda_graph=True on the CPU: the static-buffer steps run eagerly, the same tokens as eager."""
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=rng).tolist() for n in (7, 11)]
    a = generate(model, prompts, 6, speculative="dspark", draft_tokens=2, cuda_graph=False)
    b = generate(model, prompts, 6, speculative="dspark", draft_tokens=2, cuda_graph=True)
    assert a.tokens == b.tokens and b.step_capture["captured"] == 0 and b.step_capture["eager"] > 0


def test_plain_rounds_go_through_step_capture(model, rng):
    """Rounds with k = 0 (a limit of one token, or the cost table choosing no drafts) run the
    one-token static step: same tokens and state as the eager Decoder."""
    eager, static = _pair(model, rng, 3, 10)
    costly = adaptive.CostCurve((1,), ((1.0, 2.5, 3.5, 4.5),), (0.0,))  # k + 1 tokens at most, cost > k + 1: k = 0
    runners = SpecRunners(model, static, record=TensorRecorder())
    a = spec.Decoder(model, eager, costs=costly)
    b = spec.Decoder(model, static, costs=costly, verifier=runners.verifier, drafter=runners.drafter,
                     plain=runners.plain)
    ta = tb = torch.randint(0, model.cfg.vocab_size, (3,), generator=rng)
    for limit in (1, 5, 1, 4, 2):
        ea, ta = a.step(ta, limit)
        eb, tb = b.step(tb, limit)
        assert ea == eb and torch.equal(ta, tb)
    assert b.stats.plain_steps == a.stats.plain_steps == 5 and b.stats.rounds == 0
    assert runners.plain.stats["eager"] == 5 and runners.verifier.stats["captured"] == 0
    _same_caches(model, eager, static)


def test_decode_mixes_plain_and_verify_rounds(model, rng):
    """speculative.decode through SpecRunners (fake recorder) over a ragged batch: plain and verify
    rounds interleave (limits near the end), tokens, statistics and caches equal the eager loop's."""
    eager, static = _pair(model, rng, 3, 8)
    first = torch.randn(3, model.cfg.vocab_size, generator=rng)
    runners = SpecRunners(model, static, record=TensorRecorder())
    a, sa = spec.decode(model, eager, first, 11, draft_tokens=3)
    b, sb = spec.decode(model, static, first, 11, draft_tokens=3, runners=runners)
    assert a == b and sa.as_dict() | {"draft_seconds": 0, "verify_seconds": 0} == \
        sb.as_dict() | {"draft_seconds": 0, "verify_seconds": 0}
    st = runners.stats()
    assert st["verify"]["replayed"] > 0 and st["plain"]["eager"] == sb.plain_steps
    _same_caches(model, eager, static)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_decoder_replays_equal_the_static_steps(rng):
    """CUDA graphs: Decoder rounds (verify, draft, and k = 0 through StepCapture) replay what the
    same static steps compute uncaptured; tokens and caches identical."""
    model = _cuda_model()
    eager, static = _pair(model, rng, 3, 13)
    plain, graphs = SpecRunners(model, eager, capture=False), SpecRunners(model, static)
    dec = [spec.Decoder(model, s, verifier=r.verifier, drafter=r.drafter, plain=r.plain)
           for s, r in ((eager, plain), (static, graphs))]
    ta = tb = torch.randint(0, model.cfg.vocab_size, (3,), generator=rng).cuda()
    for i in range(16):
        limit = 1 if i % 4 == 3 else 4
        ea, ta = dec[0].step(ta, limit)
        eb, tb = dec[1].step(tb, limit)
        assert ea == eb and torch.equal(ta, tb)
    _same_caches(model, eager, static)
    st = graphs.stats()
    assert st["plain"]["replayed"] >= 2 and st["draft"]["replayed"] >= 10 and st["eager"] == 0, st
    assert st["verify"]["replayed"] + st["verify"]["captured"] == dec[1].stats.rounds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generate_speculative_default_replays(rng):
    """generate(speculative="dspark") on CUDA takes the captured path by default and emits the eager
    run's tokens (greedy; a near-tie of the target's logits may part them: spec_helpers)."""
    model = _cuda_model()
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=rng).tolist() for n in (17, 6, 11)]
    eager = generate(model, prompts, 12, speculative="dspark", cuda_graph=False)
    graphs = generate(model, prompts, 12, speculative="dspark")
    assert eager.step_capture is None
    g = graphs.step_capture
    assert g["verify"]["replayed"] + g["plain"]["replayed"] > 0 and g["draft"]["replayed"] > 0, g
    assert_same_greedy(model, prompts, eager.tokens, graphs.tokens)
