"""Ascend backend through the emulated torch_npu: detection, rms_norm, rope, top-k ops, the rest.

Each op runs on ``use_backend("ascend")`` and on ``use_backend("reference")`` with fresh random
inputs; the recorded operator calls show the layout and argument mapping, ``FALLBACKS`` which
calls were served by plain torch. See ``test_ascend_ops.py`` for quant, linear, attention, MoE.
"""
import sys

import pytest
import torch

import flashrt
from flashrt import dispatch, formats
from flashrt.backends import ascend
from flashrt.errors import BackendError

from ascend_helpers import fallbacks, npu_emulation, run_both  # noqa: F401
from kernel_check import rel_err


def test_without_torch_npu_the_backend_is_registered_unavailable_and_imports_nothing():
    assert "ascend" in dispatch.backends()
    ok, reason = dispatch.availability("ascend")
    assert not ok and "torch_npu is not installed" in reason
    assert "torch_npu" not in sys.modules
    assert ascend.versions() == {}
    with pytest.raises(BackendError, match="ascend"):
        with flashrt.use_backend("ascend"):
            pass


def test_emulation_detection_versions_and_doctor(npu_emulation, monkeypatch):
    assert dispatch.availability("ascend") == (True, "")
    b = dispatch.backends()["ascend"]
    assert b.device_types == ("npu",) and b.explicit_device_types == ("cpu",)
    assert set(b.ops) == set(flashrt.ops.OPS)
    v = ascend.versions()
    assert v["torch_npu"].endswith("emulation") and v["cann"] == "8.3.RC1.emulated" and v["soc_version"] == 223
    assert ascend.soc_version() in ascend.A2_A3_SOCS
    assert dispatch.chain("rms_norm", "cpu") == ["reference"]  # CPU only when chosen explicitly
    from flashrt.cli import commands as cli

    # profile detection would build torch.device("npu"), a device type only the real torch_npu registers
    monkeypatch.setattr(cli, "_profile_report", lambda shipped: {})
    versions = cli.doctor_report()["versions"]
    assert versions["cann"] == "8.3.RC1.emulated" and versions["torch_npu"] == v["torch_npu"]
    assert versions["npu_soc_version"] == 223


def test_float64_is_declined_loudly_when_chosen_explicitly(npu_emulation):
    x = torch.randn(4, 64, dtype=torch.float64)
    with flashrt.use_backend("ascend"), pytest.raises(BackendError, match="rms_norm"):
        flashrt.ops.rms_norm(x, torch.ones(64, dtype=torch.float64), 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64,), (3, 128), (2, 5, 96)])
def test_rms_norm_maps_to_npu_rms_norm(npu_emulation, rng, dtype, shape):
    x = torch.randn(shape, generator=rng).to(dtype)
    w = torch.randn(shape[-1], generator=rng).to(dtype)
    got, want = run_both("rms_norm", x, w, 1e-5)
    assert got.dtype == dtype and rel_err(got, want) < 1e-2
    call = npu_emulation.calls("npu_rms_norm")[-1]
    assert call["gamma"] is w and call["epsilon"] == 1e-5 and call["self"].dim() >= 2
    assert not fallbacks("rms_norm")


def test_rms_norm_falls_back_for_a_weight_of_another_dtype(npu_emulation, rng):
    x = torch.randn(3, 64, generator=rng).bfloat16()
    w = torch.randn(64, generator=rng)  # fp32 weight: casting it to bf16 would round it
    got, want = run_both("rms_norm", x, w, 1e-6)
    assert torch.equal(got, want) and not npu_emulation.calls("npu_rms_norm")
    assert fallbacks("rms_norm") == ["npu_rms_norm needs gamma in x.dtype; casting the weight would round it"]


