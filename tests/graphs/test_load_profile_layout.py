"""``flashrt.load(path, profile=...)`` lays the weights out for the profile it is given (the experts'
scales K major, their fp4 codes in words, as h200.yaml asks), whatever profile is active; without one
the active profile decides, as for a Model built directly. The values are the same either way."""
import torch

import flashrt
from flashrt import formats, profiles
from flashrt.graphs.model import Model
from flashrt.graphs.moe import MoE


def _experts(model):
    moes = [b.ffn for b in model.blocks if isinstance(b.ffn, MoE)]
    assert moes
    return [w for m in moes for w in (m.w1, m.w3, m.w2)]


def _k_major(w) -> bool:
    return w.scale.stride(-2) == 1 and w.scale.stride(-1) != 1


def test_the_given_profile_lays_the_experts_out(cfg, weights, tmp_path):
    with profiles.using("a100"):  # its experts: codes in nibbles, scales row major
        Model(cfg, weights).save(tmp_path / "ckpt")
        given = flashrt.load(tmp_path / "ckpt", profile="h200")
        active = flashrt.load(tmp_path / "ckpt")
    laid, plain = _experts(given), _experts(active)
    assert all(w.fmt != "fp4_w" or w.e2m1_words for w in laid) and any(w.fmt == "fp4_w" for w in laid)
    assert all(_k_major(w) for w in laid)
    assert not any(w.e2m1_words or _k_major(w) for w in plain)
    for a, b in zip(laid, plain):
        assert torch.equal(formats.dequantize(a), formats.dequantize(b))
