"""Prefill chunks from static buffers (engine/prefill_capture.py): the same function as ``Model.forward``.

On the CPU the fake recorder of ``capture_helpers`` stands in for CUDA graphs (replay re-runs the
body into the recorded outputs), so keys, replays, the commit after a replay and rows reused by
request after request are checked here against an eager twin state; the capture itself runs on
a CUDA device (``-m gpu``)."""
import pytest
import torch

from flashrt.engine.prefill_capture import PrefillCapture, PrefillStates
from flashrt.kv.state import KVState

from capture_helpers import FakeRecorder, same_caches


def _states(model, batch, page_entries=4):
    pool = KVState.pool_for(model.cfg, batch, 64, model.device, None, page_entries)
    return model.new_state(batch, 64, pool=pool), model.new_state(batch, 64, pool=pool)


def _ids(model, rng, batch, n):
    return torch.randint(0, model.cfg.vocab_size, (batch, n), generator=rng)


@pytest.mark.parametrize("fake", [False, True])
def test_chunks_equal_forward(model, rng, fake):
    """Chunks of random lengths, three times over (each start position again with other ids, the
    rows emptied between rounds as the engine empties them): the last position's logits
    bit-identical to ``Model.forward`` in a twin state every chunk, the caches identical after
    each round. The pools grow on demand in the first round (a moved buffer is a new key); the
    third round replays every chunk."""
    B = 2
    eager, static = _states(model, B)
    recorder = FakeRecorder() if fake else None
    runner = PrefillCapture(model, static, record=recorder)
    lengths = torch.randint(1, 24, (3,), generator=rng).tolist()
    for round in range(3):
        if round == 2:
            before = dict(runner.stats)
        for n in lengths:
            ids = _ids(model, rng, B, n)
            want = model.forward(ids, state=eager)
            got = runner.forward(ids).clone()
            assert got.shape == (B, model.cfg.vocab_size) and torch.equal(want, got)
        same_caches(model, eager, static)
        for s in (eager, static):
            for row in range(B):
                s.release_row(row)
    s = runner.stats
    if fake:
        assert s["captured"] == before["captured"] == recorder.recorded == len(runner.graphs)
        assert s["replayed"] - before["replayed"] == len(lengths)
        assert s["eager"] == s["fallback"] == 0 and recorder.commits > 0
    else:
        assert s == {"captured": 0, "replayed": 0, "eager": 3 * len(lengths), "fallback": 0}


def test_key_holds_the_exact_start(model, rng):
    """One chunk length at two start positions records two graphs; the same start again replays."""
    eager, static = _states(model, 1)
    runner = PrefillCapture(model, static, record=FakeRecorder())
    for start in (0, 8):
        for s in (eager, static):
            s.release_row(0)
        if start:
            head = _ids(model, rng, 1, start)
            model.forward(head, state=eager)
            model.forward(head, state=static)
        ids = _ids(model, rng, 1, 5)
        assert torch.equal(model.forward(ids, state=eager), runner.forward(ids))
    assert [key[0] for key in runner.graphs] == [0, 8] and runner.stats["captured"] == 2
    for s in (eager, static):
        s.release_row(0)
    ids = _ids(model, rng, 1, 5)
    assert torch.equal(model.forward(ids, state=eager), runner.forward(ids))
    assert runner.stats["replayed"] == 1


def test_rows_apart_run_eagerly(model, rng):
    """Rows at different positions: no graph, the forward's result."""
    eager, static = _states(model, 2)
    for s in (eager, static):
        model.forward(_ids(model, torch.Generator().manual_seed(1), 2, 6), state=s)
        s.release_row(1)
    runner = PrefillCapture(model, static, record=FakeRecorder())
    ids = _ids(model, rng, 2, 4)
    assert torch.equal(model.forward(ids, state=eager), runner.forward(ids))
    assert runner.stats["eager"] == 1 and not runner.graphs
    same_caches(model, eager, static)


def test_bad_ids_name_the_argument(model):
    _, static = _states(model, 2)
    with pytest.raises(ValueError, match=r"ids: expected a \[2, S\] tensor, got \(3, 4\)"):
        PrefillCapture(model, static, record=FakeRecorder()).forward(torch.zeros(3, 4, dtype=torch.long))


def test_prefill_states_hand_out_free_states(model):
    pool = KVState.pool_for(model.cfg, 4, 64, model.device, None, 4)
    states = PrefillStates(model, pool, 64, record=FakeRecorder(), max_tokens=64, max_states=2, max_rows=3)
    assert states.wants(2, 32) and not states.wants(2, 33) and not states.wants(3, 32) and not states.wants(4, 1)
    a = states.state_for(2, lambda s: False)
    assert a.batch == 2 and states.state_for(2, lambda s: s is a) is None
    assert states.runner(a) is states.runners[2] and states.runner(model.new_state(2, 8, pool=pool)) is None
    states.state_for(1, lambda s: False)
    assert not states.wants(3, 8) and states.wants(1, 8)  # two states at most
    off = PrefillStates(model, pool, 64)  # on the CPU without a recorder: nothing is captured
    assert not off.wants(1, 1)


