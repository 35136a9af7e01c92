"""A prompt chunk whose top-k would take every visible entry skips the indexer and attends through
``ops.prefix_attention``: the same logits as the indexer's path (bit for bit on the reference
backend, whose picks are then the same tensor), in one chunk or chunked across the point where the
top-k starts to choose; the indexer runs again once entries outnumber the top-k."""
import dataclasses

import pytest
import torch

import flashrt
from flashrt import ops, refmath
from flashrt.graphs import attention as attention_graph
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model


@pytest.fixture(scope="module")
def wide():
    """``tiny`` with a top-k of 12 entries (candidate blocks: 3 of 4 entries), so prompts of up to 12
    tokens take every entry at ratio 1 and up to 25 at ratio 2."""
    from flashrt.graphs.config import shipped_config
    cfg = dataclasses.replace(shipped_config("tiny"), index_topk=12, candidate_topk_blocks=3)
    return cfg, Model(cfg, init_weights(cfg, seed=1))


def _calls(monkeypatch, name):
    seen = []
    real = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a, **k: seen.append(a[0].shape) or real(*a, **k))
    return seen


def _logits(model, ids, chunks, sparse, monkeypatch):
    with monkeypatch.context() as m:
        if sparse:
            m.setattr(attention_graph.Attention, "_takes_every_entry", lambda *a: False)
        state = model.new_state(ids.shape[0], ids.shape[1] + 1)
        out, at = [], 0
        for n in chunks:
            out.append(model.forward(ids[:, at:at + n], state=state, start_pos=at, all_positions=True))
            at += n
        return torch.cat(out, dim=1)


@pytest.mark.parametrize("chunks", [(10,), (4, 6), (9, 7, 5)])
def test_same_logits_as_the_indexer_path(wide, rng, monkeypatch, chunks):
    cfg, model = wide
    ids = torch.randint(0, cfg.vocab_size, (3, sum(chunks)), generator=rng)
    with flashrt.use_backend("reference"):
        scores = _calls(monkeypatch, "index_scores")
        prefix = _calls(monkeypatch, "prefix_attention")
        got = _logits(model, ids, chunks, False, monkeypatch)
        dense_calls, index_calls = len(prefix), len(scores)
        want = _logits(model, ids, chunks, True, monkeypatch)
    assert torch.equal(got, want)
    n_layers = cfg.n_layers
    if sum(chunks) <= cfg.index_topk:  # every chunk took every entry: no indexer at all
        assert index_calls == 0 and dense_calls == n_layers * len(chunks)
    else:  # the ratio-1 sources chose by top-k in the last chunk
        assert index_calls > 0


def test_decode_steps_keep_the_indices(wide, rng, monkeypatch):
    cfg, model = wide
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=rng)
    state = model.new_state(2, 8)
    model.forward(ids, state=state)
    prefix = _calls(monkeypatch, "prefix_attention")
    model.forward(ids[:, :1], state=state, start_pos=5)
    assert prefix == []


def test_the_kernels_give_the_indexer_paths_logits(wide, rng, monkeypatch):
    """On the cuda backend (the prefix kernel against the indexer, top-k and sparse kernels): every
    ``prefix_attention`` call equals the sparse kernel over the indices it implies, on the call's own
    inputs, up to bf16 rounding (the kernels sum in other orders); the logits of the two paths agree
    loosely (a random model amplifies those last-bit differences layer after layer)."""
    pytest.importorskip("triton")
    from kernel_check import DEVICE, kernels_available, record_launches, rel_err
    if not kernels_available():
        pytest.skip("cuda backend unavailable")
    cfg = wide[0]
    model = Model(cfg, init_weights(cfg, seed=1, device=DEVICE))  # the GPU's, where there is one (else the interpreter's)
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=rng).to(DEVICE)
    errors, real = [], ops.prefix_attention

    def checked(q, kv, positions, ring_start, window, entries, visible, sink, scale):
        out = real(q, kv, positions, ring_start, window, entries, visible, sink, scale)
        implied = refmath.prefix_indices(positions, ring_start, window, entries, visible)
        errors.append(rel_err(out.float(), ops.sparse_attention(q, kv, implied, sink, scale).float()))
        return out

    with flashrt.use_backend("cuda"):
        want = _logits(model, ids, (7,), True, monkeypatch)
        names = record_launches(monkeypatch)
        monkeypatch.setattr(ops, "prefix_attention", checked)
        got = _logits(model, ids, (7,), False, monkeypatch)
    assert names.count("_prefix_attention_kernel") == cfg.n_layers
    assert names.count("_sparse_attention_kernel") == cfg.n_layers  # only the checks' calls
    assert len(errors) == cfg.n_layers and max(errors) < 5e-3, errors
    assert ((got - want).norm() / want.norm()) < 5e-2


def _chunked(model, ids, prompt, chunks, sparse_max_queries):
    """Logits of every position: a prompt, then chunks of a few queries a sequence (as a speculative
    verify's), under a profile with ``sparse_max_queries``."""
    from flashrt import profiles
    base = profiles.active_profile()
    with profiles.using(dataclasses.replace(base, sparse_max_queries=sparse_max_queries)):
        state = model.new_state(ids.shape[0], ids.shape[1] + 1)
        out, at = [model.forward(ids[:, :prompt], state=state, all_positions=True)], prompt
        for n in chunks:
            out.append(model.forward(ids[:, at:at + n], state=state, start_pos=at, all_positions=True))
            at += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("prompt,chunks", [(5, (2, 3, 4)), (11, (3, 5)), (20, (4, 2, 6))])
def test_a_few_queries_take_the_decode_path_with_the_same_logits(wide, rng, monkeypatch, prompt, chunks):
    """``sparse_max_queries``: chunks of up to that many queries a sequence attend through the
    indexer's picks and ``sparse_attention`` (window indices on the window-only layers) instead of
    ``prefix_attention``, whether or not the top-k would take every entry: the same logits as the
    prefix path (to float rounding: the two ops sum in other orders); longer chunks keep the prefix
    path."""
    cfg, model = wide
    ids = torch.randint(0, cfg.vocab_size, (2, prompt + sum(chunks)), generator=rng)
    with flashrt.use_backend("reference"):
        prefix = _calls(monkeypatch, "prefix_attention")
        sparse = _calls(monkeypatch, "sparse_attention")
        want = _chunked(model, ids, prompt, chunks, 1)
        assert {s[1] for s in prefix} & set(chunks)  # the chunks' window-only layers at least
        prefix.clear(), sparse.clear()
        got = _chunked(model, ids, prompt, chunks, max(chunks))
        # every layer of every chunk takes the sparse path; only the prompt (longer) may take the prefix one
        assert {s[1] for s in prefix} <= {prompt}
        assert [s[1] for s in sparse if s[1] != prompt] == [n for n in chunks for _ in range(cfg.n_layers)]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()

