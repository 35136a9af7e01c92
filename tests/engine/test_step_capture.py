"""Decode steps from static buffers (engine/step_capture.py): the same function as Model.forward.

On the CPU the static-buffer step runs eagerly; the capture itself is checked on a CUDA device
(``-m gpu``). A step reads bucketed entry counts, block tables updated in place and masked cache
writes without host syncs, so these tests cross bucket edges and page allocations."""
import pytest
import torch

from flashrt.graphs.config import shipped_config
from flashrt.engine.step_capture import StepCapture, bucket, step_entries
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.kv.state import KVState
from flashrt.engine import generate


def test_bucket_bounds(rng):
    for e in torch.randint(1, 1 << 21, (2000,), generator=rng).tolist() + list(range(0, 300)):
        b = bucket(e)
        assert b >= e and b - e <= max(15, e // 8), (e, b)
        assert bucket(b) == b
    assert bucket(0) == 0


def test_step_entries_cover_every_ratio_and_change_together(rng):
    """Each ratio reads at least its entries, at most 1/8 (or 16 positions) more, and the shape key
    over a run of positions changes no more often than one rounded position does."""
    ratios = sorted(set(torch.randint(1, 200, (3,), generator=rng).tolist()) | {4, 128})
    start = int(torch.randint(1, 1 << 16, (1,), generator=rng))
    keys = set()
    for end in range(start, start + 3000):
        e = step_entries(end, ratios)
        for r in ratios:
            assert end // r <= e[r] <= (end + max(15, end // 8)) // r, (end, r, e[r])
        keys.add(tuple(sorted(e.items())))
    assert len(keys) <= len({bucket(end) for end in range(start, start + 3000)})
    # over a whole context, fewer distinct keys (captures) than rounding each ratio's count on its own
    ends = range(1, 1 << 15)
    whole = {tuple(sorted(step_entries(end, ratios).items())) for end in ends}
    assert len(whole) < len({tuple(bucket(end // r) for r in ratios) for end in ends})


def _states(model, batch, capacity, page_entries):
    pools = [KVState.pool_for(model.cfg, batch, capacity, model.device, None, page_entries) for _ in range(2)]
    return [model.new_state(batch, capacity, pool=p) for p in pools]


def test_static_step_equals_forward(model, rng):
    """30 greedy steps over two rows; pages of 4 entries fill during the decode (ratio 1 and 2
    sources), entries cross buckets: logits must be bit-identical to Model.forward."""
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=rng)
    eager, static = _states(model, 2, 64, page_entries=4)
    la, lb = model.forward(ids, state=eager), model.forward(ids, state=static)
    pages = [len(t.pages) for c in static.compressed.values() for t in c.main.tables]
    runner = StepCapture(model, static)
    for _ in range(30):
        tok = torch.multinomial(torch.softmax(la, -1), 1, generator=rng)[:, 0]  # not only argmax paths
        la = model.forward(tok.unsqueeze(1), state=eager)
        lb = runner.step(tok)
        assert torch.equal(la, lb)
    assert runner.stats == {"captured": 0, "replayed": 0, "eager": 30, "fallback": 0}
    assert [len(t.pages) for c in static.compressed.values() for t in c.main.tables] != pages
    assert static.host_positions == eager.host_positions == [49, 49]
    for l in cfg.kv_source_layers:  # the caches hold the same bytes
        a, b = eager.compressed[l], static.compressed[l]
        ka, kb = a.index_k.read_row(1, 0, 24), b.index_k.read_row(1, 0, 24)
        assert torch.equal(ka.data.view(torch.uint8), kb.data.view(torch.uint8))
        assert torch.equal(a.main.read_row(1, 24).data, b.main.read_row(1, 24).data)


def test_generate_with_graphs_same_tokens_ragged(model, rng):
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=rng).tolist() for n in (23, 9, 23)]
    plain = generate(model, prompts, 12)
    graphs = generate(model, prompts, 12, cuda_graph=True)
    assert graphs.tokens == plain.tokens
    assert graphs.step_capture["eager"] == 11 and plain.step_capture is None


@pytest.mark.parametrize("zero_copy", [True, False])
def test_cold_pages(model, rng, zero_copy, monkeypatch):
    """Most main-KV pages on the host: with the zero-copy gather the step stays static (the cold
    picks are read inside it); without it the step runs Model.forward. Same tokens either way."""
    from flashrt.kv.pages import PagePool

    if not zero_copy:
        monkeypatch.setattr(PagePool, "zero_copy", lambda pool, picks: False)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 60), generator=rng)
    plain = generate(model, ids, 6, kv_page_entries=4)
    small = generate(model, ids, 6, kv_page_entries=4, kv_budget=_budget(model, 66, 4), prefill_chunk=8,
                           cuda_graph=True)
    assert small.state.tier_stats()["cold_pages"] > 0
    assert small.step_capture["eager" if zero_copy else "fallback"] == 5
    assert small.tokens == plain.tokens


def _budget(model, capacity, page_entries):
    from flashrt.kv.state import entry_bytes, fixed_bytes_for

    page = page_entries * entry_bytes(model.cfg.head_dim, "fp4_b16")
    return fixed_bytes_for(model.cfg, 1, capacity, page_entries) + page * (2 * len(model.cfg.kv_source_layers) + 2)


def test_trash_page_is_never_handed_out(model):
    state = model.new_state(3, 400)
    for c in state.compressed.values():
        for row in range(3):
            c.main.reserve(row, 200)
    used = {p for c in state.compressed.values() for t in c.main.tables for _, p in t.pages}
    for c in state.compressed.values():
        for row in range(3):
            c.index_k.reserve(row, 200)
    assert state.pool.trash_row // state.pool.P not in used and len(used) > 16
    index_pages = {p for c in state.compressed.values() for row in c.index_k.pages for p in row}
    assert state.index_pool.trash_row // state.index_pool.P not in index_pages


