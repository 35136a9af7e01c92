"""Verify steps from static buffers (engine/verify_capture.py): the same function as the eager verify.

On the CPU the static-buffer step runs eagerly, and a fake recorder stands in for CUDA graphs: it
runs the body once at record time and on each replay re-runs it into the recorded output tensors
(what a graph replay does to its memory), so the keying, the hand-back of the staged commit and
"no recapture in steady state" are checked here; the capture itself runs on a CUDA device (``-m gpu``).
Rows keep random counts of each chunk, so their positions drift apart (ragged starts)."""
import pytest
import torch

from flashrt.engine import speculative as spec
from flashrt.engine.step_capture import bucket
from flashrt.engine.draft_capture import DraftCapture
from flashrt.engine.verify_capture import VerifyCapture
from flashrt.kv.state import KVState

from capture_helpers import FakeRecorder, same_caches as _same_caches


class DraftRecorder:
    """The fake recorder for the draft: replay re-runs it into the recorded (ids, logits, confidence)."""

    def __call__(self, body):
        out = body()

        def replay():
            for a, b in zip(out, body(), strict=True):
                a.copy_(b)
        return replay, out


def _pair(model, rng, batch, prompt, page_entries=4):
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prompt), generator=rng).to(model.device)
    states = []
    for _ in range(2):
        pool = KVState.pool_for(model.cfg, batch, 96, model.device, None, page_entries)
        s = model.new_state(batch, 96, pool=pool)
        model.forward(ids, state=s)
        states.append(s)
    return states


def _round(model, eager, static, runner, ids, counts):
    want = spec.verify(model, eager, ids)[0]
    got = runner.verify(ids).clone()  # the eager verify lays chunks out from host positions, this one not
    assert torch.equal(want, got)
    spec.keep(model, eager, ids, counts)
    runner.keep(ids, counts)  # after a replay: the commit replayed from its own graph


@pytest.mark.parametrize("fake", [False, True])
def test_static_verify_equals_eager_ragged(model, rng, fake):
    """Chunks of k + 1 tokens (k varies), random kept counts: logits bit-identical to the eager
    verify every round, the caches identical after each commit; the fake recorder replays."""
    eager, static = _pair(model, rng, 3, 11)
    recorder = FakeRecorder() if fake else None
    runner = VerifyCapture(model, static, record=recorder)
    K, V = model.cfg.dspark_block_size, model.cfg.vocab_size
    drifted = False  # the rows' positions differed after some round (they may meet again by the end)
    for _ in range(14):
        k = int(torch.randint(1, K + 1, (1,), generator=rng))
        ids = torch.randint(0, V, (3, k + 1), generator=rng)
        counts = torch.randint(1, k + 2, (3,), generator=rng)
        _round(model, eager, static, runner, ids, counts)
        drifted |= len(set(eager.host_positions)) > 1
    assert drifted
    _same_caches(model, eager, static)
    s = runner.stats
    if fake:
        assert s["captured"] == recorder.recorded == len(runner.graphs) and s["replayed"] > 0
        assert s["captured"] + s["replayed"] == 14 and s["eager"] == 0
        assert recorder.commits == len(runner.commits) > 0 and "eager" not in runner.commits.values()
    else:
        assert s == {"captured": 0, "replayed": 0, "eager": 14, "fallback": 0}


@pytest.fixture(scope="module")
def wide_ratios(cfg):
    """tiny with compress ratio 4 in place of 2 (the shipped tiny and small configs have 1 and 2 only):
    the static chunk layout then pads rows over several group phases."""
    import dataclasses

    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    ratios = [4 if r == 2 else r for r in cfg.compress_ratios]
    wide = dataclasses.replace(cfg, compress_ratios=ratios)
    return Model(wide, init_weights(wide, seed=2))


def test_static_verify_equals_eager_wide_ratios(wide_ratios, rng):
    model = wide_ratios
    assert 4 in {model.cfg.ratio(l) for l in model.cfg.kv_source_layers}
    eager, static = _pair(model, rng, 4, 13)
    runner = VerifyCapture(model, static, record=FakeRecorder())
    K, V = model.cfg.dspark_block_size, model.cfg.vocab_size
    apart = 0  # rounds that started with the rows at different places in their ratio-4 groups
    for _ in range(16):
        apart += len({p % 4 for p in eager.host_positions}) > 1
        k = int(torch.randint(1, K + 1, (1,), generator=rng))
        _round(model, eager, static, runner, torch.randint(0, V, (4, k + 1), generator=rng),
               torch.randint(1, k + 2, (4,), generator=rng))
    assert apart > 0
    _same_caches(model, eager, static)
    assert runner.stats["replayed"] > 0


