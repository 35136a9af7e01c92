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


def sequence(model):
    rng = torch.Generator().manual_seed(448491446)
    n = [int(x) for x in torch.randint(5, 40, (3,), generator=rng)]
    prompts = [torch.randint(0, model.cfg.vocab_size, (k,), generator=rng).tolist() for k in n]
    return prompts[2] + [166, 138, 19, 245, 107, 282, 117, 91, 83, 126]


def stepwise(model, seq, state=None):
    state = state or model.new_state(1, 64)
    return torch.stack([model.forward(torch.tensor([[t]]), state=state)[0] for t in seq]), state


def test_chunk_equals_one_token_steps(small_shaped):
    model = small_shaped
    seq = sequence(model)
    steps, _ = stepwise(model, seq)
    chunk = model.forward(torch.tensor([seq]), all_positions=True)[0]
    bad = [p for p in range(len(seq)) if not torch.equal(steps[p], chunk[p])]
    assert not bad, f"positions {bad} differ between one-token steps and one chunk"
    assert int(chunk[-1].argmax()) == int(steps[-1].argmax())


@pytest.mark.parametrize("start", [30, 31])
def test_verify_chunk_equals_one_token_steps(small_shaped, start):
    """A verify chunk of 6 from ``start`` (across the ratio-2 boundary at 32, window wrapped)."""
    model = small_shaped
    seq = sequence(model)
    steps, _ = stepwise(model, seq)
    _, state = stepwise(model, seq[:start])
    ids = torch.tensor([seq[start:start + 6]])
    logits, _ = spec.verify(model, state, ids)
    spec.keep(model, state, ids, torch.tensor([ids.shape[1]]))
    assert torch.equal(logits[0], steps[start:start + ids.shape[1]])