@pytest.mark.parametrize("layout", ["SR", "BSR", "BSHR", "BSHR-per-seq"])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_uses_interleave_mode_with_1s1d_coefficients(npu_emulation, rng, layout, inverse):
    B, S, H, R = 2, 5, 3, 16
    shape = {"SR": (S, R), "BSR": (B, S, R)}.get(layout, (B, S, H, R))
    x = torch.randn(shape, generator=rng).bfloat16()
    ang = torch.rand(B, S, R // 2, generator=rng) * 6
    freqs = torch.polar(torch.ones_like(ang), ang)
    freqs = freqs if layout == "BSHR-per-seq" else freqs[0]
    got, want = run_both("rope", x, freqs, inverse)
    assert rel_err(got, want) < 1e-2
    call = npu_emulation.calls("npu_rotary_mul")[-1]
    rows = S * (B if x.dim() >= 3 else 1)
    assert call["rotary_mode"] == "interleave" and call["self"].dtype == torch.float32
    assert tuple(call["self"].shape) == (1, rows, H if x.dim() == 4 else 1, R)
    assert tuple(call["r1"].shape) == (1, rows, 1, R)  # 1S1D
    c, s = call["r1"][0, :S, 0], call["r2"][0, :S, 0]
    f0 = freqs if freqs.dim() == 2 else freqs[0]
    torch.testing.assert_close(c[:, ::2], f0.real)
    torch.testing.assert_close(c[:, 1::2], f0.real)  # (cos, cos) per pair
    torch.testing.assert_close(s[:, ::2], -f0.imag if inverse else f0.imag)


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_table_pads_the_head_with_unit_factors(npu_emulation, rng, inverse):
    """A table of P < R/2 pairs (the model's rope on a head's tail): one npu_rotary_mul over the whole
    row with factor 1 + 0i on the head pairs, the head unchanged."""
    x = torch.randn(2, 5, 3, 24, generator=rng).bfloat16()
    ang = torch.rand(2, 5, 4, generator=rng) * 6
    freqs = torch.polar(torch.ones_like(ang), ang)
    got, want = run_both("rope", x, freqs, inverse)
    assert rel_err(got, want) < 1e-2 and torch.equal(got[..., :16], x[..., :16])
    call = npu_emulation.calls("npu_rotary_mul")[-1]
    assert tuple(call["r1"].shape) == (1, 10, 1, 24)
    assert torch.equal(call["r1"][..., :16], torch.ones(1, 10, 1, 16)) and not call["r2"][..., :16].any()


def test_rope_falls_back_past_the_operator_limits(npu_emulation, rng):
    x = torch.randn(1, 2, 1000, 8, generator=rng)  # H >= 1000: interleave mode needs B * N < 1000
    freqs = torch.polar(torch.ones(2, 4), torch.rand(2, 4, generator=rng))
    got, want = run_both("rope", x, freqs, False)
    assert torch.equal(got, want) and fallbacks("rope")


def test_topk_positions_ties_candidates_and_short_rows(npu_emulation, rng):
    B, S, T = 2, 4, 50
    scores = torch.randint(0, 5, (B, S, T), generator=rng).float()  # many ties
    scores[0, 0, 7:] = float("-inf")  # fewer finite scores than k
    scores[1, 1, 3] = float("nan")
    cand = torch.rand(B, S, T, generator=rng) > 0.3
    for k in (1, 6, 64):
        for c in (None, cand):
            got, want = run_both("topk_positions", scores, k, c)
            assert torch.equal(got, want), (k, c is None)
    assert not fallbacks("topk_positions")


def test_topk_positions_random_scores(npu_emulation, rng):
    scores = torch.randn(3, 5, 300, generator=rng)
    scores[..., ::7] = float("-inf")
    got, want = run_both("topk_positions", scores, 40)
    assert torch.equal(got, want)


@pytest.mark.parametrize("topk_blocks,block_size", [(1, 4), (3, 8), (20, 16)])
def test_candidate_blocks(npu_emulation, rng, topk_blocks, block_size):
    B, S, T = 2, 6, 70
    scores = torch.randint(0, 3, (B, S, T), generator=rng).float()
    scores[1, 2, 40:] = float("-inf")
    visible = torch.randint(0, T + 1, (B, S), generator=rng, dtype=torch.int32)
    got, want = run_both("candidate_blocks", scores, visible, topk_blocks, block_size)
    assert torch.equal(got, want)


def test_plain_torch_ops_match_the_reference(npu_emulation, rng):
    B, S, hc, D = 2, 3, 4, 32
    g = dict(generator=rng)
    kv, score = torch.randn(B, 5, 4, D, **g), torch.randn(B, 5, 4, D, **g)
    got, want = run_both("compress_pool", kv, score)
    assert torch.equal(got, want)
    x = torch.randn(B, S, hc, D, **g).bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * D, **g) * 0.1
    got, want = run_both("hc_coefficients", x, fn, torch.rand(3, **g), torch.randn((2 + hc) * hc, **g), 3, 1e-6, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    pre, post, comb = want
    got, want = run_both("hc_collapse", x, pre)
    assert torch.equal(got, want)
    y = torch.randn(B, S, D, **g).bfloat16()
    got, want = run_both("hc_expand", y, x, post, comb)
    assert torch.equal(got, want)
    got, want = run_both("engram_gate", x, torch.randn(B, S, hc, D, **g), y, torch.randn(hc, D, **g), 1e-6)
    assert torch.equal(got, want)


def test_gather_cold_rows_stages_the_host_bytes(npu_emulation, rng):
    host = formats.quantize(torch.randn(5, 8, 64, generator=rng), "fp4_b16")
    ids = torch.randint(-1, 5, (2, 4), generator=rng)
    picks = torch.randint(-1, 32, (2, 9), generator=rng, dtype=torch.int32)
    index = torch.randint(-1, 40, (2, 9), generator=rng, dtype=torch.int32)
    (staging, got), (want_staging, want) = run_both("gather_cold_rows", host, ids, picks, index, 40)
    assert torch.equal(got, want) and torch.equal(staging.data, want_staging.data)
    assert torch.equal(staging.scale.view(torch.uint8), want_staging.scale.view(torch.uint8))
    cold = (picks >= 0) & (ids.gather(1, (picks.clamp_min(0) // 8).long()) >= 0)
    assert torch.equal(got[cold], 40 + torch.arange(18, dtype=torch.int32).view(2, 9)[cold]) and cold.any()


def test_engram_lookup_decodes_table_bytes_exactly(npu_emulation, rng):
    table = formats.quantize(torch.randn(40, 64, generator=rng) * 3, "fp8")
    ids = torch.randint(0, 40, (2, 3, 4), generator=rng)
    got, want = run_both("engram_lookup", table, ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_sample_greedy_ties_and_gumbel(npu_emulation, rng):
    logits = torch.randint(0, 3, (6, 50), generator=rng).float()  # ties: the lower id wins
    got, want = run_both("sample", logits, 0.0)
    assert torch.equal(got, want) and torch.equal(got, (logits == logits.max(-1, keepdim=True).values).int().argmax(-1))
    temp = torch.tensor([0.0, 0.7, 1.0, 0.0, 2.0, 0.5])
    seed = int(torch.randint(0, 2**30, (1,), generator=rng))
    with flashrt.use_backend("ascend"):
        got = flashrt.ops.sample(logits, temp, torch.Generator().manual_seed(seed))
    with flashrt.use_backend("reference"):
        want = flashrt.ops.sample(logits, temp, torch.Generator().manual_seed(seed))
    assert torch.equal(got, want)