def test_bad_arguments_are_named(model):
    with pytest.raises(ValueError, match="state"):
        StepCapture(model, "not a state")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="capture"):
            StepCapture(model, model.new_state(1, 8), capture=True)


def _cuda_pair(rng, page_entries):
    """tiny on CUDA after a 19-token prompt in two states: (the prompt's logits, an eager static-step
    runner of one, a capturing runner of the other)."""
    cfg = shipped_config("tiny")
    model = Model(cfg, init_weights(cfg, seed=3, device="cuda"))
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=rng).cuda()
    eager, static = _states(model, 2, 200, page_entries=page_entries)
    la, _ = model.forward(ids, state=eager), model.forward(ids, state=static)
    return la, StepCapture(model, eager, capture=False), StepCapture(model, static)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_steps_replay_the_eager_step(rng):
    """Captured replays compute what the same static-buffer step computes eagerly, step after step."""
    la, plain, graphs = _cuda_pair(rng, page_entries=4)
    for _ in range(40):
        tok = la.argmax(-1)
        la, lb = plain.step(tok).clone(), graphs.step(tok).clone()
        assert torch.equal(la, lb)
    assert graphs.stats["replayed"] > 20 and graphs.stats["captured"] >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_that_cannot_be_captured_runs_eagerly(rng, monkeypatch):
    """A step body that fails while it is being captured (as an operation a stream capture refuses
    would): that shape runs eagerly from then on, every step still the eager step's."""
    la, plain, graphs = _cuda_pair(rng, page_entries=64)
    body = graphs._body

    def failing(entries):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return body(entries)

    monkeypatch.setattr(graphs, "_body", failing)
    for _ in range(4):
        tok = la.argmax(-1)
        la, lb = plain.step(tok).clone(), graphs.step(tok).clone()
        assert torch.equal(la, lb)
    assert graphs.stats["captured"] == 0 and graphs.stats["eager"] == 4 and "uncapturable" in graphs.stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_steps_with_engram_tables_in_host_memory(rng):
    """host_pinned Engram: the step's rows are staged into static buffers before each replay; the
    logits follow Model.forward's prefetch path."""
    cfg = shipped_config("tiny")
    model = Model(cfg, init_weights(cfg, seed=3, device="cuda"), engram_placement="host_pinned")
    assert model.prefetch is not None
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=rng).cuda()
    eager, static = _states(model, 2, 200, page_entries=64)
    la, lb = model.forward(ids, state=eager), model.forward(ids, state=static)
    graphs = StepCapture(model, static)
    for _ in range(12):
        tok = la.argmax(-1)
        la, lb = model.forward(tok.unsqueeze(1), state=eager), graphs.step(tok).clone()
        assert float((la - lb).norm() / la.norm()) < 1e-5
    assert graphs.stats["replayed"] >= 8 and graphs.stats["fallback"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_steps_with_cold_pages(rng, monkeypatch):
    """Most main-KV pages on the host: with CAPTURE_COLD the steps (zero-copy gather, four KV
    segments in attention) are captured and replay what the eager static step computes."""
    import flashrt.engine.step_capture as dg
    from flashrt.kv.state import KVState as State

    monkeypatch.setattr(dg, "CAPTURE_COLD", True)
    cfg = shipped_config("tiny")
    model = Model(cfg, init_weights(cfg, seed=3, device="cuda"))
    budget = _budget(model, 200, 4)
    states = [model.new_state(1, 200, pool=State.pool_for(cfg, 1, 200, "cuda", budget, 4)) for _ in range(2)]
    ids = torch.randint(0, cfg.vocab_size, (1, 60), generator=rng).cuda()
    for c0 in range(0, 60, 8):
        la = model.forward(ids[:, c0:c0 + 8], state=states[0])
        lb = model.forward(ids[:, c0:c0 + 8], state=states[1])
    assert states[1].tier_stats()["cold_pages"] > 0
    plain, graphs = StepCapture(model, states[0], capture=False), StepCapture(model, states[1])
    for _ in range(12):
        tok = la.argmax(-1)
        la, lb = plain.step(tok).clone(), graphs.step(tok).clone()
        assert torch.equal(la, lb)
    assert graphs.stats["replayed"] >= 6 and graphs.stats["fallback"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_that_syncs_stays_eager(rng, monkeypatch):
    """An op that reads a value on the host (here: a wrapped rms_norm) would break the capture: the
    first run of the shape detects the sync, the shape is kept eager, the logits are unchanged."""
    from flashrt import ops

    cfg = shipped_config("tiny")
    model = Model(cfg, init_weights(cfg, seed=3, device="cuda"))
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=rng).cuda()
    eager, static = _states(model, 2, 200, page_entries=64)
    la, lb = model.forward(ids, state=eager), model.forward(ids, state=static)
    real = ops.rms_norm

    def syncing(x, w, eps):
        float(x.abs().max())  # a host read
        return real(x, w, eps)

    monkeypatch.setattr(ops, "rms_norm", syncing)
    plain, graphs = StepCapture(model, eager, capture=False), StepCapture(model, static)
    for _ in range(3):
        tok = la.argmax(-1)
        la, lb = plain.step(tok).clone(), graphs.step(tok).clone()
        assert torch.equal(la, lb)
    assert graphs.stats["captured"] == 0 and graphs.stats["eager"] == 3 and "synchroniz" in graphs.stats["uncapturable"]