def test_keys_and_no_recapture_in_steady_state(model, rng):
    """Keys are (batch, k + 1, entry buckets, ...): a fixed k within one bucket records once."""
    eager, static = _pair(model, rng, 2, 20, page_entries=64)
    recorder = FakeRecorder()
    runner = VerifyCapture(model, static, record=recorder)
    V, ends = model.cfg.vocab_size, []
    for k in (2, 3):
        before = runner.stats["captured"]
        ends.append(static.host_positions[0] + k + 1)
        for _ in range(3):
            ids = torch.randint(0, V, (2, k + 1), generator=rng)
            _round(model, eager, static, runner, ids, torch.ones(2, dtype=torch.long))
        assert runner.stats["captured"] == before + 1  # positions 20..25: one bucket for every ratio
    keys = list(runner.graphs)
    assert [key[:2] for key in keys] == [(2, 3), (2, 4)]
    assert [dict(key[2]) for key in keys] == [{r: bucket(e // r) for r in runner.ratios} for e in ends]
    assert runner.stats["replayed"] == 4 and recorder.recorded == 2
    _same_caches(model, eager, static)


def test_decoder_with_verifier_equals_plain(model, rng):
    """The Decoder verifying through the static step emits the eager Decoder's tokens and state."""
    eager, static = _pair(model, rng, 2, 9)
    tok = torch.randint(0, model.cfg.vocab_size, (2,), generator=rng)
    a = spec.Decoder(model, eager, draft_tokens=2, force_accept=True)
    b = spec.Decoder(model, static, draft_tokens=2, force_accept=True,
                     verifier=VerifyCapture(model, static, record=FakeRecorder()),
                     drafter=DraftCapture(model, static, record=DraftRecorder()))
    ta = tb = tok
    for _ in range(5):
        ea, ta = a.step(ta, 8)
        eb, tb = b.step(tb, 8)
        assert ea == eb and torch.equal(ta, tb)
    vs, ds = b.verifier.stats, b.drafter.stats
    assert vs["captured"] + vs["replayed"] == 5 and vs["replayed"] >= 1
    assert ds == {"captured": 1, "replayed": 4, "eager": 0}  # the draft reads the state in place: one graph
    _same_caches(model, eager, static)


def test_a_step_that_syncs_stays_eager(model, rng, monkeypatch):
    """A host sync met part-way through the first run of a key (here: the fifth rms_norm under
    host_syncs_raise) keeps that key eager: nothing recorded, the step rerun from a fresh staging,
    the logits and caches those of the eager verify."""
    import contextlib

    from flashrt import ops
    from flashrt.engine import verify_capture

    guarded, calls, real = [False], [0], ops.rms_norm

    @contextlib.contextmanager
    def raising():
        guarded[0], calls[0] = True, 0
        try:
            yield
        finally:
            guarded[0] = False

    def rms_norm(x, w, eps):
        calls[0] += guarded[0]
        if guarded[0] and calls[0] == 5:
            raise RuntimeError("called a synchronizing CUDA operation")
        return real(x, w, eps)

    monkeypatch.setattr(verify_capture.checks, "host_syncs_raise", raising)
    monkeypatch.setattr(ops, "rms_norm", rms_norm)
    eager, static = _pair(model, rng, 2, 10)
    recorder = FakeRecorder()
    runner = VerifyCapture(model, static, record=recorder)
    for _ in range(3):
        ids = torch.randint(0, model.cfg.vocab_size, (2, 3), generator=rng)
        _round(model, eager, static, runner, ids, torch.randint(1, 4, (2,), generator=rng))
    assert recorder.recorded == 0 and runner.stats["eager"] == 3 and "synchroniz" in runner.stats["uncapturable"]
    assert set(runner.graphs.values()) == {"eager"}
    _same_caches(model, eager, static)


def test_decode_with_static_steps_equals_eager_decode(model, rng):
    """speculative.decode(cuda_graph=True) (static draft and verify; eager on the CPU) emits the
    eager loop's tokens and statistics over a ragged batch."""
    eager, static = _pair(model, rng, 3, 7)
    first = torch.randn(3, model.cfg.vocab_size, generator=rng)
    a, sa = spec.decode(model, eager, first, 10, draft_tokens="auto")
    b, sb = spec.decode(model, static, first, 10, draft_tokens="auto", cuda_graph=True)
    assert a == b and sa.k_counts == sb.k_counts and sa.accepted == sb.accepted
    _same_caches(model, eager, static)


def test_bad_arguments_are_named(model):
    with pytest.raises(ValueError, match="state"):
        VerifyCapture(model, "not a state")
    with pytest.raises(ValueError, match="capture"):
        VerifyCapture(model, model.new_state(1, 8), capture=True)
    runner = VerifyCapture(model, model.new_state(2, 8))
    with pytest.raises(ValueError, match="ids: expected a \\[2, k \\+ 1\\]"):
        runner.verify(torch.zeros(3, 2, dtype=torch.long))


def test_draft_capture_replays_the_draft(model, rng):
    """Greedy drafts from the recorded body equal Drafts.draft after every kind of state change;
    sampled drafts run eagerly; bad arguments are named."""
    eager, static = _pair(model, rng, 2, 13)
    runner = DraftCapture(model, static, record=DraftRecorder())
    V = model.cfg.vocab_size
    for _ in range(4):
        tok = torch.randint(0, V, (2,), generator=rng)
        want = model.drafts.draft(tok, eager)
        got = [t.clone() for t in runner.draft(tok, static)]
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        ids = torch.randint(0, V, (2, 3), generator=rng)
        counts = torch.randint(1, 4, (2,), generator=rng)
        for s in (eager, static):
            spec.verify(model, s, ids)
            spec.keep(model, s, ids, counts)
    assert runner.stats == {"captured": 1, "replayed": 3, "eager": 0}
    g = torch.Generator().manual_seed(5)
    runner.draft(tok, static, temperature=0.7, generator=g)
    assert runner.stats["eager"] == 1
    with pytest.raises(ValueError, match="next_ids"):
        runner.draft(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="state"):
        runner.draft(tok, eager)


def _cuda_model():
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    cfg = shipped_config("tiny")
    return Model(cfg, init_weights(cfg, seed=3, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("commit", ["eager", "graph"])
def test_captured_verify_replays_the_static_step(rng, commit):
    """CUDA graphs: ragged rounds of every k replay what the same static step computes eagerly;
    the kept tokens committed eagerly, or by the commit's own graph (VerifyCapture.keep), leave
    the caches the eager commit of the eager state leaves, round after round."""
    model = _cuda_model()
    eager, static = _pair(model, rng, 3, 19)
    plain, graphs = VerifyCapture(model, eager, capture=False), VerifyCapture(model, static)
    K, V = model.cfg.dspark_block_size, model.cfg.vocab_size
    for i in range(30):
        k = 1 + i % K
        ids = torch.randint(0, V, (3, k + 1), generator=rng).cuda()
        counts = torch.randint(1, k + 2, (3,), generator=rng)
        assert torch.equal(plain.verify(ids).clone(), graphs.verify(ids).clone())
        spec.keep(model, eager, ids, counts)
        if commit == "graph":
            graphs.keep(ids, counts)
            _same_caches(model, eager, static)
        else:
            spec.keep(model, static, ids, counts)
    _same_caches(model, eager, static)
    # every round ran from static buffers, captured or replayed (how many shapes repeat depends on
    # the random counts; the commit's own graphs add shapes), and repeated shapes replayed
    stats = graphs.stats
    assert stats["eager"] == 0 and stats["captured"] >= K and stats["replayed"] > 0, stats
    assert stats["captured"] + stats["replayed"] >= 30, stats
    if commit == "graph":
        assert any(callable(c) for c in graphs.commits.values()), graphs.commits  # commits replayed from graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_draft_and_decoder(rng):
    """Decoder rounds with the captured draft and verify emit what the eager Decoder emits."""
    model = _cuda_model()
    eager, static = _pair(model, rng, 2, 9)
    tok = torch.randint(0, model.cfg.vocab_size, (2,), generator=rng).cuda()
    a = spec.Decoder(model, eager, draft_tokens="auto")
    b = spec.Decoder(model, static, draft_tokens="auto", verifier=VerifyCapture(model, static),
                     drafter=DraftCapture(model, static))
    ta = tb = tok
    for _ in range(12):
        ea, ta = a.step(ta, 6)
        eb, tb = b.step(tb, 6)
        assert ea == eb and torch.equal(ta, tb)
    assert b.drafter.stats["replayed"] >= 10 and b.drafter.stats["eager"] == 0, b.drafter.stats
