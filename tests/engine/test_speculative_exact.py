"""Greedy speculation is exact only if a chunk computes each position as one-token steps do.

On a ``small``-shaped tiny model (12 layers, small's compress ratios and KV sources, window 16)
a sequence of 36 tokens run one token per step and run as one chunk gives bit-identical logits at
every position, and a verify chunk from the middle of it (rows at a ratio boundary, window
wrapped) gives the logits of the one-token steps it replaces. The sequence is a constructed case
whose greedy token after position 35 flips when the reference's GEMMs round a row differently by
the chunk's height (ops/test_row_invariance.py).
"""
import dataclasses

import pytest
import torch

from flashrt.engine import speculative as spec
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model



@pytest.fixture(scope="module")
def small_shaped():
    cfg, s = shipped_config("tiny"), shipped_config("small")
    shaped = dataclasses.replace(
        cfg, n_layers=s.n_layers, compress_ratios=s.compress_ratios, kv_source_layers=s.kv_source_layers,
        index_source_layers=s.index_source_layers, candidate_source_layer=s.candidate_source_layer,
        engram_layer_ids=s.engram_layer_ids, dspark_target_layer_ids=[9, 10, 11], dspark_block_size=5,
        window_size=16)
    return Model(shaped, init_weights(shaped, seed=1))


def prompts(model, seed):
    """The speculative tests' three ragged prompts (5 to 39 tokens) from ``seed``."""
    rng = torch.Generator().manual_seed(seed)
    n = [int(x) for x in torch.randint(5, 40, (3,), generator=rng)]
    return [torch.randint(0, model.cfg.vocab_size, (k,), generator=rng).tolist() for k in n]


def sequence(model):
    """Prompt 2 from seed 448491446 and its first 10 greedy tokens."""
    return prompts(model, 448491446)[2] + [166, 138, 19, 245, 107, 282, 117, 91, 83, 126]


def stepwise(model, seq, state=None):
    state = state or model.new_state(1, 64)
    return torch.stack([model.forward(torch.tensor([[t]]), state=state)[0] for t in seq]), state


@pytest.fixture(scope="module")
def stepped(small_shaped):
    """(the sequence, its logits from one-token steps), computed once for the tests below."""
    seq = sequence(small_shaped)
    return seq, stepwise(small_shaped, seq)[0]


def test_chunk_equals_one_token_steps(small_shaped, stepped):
    model = small_shaped
    seq, steps = stepped
    chunk = model.forward(torch.tensor([seq]), all_positions=True)[0]
    bad = [p for p in range(len(seq)) if not torch.equal(steps[p], chunk[p])]
    assert not bad, f"positions {bad} differ between one-token steps and one chunk"
    assert int(chunk[-1].argmax()) == int(steps[-1].argmax())


@pytest.mark.parametrize("start", [30, 31])
def test_verify_chunk_equals_one_token_steps(small_shaped, stepped, start):
    """A verify chunk of 6 from ``start`` (across the ratio-2 boundary at 32, window wrapped)."""
    model = small_shaped
    seq, steps = stepped
    _, state = stepwise(model, seq[:start])
    ids = torch.tensor([seq[start:start + 6]])
    logits, _ = spec.verify(model, state, ids)
    spec.keep(model, state, ids, torch.tensor([ids.shape[1]]))
    assert torch.equal(logits[0], steps[start:start + ids.shape[1]])


def test_chunk_length_does_not_change_a_position(small_shaped):
    """Position 28 of one sequence computed by chunks of 29 to 34 tokens from position 0 (the
    Engram gate's reductions and the GEMMs see other heights): the same logits each time."""
    model = small_shaped
    seq = torch.tensor([prompts(model, 2)[0] + [284, 229, 280, 123, 302, 217]])
    want = model.forward(seq[:, :29], all_positions=True)[0, 28]
    for n in range(30, seq.shape[1] + 1):
        assert torch.equal(model.forward(seq[:, :n], all_positions=True)[0, 28], want), f"a chunk of {n} tokens"
