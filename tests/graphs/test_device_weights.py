"""Weights drawn on the device: right names, shapes, storage kinds, and value statistics."""
import torch

from flashrt.formats import QTensor, dequantize
from flashrt.graphs.config import shipped_config
from flashrt.graphs.device_weights import device_weights
from flashrt.graphs.init_weights import init_weights


def test_same_parameters_and_storage_as_the_host_init():
    cfg = shipped_config("tiny")
    host, dev = init_weights(cfg, seed=3), device_weights(cfg, "cpu", seed=3)
    assert host.keys() == dev.keys()
    for name, ref in host.items():
        got = dev[name]
        assert type(got) is type(ref), name
        if isinstance(ref, QTensor):
            assert (got.fmt, got.shape, got.data.dtype, got.data.shape, got.scale.shape) == \
                (ref.fmt, ref.shape, ref.data.dtype, ref.data.shape, ref.scale.shape), name
        else:
            assert (got.dtype, got.shape) == (ref.dtype, ref.shape), name


def test_values_follow_the_init_rule_and_the_seed():
    cfg = shipped_config("tiny")
    a, b, c = (device_weights(cfg, "cpu", seed=s) for s in (5, 5, 6))
    name = "layers.0.attn.wq_a.weight"  # an fp8_w weight in tiny
    assert isinstance(a[name], QTensor)
    w = dequantize(a[name])
    assert abs(w.std().item() * w.shape[-1]**0.5 - 1.0) < 0.1  # standard normal / sqrt(in)
    assert torch.equal(a[name].data.view(torch.uint8), b[name].data.view(torch.uint8))  # same seed, same bytes
    assert not torch.equal(w, dequantize(c[name]))  # another seed, other values
    assert torch.equal(a["norm.weight"], torch.ones_like(a["norm.weight"]))


def test_select_makes_only_the_chosen_parameters():
    cfg = shipped_config("tiny")
    chosen = device_weights(cfg, "cpu", seed=2, select=lambda name: name.startswith("layers.1."))
    every = device_weights(cfg, "cpu", seed=2)
    assert chosen and set(chosen) == {n for n in every if n.startswith("layers.1.")}
    for name, t in chosen.items():
        a, b = (t.data, every[name].data) if isinstance(t, QTensor) else (t, every[name])
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
