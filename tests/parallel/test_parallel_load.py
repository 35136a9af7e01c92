"""Sharded loading: each rank reads only its slices of the checkpoint (bytes counted at safetensors)."""
import dataclasses

import pytest
import torch

from flashrt.formats import QTensor
from flashrt.graphs import checkpoint, shards
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.parallel import Layout
from flashrt.graphs.plan import stored_bytes
from flashrt.graphs.shard import local_specs, shard_weights
from flashrt.graphs.shard_load import load_shard


class _Counting:
    """A ``safe_open`` handle that counts the bytes of every tensor read through it."""

    def __init__(self, real, log):
        self.real, self.log = real, log

    def __enter__(self):
        self.h = self.real.__enter__()
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def keys(self):
        return self.h.keys()

    def get_tensor(self, name):
        t = self.h.get_tensor(name)
        self.log.append((name, "whole", t.numel() * t.element_size()))
        return t

    def get_slice(self, name):
        return _Slice(self.h.get_slice(name), name, self.log)


class _Slice:
    def __init__(self, real, name, log):
        self.real, self.name, self.log = real, name, log

    def get_dtype(self):
        return self.real.get_dtype()

    def get_shape(self):
        return self.real.get_shape()

    def __getitem__(self, index):
        t = self.real[index]
        self.log.append((self.name, "slice", t.numel() * t.element_size()))
        return t


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = dataclasses.replace(shipped_config("tiny"), n_routed_experts=16, n_activated_experts=4, name="tiny-16e")
    seed = int.from_bytes(__import__("os").urandom(3), "little")
    weights = init_weights(cfg, seed=seed)
    path = checkpoint.save(weights, cfg, tmp_path_factory.mktemp("ckpt") / "tiny-16e", max_shard_bytes=1 << 19)
    return cfg, init_weights(cfg, seed=seed), path


def _same(a, b) -> bool:
    if isinstance(a, QTensor):
        return isinstance(b, QTensor) and a.shape == b.shape and torch.equal(a.data, b.data) and \
            torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2)])
def test_each_rank_reads_only_its_slices(saved, monkeypatch, tp, ep):
    cfg, full, path = saved
    assert len(list(path.glob("*.safetensors"))) > 1  # several shards
    total = sum(stored_bytes(s) for s, _, _ in local_specs(cfg, Layout()))
    experts = [0] * (tp * ep)
    for rank in range(tp * ep):
        layout = Layout(tp, ep, rank)
        log = []
        real = shards.safe_open
        monkeypatch.setattr(shards, "safe_open", lambda *a, **k: _Counting(real(*a, **k), log))
        _, weights, read = load_shard(path, layout)
        monkeypatch.setattr(shards, "safe_open", real)
        want = sum(stored_bytes(local) for _, local, _ in local_specs(cfg, layout))
        assert sum(n for _, _, n in log) == read == want < total
        cut = {n for full, _, c in local_specs(cfg, layout) if c is not None for n in (full.name, full.scale_name)}
        assert bool(cut) == (tp > 1)
        assert not [name for name, how, _ in log if how == "whole" and name in cut]  # cut tensors: sliced reads
        expected = shard_weights(full, cfg, layout)
        assert expected.keys() == weights.keys()
        assert all(_same(weights[k], expected[k]) for k in expected)
        experts[rank] = sum(n for name, _, n in log if name.startswith("layers.") and ".ffn.experts." in name)
    assert len(set(experts)) == 1  # the routed experts' bytes are spread evenly, each read once
    whole = sum(stored_bytes(s) for s, _, _ in local_specs(cfg, Layout()) if
                s.name.startswith("layers.") and ".ffn.experts." in s.name)
    assert sum(experts) == whole


def test_a_layout_the_checkpoint_cannot_take_names_it(saved):
    _, _, path = saved
    with pytest.raises(ValueError, match="tp: expected a divisor of n_heads=4"):
        load_shard(path, Layout(tp=4))


@pytest.mark.parametrize("name", ["layers.1.attn.wq_b.weight", "layers.0.ffn.experts.5.w1.scale", "norm.weight"])
def test_a_non_finite_value_in_a_ranks_slice_is_named(saved, tmp_path, name):
    """A NaN in what a rank holds fails that rank's load, naming the tensor; a rank that does not
    hold it loads, and ``check_finite=False`` skips the check."""
    from safetensors.torch import load_file, save_file

    from flashrt.errors import CheckpointError

    cfg, _, path = saved
    spoiled = tmp_path / "spoiled"
    spoiled.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (spoiled / f.name).write_bytes(f.read_bytes())
            continue
        tensors = load_file(str(f))
        if name in tensors:
            t = tensors[name].clone()
            t.view(-1)[:1].view(torch.uint8).fill_(0xFF)  # all ones: NaN in bf16, fp32, E4M3 and UE8M0
            tensors[name] = t
        save_file(tensors, str(spoiled / f.name), metadata={"format": "pt"})
    layouts = [Layout(1, 2, 0), Layout(1, 2, 1), Layout(2, 1, 0)]
    holds = [name in {n for full, _, _ in local_specs(cfg, lay) for n in (full.name, full.scale_name)}
             for lay in layouts]
    assert any(holds)
    for layout, held in zip(layouts, holds):
        if held:
            with pytest.raises(CheckpointError, match=f"tensor '{name}'"):
                load_shard(spoiled, layout)
            load_shard(spoiled, layout, check_finite=False)
        else:
            load_shard(spoiled, layout)
    if ".experts." in name:
        assert holds[:2].count(True) == 1  # a routed expert: one of the two expert-parallel ranks
