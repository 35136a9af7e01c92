"""The tiny model on a CUDA device gives the CPU's logits (reference backend on both)."""
import pytest
import torch

from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_cuda_matches_cpu(rng):
    cfg = shipped_config("tiny")
    ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=rng)
    cpu = Model(cfg, init_weights(cfg, seed=3)).forward(ids, all_positions=True)
    gpu_model = Model(cfg, init_weights(cfg, seed=3, device="cuda"))
    gpu = gpu_model.forward(ids.cuda(), all_positions=True).cpu()
    assert torch.isfinite(gpu).all()
    assert float((gpu - cpu).norm() / cpu.norm()) < 1e-3
    res = gpu_model.generate(ids[:1, :20].cuda(), max_new_tokens=4)
    assert len(res.tokens[0]) == 4
