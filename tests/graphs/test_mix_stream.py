"""The blocks' mHC coefficients forked beside the sublayers, and the attention's compressed-entry
selection beside the query heads and window KV (graphs/mix_stream.py, ``hc_mix_stream_max_tokens``,
``indexer_stream_max_tokens``).

On the CPU a fork whose value is computed only at its join (the latest a second stream could finish)
gives the logits of the inline run bit for bit: nothing reads a fork's result before joining it, and
nothing between a fork and its join changes the fork's inputs. On a CUDA device the forks run on
streams of their own, eagerly and captured into the decode step's graph, with the same logits as
without.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from flashrt import profiles
from flashrt.graphs import mix_stream
from flashrt.graphs.mix_stream import Fork, MixStream


class LateFork(Fork):
    """A fork computed when joined; counts the forks and joins."""

    calls = {"fork": 0, "join": 0}

    def __init__(self, fn, *args):
        super().__init__(None)
        self.fn, self.args = fn, args
        LateFork.calls["fork"] += 1

    def join(self):
        LateFork.calls["join"] += 1
        return self.fn(*self.args)


@pytest.mark.parametrize("forks", [("mix",), ("select",), ("mix", "select")])
@pytest.mark.parametrize("S", [1, 7])
def test_a_late_join_gives_the_inline_logits(cfg, model, rng, monkeypatch, forks, S):
    """Prompt chunks and decode steps (the caches filled by an inline prompt first), each fork kind
    alone and both: the logits of the inline run, one fork and one join a block's mix and a
    selecting (full or reindex) layer's selection."""
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=rng)
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=rng)
    states = [model.new_state(2, 64) for _ in range(2)]
    for s in states:
        model.forward(prompt, state=s)
    inline = model.forward(ids, state=states[0])
    settings = {"mix": "hc_mix_stream_max_tokens", "select": "indexer_stream_max_tokens"}
    on = {settings[name] for name in forks}
    monkeypatch.setattr(MixStream, "wanted",
                        staticmethod(lambda device, tokens, setting="hc_mix_stream_max_tokens": setting in on))
    for name in forks:
        monkeypatch.setattr(getattr(model, f"{name}_stream"), "fork", LateFork)
    LateFork.calls.update(fork=0, join=0)
    late = model.forward(ids, state=states[1])
    assert torch.equal(late, inline)
    selecting = sum(1 for layer in range(cfg.n_layers) if cfg.ratio(layer) and cfg.role(layer) in ("full", "reindex"))
    want = (2 * cfg.n_layers if "mix" in forks else 0) + (selecting if "select" in forks else 0)
    assert selecting > 0 and LateFork.calls == {"fork": want, "join": want}


def test_forks_only_on_cuda_and_within_the_profile_limit():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    base = profiles.active_profile()
    with profiles.using(dataclasses.replace(base, hc_mix_stream_max_tokens=8)):
        assert MixStream.wanted(cuda, 8) and not MixStream.wanted(cuda, 9) and not MixStream.wanted(cuda, 0)
        assert not MixStream.wanted(cpu, 1)
    with profiles.using(dataclasses.replace(base, hc_mix_stream_max_tokens=0)):
        assert not MixStream.wanted(cuda, 1)
    with profiles.using(dataclasses.replace(base, hc_mix_stream_max_tokens=0, indexer_stream_max_tokens=4)):
        assert MixStream.wanted(cuda, 4, "indexer_stream_max_tokens") and not MixStream.wanted(cuda, 4)
        assert not MixStream.wanted(cuda, 5, "indexer_stream_max_tokens")
        assert not MixStream.wanted(cpu, 1, "indexer_stream_max_tokens")
    done = mix_stream.run_inline(lambda a, b: a + b, 2, 3)
    assert done.join() == 5 and done.stream is None


@pytest.mark.parametrize("key", ["hc_mix_stream_max_tokens", "indexer_stream_max_tokens"])
def test_the_profile_key_is_checked(key):
    import yaml

    from flashrt.errors import ProfileError
    from flashrt.hwconfigs import profile_files

    data = yaml.safe_load(open(profile_files()["h200"]))
    for bad in (-1, 1 << 21):
        data[key] = bad
        with pytest.raises(ProfileError, match=rf"{key}.*integer >= 0.*{bad}"):
            profiles.profile_from_mapping(data, "h200.yaml")


def _with_limit(key: str, limit: int):
    base = dataclasses.replace(profiles.active_profile(), hc_mix_stream_max_tokens=0, indexer_stream_max_tokens=0)
    return profiles.using(dataclasses.replace(base, **{key: limit}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("key", ["hc_mix_stream_max_tokens", "indexer_stream_max_tokens"])
def test_forked_work_on_a_cuda_stream_matches_inline(key):
    """An eager decode-sized forward and 24 captured decode steps of ``tiny`` (2 rows, pages filling
    as it goes) give the same logits, bit for bit, with the forked work (the mixes, or the
    attention's selections) on a stream of its own and without."""
    from flashrt.engine.step_capture import StepCapture
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model
    from flashrt.kv.state import KVState

    cfg = shipped_config("tiny")
    seed = int.from_bytes(os.urandom(4), "little")
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(seed)).cuda()
    out = {}
    for limit in (0, 64):
        with _with_limit(key, limit):
            model = Model(cfg, init_weights(cfg, seed=3, device="cuda"))
            state = model.new_state(2, 200, pool=KVState.pool_for(cfg, 2, 200, model.device, None, 4))
            logits = [model.forward(ids, state=state)]  # the prompt (38 tokens) forks as well
            runner = StepCapture(model, state)
            for _ in range(24):
                logits.append(runner.step(logits[-1].argmax(-1)).clone())
            assert runner.stats["replayed"] > 10, runner.stats
            out[limit] = torch.stack(logits)
    assert torch.equal(out[64], out[0]), f"seed {seed}"