def test_engine_prompts_replay_and_decode_as_without(model, rng):
    """The serving engine with reusable prefill states (the fake recorder in place of CUDA graphs):
    staggered requests of repeated lengths, one longer than a chunk, n = 2 and a prompt sharing two chunks with an earlier one among
    them, decode the tokens of an engine without them; chunks replay, the pages all come back."""
    from flashrt.engine import Engine, SamplingParams

    from test_serving_engine import SMALL, prompts_for, run_staggered

    greedy = SamplingParams(temperature=0, max_tokens=5)
    prompts = prompts_for(rng, (7, 7, 12, 7, 40, 12, 7))
    prompts.append(prompts[4][:32] + prompts[0][:5])  # two chunks cached by the 40-token prompt
    arrivals = {0: [(prompts[0], greedy), (prompts[1], greedy)], 1: [(prompts[2], greedy)],
                3: [(prompts[3], SamplingParams(temperature=0, max_tokens=4, n=2)), (prompts[4], greedy)],
                6: [(prompts[5], greedy)], 9: [(prompts[6], greedy)], 30: [(prompts[7], greedy)]}
    want = run_staggered(Engine(model, **SMALL), arrivals)
    engine = Engine(model, **SMALL)
    loop = engine.step_loop
    assert not loop.prefill_states.capture  # on the CPU: never without a recorder
    loop.prefill_states = PrefillStates(model, loop.pool, 16, record=FakeRecorder())
    assert run_staggered(engine, arrivals) == want
    c = loop.counters
    assert c["prefill_captures"] > 0 and c["prefill_replays"] > 0
    assert c["prefill_captures"] + c["prefill_replays"] < c["prefill_forwards"]  # some groups found theirs busy
    assert loop.pool.pages_in_use == 0


def _cuda_tiny():
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    cfg = shipped_config("tiny")
    return Model(cfg, init_weights(cfg, seed=3, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 3])
def test_cuda_graph_chunks_equal_forward(rng, rows):
    """CUDA graphs: chunks of three lengths, three rounds with the rows emptied between them:
    every chunk captured (no host sync in it) or replayed, the logits and caches those of
    ``Model.forward`` in a twin state, bit for bit."""
    model = _cuda_tiny()
    eager, static = _states(model, rows)
    runner = PrefillCapture(model, static)
    for _ in range(3):
        for n in (16, 7, 16):
            ids = _ids(model, rng, rows, n).cuda()
            want = model.forward(ids, state=eager)
            assert torch.equal(want, runner.forward(ids).clone())
        same_caches(model, eager, static)
        for s in (eager, static):
            for row in range(rows):
                s.release_row(row)
    s = runner.stats
    assert s["eager"] == s["fallback"] == 0 and "uncapturable" not in s, s
    assert s["replayed"] >= 3 and "eager" not in runner.commits.values()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_with_prefill_graphs_decodes_as_without(rng):
    from flashrt.engine import Engine, SamplingParams

    from test_serving_engine import SMALL, prompts_for, run_staggered

    model = _cuda_tiny()
    greedy = SamplingParams(temperature=0, max_tokens=5)
    prompts = prompts_for(rng, (7, 7, 12, 7, 40, 12, 7))
    arrivals = {0: [(p, greedy) for p in prompts[:2]], 1: [(prompts[2], greedy)], 3: [(prompts[3], greedy),
                (prompts[4], greedy)], 6: [(prompts[5], greedy)], 9: [(prompts[6], greedy)]}
    want = run_staggered(Engine(model, **SMALL, cuda_graphs=True, prefill_graphs=False), arrivals)
    engine = Engine(model, **SMALL, cuda_graphs=True)
    assert run_staggered(engine, arrivals) == want
    c = engine.step_loop.counters
    assert c["prefill_captures"] > 0 and c["prefill_replays"] > 0, c


def test_a_chunk_that_cannot_be_recorded_runs_eagerly(model, rng):
    """A recorder that raises (an operation a CUDA graph cannot hold): the key stays eager, every
    chunk still gives the forward's logits and caches, nothing is recorded."""
    def failing(body):
        raise RuntimeError("operation not permitted when stream is capturing")

    eager, static = _states(model, 2)
    runner = PrefillCapture(model, static, record=failing)
    for _ in range(2):
        for n in (5, 9):
            ids = _ids(model, rng, 2, n)
            assert torch.equal(model.forward(ids, state=eager), runner.forward(ids))
        same_caches(model, eager, static)
        for s in (eager, static):
            for row in range(2):
                s.release_row(row)
    s = runner.stats
    assert s["captured"] == s["replayed"] == 0 and s["eager"] >= 2 and "capturing" in s["uncapturable"]
    assert set(runner.graphs.values()) == {"eager"}


def test_serve_help_gives_the_graph_limit():
    """``flashrt serve --help`` states the largest captured chunk and prefill state this module uses."""
    import argparse

    from flashrt.cli.serve import add_serve
    from flashrt.engine.prefill_capture import GRAPH_ROWS, GRAPH_TOKENS

    sub = argparse.ArgumentParser().add_subparsers()
    add_serve(sub)
    help_text = " ".join(sub.choices["serve"].format_help().split())
    assert f"at most {GRAPH_TOKENS:,} tokens (rows x chunk) and {GRAPH_ROWS} rows" in help_text
