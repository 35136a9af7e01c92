"""The window KV that attention reads is the reference's fake quantization of it.

DeepSeek-V4.1-Flash's ``inference/model.py`` (``Attention._window_kv``, and the DSpark draft's
window rows) quantizes the whole post-rotary KV row, rotary tail included, through fp8 E4M3 with
one UE8M0 (power-of-two) scale per 32 channels, then dequantizes it in place. The checks below
compute that rule here, independently (numpy + ml_dtypes), and compare it with the values
``sparse_attention`` reads back out of a layer's window ring (one valid slot per query, no sink:
the output is that slot's row), on the reference backend and on the CUDA kernels (the Triton
interpreter off a GPU). DeepSeek-V4-Flash's different rule (only the non-rotary channels, per 64,
the rotary tail left in bf16) is computed too, to show the inputs tell the two apart.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

import flashrt
from flashrt import formats, ops
from flashrt.graphs.attention import Attention
from flashrt.graphs.config import shipped_config
from flashrt.kv.state import KVState
from _formats_ref import pow2_scale_exp, rand_input
from kernel_check import record_launches, requires_kernels

BACKENDS = ["reference", pytest.param("cuda", marks=requires_kernels)]


def fake_quant_fp8(x: np.ndarray, block: int) -> np.ndarray:
    """fp8 E4M3 quantize-dequantize along the last dim: per ``block`` channels the scale is the
    smallest power of two >= max(amax, 1e-4) / 448, elements x / scale clamped to +-448 and
    rounded to nearest even."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, block)
    scale = np.ldexp(1.0, pow2_scale_exp(np.abs(blocks).max(-1), 448.0, 1e-4))[..., None]
    q = np.clip(blocks / scale.astype(np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return (q.astype(np.float64) * scale).reshape(x.shape)


def v41_window(x: np.ndarray) -> np.ndarray:
    """The V4.1 window rule: every channel, rotary tail included, per 32."""
    return fake_quant_fp8(x, 32)


def v4_window(x: np.ndarray, rd: int) -> np.ndarray:
    """DeepSeek-V4-Flash's rule (not this model's): channels before the rotary tail per 64, the
    tail untouched."""
    out = np.asarray(x, np.float64).copy()
    out[..., :-rd] = fake_quant_fp8(x[..., :-rd], 64)
    return out


def read_ring(ring: formats.QTensor, slots: torch.Tensor) -> torch.Tensor:
    """fp32 [B, n, D]: what ``sparse_attention`` reads from ``ring`` at ``slots`` [B, n] (int64),
    one valid slot per query, no sink, so each output is exactly that slot's row."""
    B, n = slots.shape
    q = torch.ones(B, n, 1, ring.shape[-1], dtype=torch.float32, device=ring.device)
    idx = slots.to(torch.int32).unsqueeze(-1)
    return ops.sparse_attention(q, (ring,), idx, None, 1.0)[:, :, 0]


def quarter_turns(B: int, S: int, P: int, rng: torch.Generator) -> torch.Tensor:
    """Rotary factors in {1, i, -1, -i}: the rotation is exact in any arithmetic, so the rows the
    quantization sees are known here without a rounding question."""
    k = torch.randint(0, 4, (B, S, P), generator=rng)
    re = torch.tensor([1.0, 0.0, -1.0, 0.0])[k]
    im = torch.tensor([0.0, 1.0, 0.0, -1.0])[k]
    return torch.complex(re, im)


def rotate(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Rotary on the last 2P channels, adjacent pairs as complex numbers (exact for quarter turns)."""
    P = f.shape[-1]
    tail = torch.view_as_complex(x[..., -2 * P:].float().unflatten(-1, (P, 2)).contiguous())
    return torch.cat([x[..., :-2 * P].float(), torch.view_as_real(tail * f).flatten(-2)], dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_holds_the_reference_fake_quantization(rng, monkeypatch, backend):
    """512 channels with a 64-channel rotary tail, as released; rows of widely varying
    magnitudes: every value attention reads from the ring equals the reference's."""
    launches = record_launches(monkeypatch)
    cfg = dataclasses.replace(shipped_config("tiny"), head_dim=512, rope_head_dim=64)
    B, W, D, rd = 2, cfg.window_size, cfg.head_dim, cfg.rope_head_dim
    x = rand_input((B, W, D), torch.bfloat16, rng, spread=20)
    f = quarter_turns(B, W, rd // 2, rng)
    state = KVState(cfg, B, 4 * W, "cpu")
    pos = torch.arange(W).repeat(B, 1)
    with flashrt.use_backend(backend):
        kv = ops.norm_rope_quantize(x, None, 0.0, f, state.window_fmt)
        for t in range(W):  # decode rows, one position per call
            state.write_ring(0, kv.narrow(1, t, 1), state.ring_slots(pos[:, t:t + 1]))
        got = read_ring(state.rings[0], pos % W).numpy()
    if backend == "cuda":  # the quantization, the ring store and the attention read ran as kernels
        assert {"_norm_rope_quant_kernel", "_store_rows_kernel", "_sparse_attention_kernel"} <= set(launches), launches
    rows = rotate(x, f).numpy()
    want = v41_window(rows)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want, v4_window(rows, rd))  # the inputs separate the two rules
    assert not np.array_equal(got[..., -rd:], rows[..., -rd:])  # the rotary tail is quantized too


def test_model_rings_after_prefill_hold_the_reference_fake_quantization(model, cfg, rng, monkeypatch):
    """Through the model (reference backend): every layer's window rows (the DSpark draft layer's
    seeded rows included), made from its own norm and rotary, are what the reference's rule gives
    for them, and the ring holds the last ``window_size`` of them."""
    seen = []
    original = Attention.window_kv

    def spy(self, h, f, fmt, *latent):
        out = original(self, h, f, fmt, *latent)
        seen.append((self, h, f, out))
        return out

    monkeypatch.setattr(Attention, "window_kv", spy)
    S, W = cfg.window_size + 5, cfg.window_size
    state = model.new_state(1, 32)
    model.forward(torch.randint(0, cfg.vocab_size, (1, S), generator=rng), state=state)
    assert sorted(a.layer for a, *_ in seen) == list(range(cfg.total_layers))  # the draft layer too
    for attn, h, f, out in seen:
        pre = ops.rope(ops.rms_norm(ops.linear(h, attn.wkv), attn.kv_norm, cfg.norm_eps), f)
        want = v41_window(pre.float().numpy())
        np.testing.assert_array_equal(formats.dequantize(out).numpy(), want, err_msg=f"layer {attn.layer}")
        last = torch.arange(S - W, S).unsqueeze(0)
        ring = read_ring(state.rings[attn.layer], last % W).numpy()
        np.testing.assert_array_equal(ring, want[:, S - W:], err_msg=f"ring of layer {attn.layer}")


@pytest.mark.parametrize("elem_max,floor", [(448.0, 1e-4), (6.0, 6 * 2.0**-126)])
def test_power_of_two_scales_equal_the_reference_product_form(elem_max, floor):
    """The reference kernels round ``max(amax, floor) * fp32(1 / elem_max)`` up to a power of
    two; flashrt's codec divides. The same power of two for every fp32 mantissa (the exponent
    only shifts both), so the stored UE8M0 scales agree."""
    mantissas = torch.arange(0, 1 << 23, dtype=torch.int32)
    for exponent in (90, 127, 150):
        amax = ((exponent << 23) | mantissas).view(torch.float32).clamp_min(floor)
        product = amax * torch.tensor(1 / elem_max, dtype=torch.float32)
        assert torch.equal(formats.pow2_ceil(amax / elem_max), formats.pow2_ceil(product))
