"""The blocks' mHC coefficients forked beside the sublayers (graphs/mix_stream.py,
``hc_mix_stream_max_tokens``).

On the CPU a fork whose value is computed only at its join (the latest a second stream could finish)
gives the logits of the inline run bit for bit: no block reads a mix before joining it, and nothing
between a fork and its join changes the fork's inputs. On a CUDA device the forks run on a second
stream, eagerly and captured into the decode step's graph, with the same logits as without.
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


def test_a_late_join_gives_the_inline_logits(cfg, model, rng, monkeypatch):
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=rng)
    inline = model.forward(ids)
    monkeypatch.setattr(MixStream, "wanted", staticmethod(lambda device, tokens: True))
    monkeypatch.setattr(model.mix_stream, "fork", LateFork)
    LateFork.calls.update(fork=0, join=0)
    late = model.forward(ids)
    assert torch.equal(late, inline)
    assert LateFork.calls == {"fork": 2 * cfg.n_layers, "join": 2 * cfg.n_layers}


def test_forks_only_on_cuda_and_within_the_profile_limit():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    base = profiles.active_profile()
    with profiles.using(dataclasses.replace(base, hc_mix_stream_max_tokens=8)):
        assert MixStream.wanted(cuda, 8) and not MixStream.wanted(cuda, 9) and not MixStream.wanted(cuda, 0)
        assert not MixStream.wanted(cpu, 1)
    with profiles.using(dataclasses.replace(base, hc_mix_stream_max_tokens=0)):
        assert not MixStream.wanted(cuda, 1)
    done = mix_stream.run_inline(lambda a, b: a + b, 2, 3)
    assert done.join() == 5 and done.stream is None


def test_the_profile_key_is_checked(tmp_path):
    import yaml

    from flashrt.errors import ProfileError
    from flashrt.hwconfigs import profile_files

    data = yaml.safe_load(open(profile_files()["h200"]))
    for bad in (-1, 1 << 21):
        data["hc_mix_stream_max_tokens"] = bad
        with pytest.raises(ProfileError, match=rf"hc_mix_stream_max_tokens.*integer >= 0.*{bad}"):
            profiles.profile_from_mapping(data, "h200.yaml")


def _with_limit(limit: int):
    return profiles.using(dataclasses.replace(profiles.active_profile(), hc_mix_stream_max_tokens=limit))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forked_mixes_on_a_cuda_stream_match_inline():
    """An eager decode-sized forward and 24 captured decode steps of ``tiny`` (2 rows, pages filling
    as it goes) give the same logits, bit for bit, with the mixes on the second stream and without."""
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
        with _with_limit(limit):
            model = Model(cfg, init_weights(cfg, seed=3, device="cuda"))
            state = model.new_state(2, 200, pool=KVState.pool_for(cfg, 2, 200, model.device, None, 4))
            logits = [model.forward(ids, state=state)]  # the prompt (38 tokens) forks as well
            runner = StepCapture(model, state)
            for _ in range(24):
                logits.append(runner.step(logits[-1].argmax(-1)).clone())
            assert runner.stats["replayed"] > 10, runner.stats
            out[limit] = torch.stack(logits)
    assert torch.equal(out[64], out[0]), f"seed {seed}"
