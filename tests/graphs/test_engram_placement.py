"""Engram tables in host memory (profile placement host / host_pinned) give the device results."""
import pytest
import torch

from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.engine import generate


@pytest.fixture(scope="module")
def models():
    cfg = shipped_config("tiny")
    return Model(cfg, init_weights(cfg, seed=0)), Model(cfg, init_weights(cfg, seed=0), engram_placement="host")


def test_host_tables_stay_on_host_and_match(models, rng):
    dev, host = models
    for layer in dev.cfg.engram_layer_ids:
        assert host.weights[f"layers.{layer}.engram.embed.weight"].device.type == "cpu"
    ids = torch.randint(0, dev.cfg.vocab_size, (2, 33), generator=rng)
    assert torch.equal(dev.forward(ids, all_positions=True), host.forward(ids, all_positions=True))
    for prefill in ("exact", "ced"):
        assert generate(dev, ids, 4, prefill=prefill).tokens == generate(host, ids, 4, prefill=prefill).tokens


def test_bad_placement_is_named():
    cfg = shipped_config("tiny")
    with pytest.raises(ValueError, match="engram_placement"):
        Model(cfg, init_weights(cfg, seed=0), engram_placement="disk")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_prefetch_on_gpu(rng):
    cfg = shipped_config("tiny")
    dev = Model(cfg, init_weights(cfg, seed=0, device="cuda"))
    pinned = Model(cfg, init_weights(cfg, seed=0, device="cuda"), engram_placement="host_pinned")
    table = pinned.weights[f"layers.{cfg.engram_layer_ids[0]}.engram.embed.weight"]
    assert table.data.is_pinned()
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=rng).cuda()
    assert torch.equal(dev.forward(ids, all_positions=True), pinned.forward(ids, all_positions=True))
