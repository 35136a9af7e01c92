"""Synthetic weights made on threads: the bytes of one parameter at a time in order, whatever the
number of threads; errors and progress as made one by one; the built-in checkpoint's tokenizer,
trained beside its weights, the one ``build`` makes."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from flashrt.graphs.builtin_tokenizer import build, ensure_builtin_tokenizer
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_param, init_weights, make_all, param_seed
from flashrt.graphs.params import param_specs
from test_checkpoint import assert_same


@pytest.fixture(scope="module")
def cfg():
    return shipped_config("tiny")


def test_threads_give_the_bytes_of_one_parameter_at_a_time(cfg):
    seed = int(torch.randint(0, 2**31, ()).item())  # a fresh seed each run
    one_by_one = {s.name: init_param(s, seed) for s in param_specs(cfg)}
    for workers in (1, 3, None):
        assert_same(one_by_one, init_weights(cfg, seed=seed, workers=workers))


def test_a_parameter_is_its_own_seeded_draw(cfg):
    """Independent of the code under test: a linear parameter is torch.randn from its own
    generator, seeded with crc32("seed:name"), scaled by 1/sqrt(fan_in), cast to bf16."""
    spec = next(s for s in param_specs(cfg) if s.init == "linear" and s.kind == "bf16")
    gen = torch.Generator().manual_seed(param_seed(7, spec.name))
    want = (torch.randn(spec.shape, generator=gen) * spec.shape[-1] ** -0.5).to(torch.bfloat16)
    assert torch.equal(init_weights(cfg, seed=7, workers=4)[spec.name], want)


def test_progress_counts_in_order_from_the_calling_thread(cfg):
    calls, caller = [], threading.get_ident()
    init_weights(cfg, seed=1, workers=3, progress=lambda d, t: calls.append((d, t, threading.get_ident())))
    n = len(param_specs(cfg))
    assert calls == [(i + 1, n, caller) for i in range(n)]


def test_an_error_in_one_parameter_is_raised_and_the_rest_is_not_made(cfg):
    specs = param_specs(cfg)
    made, bad = [], specs[2].name

    def make(spec):
        if spec.name == bad:
            raise ValueError(f"{spec.name}: unknown init 'x'")
        made.append(spec.name)
        return torch.zeros(1)

    progress, threads = [], torch.get_num_threads()
    with pytest.raises(ValueError, match="unknown init 'x'"):
        make_all(specs, make, lambda d, t: progress.append(d), workers=2)
    assert progress == [1, 2]  # what came before the error, in order, and nothing after it
    assert torch.get_num_threads() == threads  # torch's thread count is given back
    with pytest.raises(ValueError, match=r"workers: expected an int >= 1 or None, got 0"):
        make_all(specs, make, workers=0)


def test_the_builtin_checkpoint_tokenizer_is_the_built_one(tmp_path, monkeypatch):
    from flashrt.engine.run import builtin_checkpoint

    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path))
    path = builtin_checkpoint("tiny", quiet=True)
    cfg = shipped_config("tiny")
    assert (path / "tokenizer.json").read_text() == build(cfg.vocab_size).to_str()
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == cfg.max_seq_len


def test_a_given_tokenizer_of_another_vocabulary_is_refused(tmp_path, cfg):
    with pytest.raises(ValueError, match=rf"tok: expected a tokenizer of {cfg.vocab_size} ids .*got 400"):
        ensure_builtin_tokenizer(tmp_path, cfg, tok=build(400))
    assert not any(tmp_path.iterdir())
