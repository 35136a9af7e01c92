"""Window rings in int8 (devices with no FP8, the ascend910b profile) instead of fp8."""
import pytest
import torch

import flashrt
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model


@pytest.fixture(scope="module")
def cfg_weights():
    cfg = shipped_config("tiny")
    return cfg, init_weights(cfg, seed=0)


def test_int8_rings_are_stored_and_decode_matches_prefill(cfg_weights, rng):
    cfg, w = cfg_weights
    model = Model(cfg, w, window_fmt="int8")
    ids = torch.randint(0, cfg.vocab_size, (4, 21), generator=rng)
    full = model.forward(ids, all_positions=True)
    state = model.new_state(4, 32)
    assert all(r.fmt == "int8" and r.data.dtype == torch.int8 for r in state.rings.values())
    steps = torch.stack([model.forward(ids[:, i:i + 1], state=state) for i in range(21)], dim=1)
    close = ((steps - full).norm(dim=-1) / full.norm(dim=-1)).amax(dim=1) < 1e-3
    assert close.sum() >= 3  # at most one row may flip a top-k pick on a last-bit difference
    fp8 = Model(cfg, w).forward(ids, all_positions=True)
    assert 0 < float((full - fp8).norm() / fp8.norm()) < 0.5  # another quantizer, the same model


def test_profile_picks_the_window_format(cfg_weights, tmp_path):
    cfg, w = cfg_weights
    Model(cfg, w).save(tmp_path / "ckpt")
    assert flashrt.load(tmp_path / "ckpt", profile="ascend910b").window_fmt == "int8"
    assert flashrt.load(tmp_path / "ckpt", profile="h200").window_fmt == "fp8"
    with pytest.raises(ValueError, match="window_fmt"):
        Model(cfg, w, window_fmt="fp4").new_state(1, 8)
