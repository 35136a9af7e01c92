"""``flashrt.load(path, profile=...)`` lays the weights out for the profile it is given (the experts'
scales K major as h200.yaml asks, their fp4 codes in words as a copy of it asks), whatever profile is
active; without one the active profile decides, as for a Model built directly. The values are the same
either way."""
import torch
import yaml

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
    words = tmp_path / "h200-words.yaml"  # a profile's name is its file's
    spec = yaml.safe_load(open(profiles.load_profile("h200").source))
    words.write_text(yaml.safe_dump({**spec, "name": "h200-words", "expert_fp4": "words"}))
    with profiles.using("a100"):  # its experts: codes in nibbles, scales row major
        Model(cfg, weights).save(tmp_path / "ckpt")
        given = flashrt.load(tmp_path / "ckpt", profile="h200")
        in_words = flashrt.load(tmp_path / "ckpt", profile=str(words))
        active = flashrt.load(tmp_path / "ckpt")
    laid, worded, plain = _experts(given), _experts(in_words), _experts(active)
    assert any(w.fmt == "fp4_w" for w in laid)
    assert all(_k_major(w) and not w.e2m1_words for w in laid)
    assert all((w.fmt != "fp4_w" or w.e2m1_words) and _k_major(w) for w in worded)
    assert not any(w.e2m1_words or _k_major(w) for w in plain)
    for a, b, c in zip(laid, worded, plain):
        assert torch.equal(formats.dequantize(a), formats.dequantize(c))
        assert torch.equal(formats.dequantize(b), formats.dequantize(c))
