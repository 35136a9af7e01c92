"""The int8 formats (int8, int8_t, int8_w) against an independent numpy codec.

The codec below decides scales exactly: ``int8`` through the exact power-of-two search of
``_formats_ref``; ``int8_t`` by an IEEE float32 division in numpy; ``int8_w`` by rounding that
float32 quotient to bfloat16 with ``ml_dtypes`` (nearest even). Elements are ``np.rint`` (ties to
even) of a float32 division, clipped to +-127. Nothing here calls flashrt's codec.
"""
import ml_dtypes
import numpy as np
import pytest
import torch

import flashrt
from flashrt import formats
from flashrt.formats import QTensor

from _formats_ref import pow2_scale_exp  # noqa: E402  (exact 2**k search, shared with test_formats)

FLOOR = 2.0**-126


def ref_int8(x: np.ndarray, fmt: str):
    """(int8 elements, scale as stored (float64 values)) of float32 ``x`` along its last dim."""
    x = x.astype(np.float32)
    if fmt == "int8":
        blocks = x.reshape(*x.shape[:-1], -1, 32)
        k = pow2_scale_exp(np.abs(blocks).max(-1), 127.0, 127 * FLOOR)
        scale = np.ldexp(1.0, k)
        q = np.rint(blocks.astype(np.float64) / scale[..., None]).reshape(x.shape)  # exact: power of two
        return np.clip(q, -127, 127).astype(np.int8), scale
    amax = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(FLOOR)).astype(np.float32)
    scale = amax / np.float32(127)  # IEEE float32 division
    if fmt == "int8_w":
        scale = scale.astype(ml_dtypes.bfloat16).astype(np.float32)
    q = np.rint(x / scale)  # float32 division, ties to even
    return np.clip(q, -127, 127).astype(np.int8), scale.astype(np.float64)


def check(x: torch.Tensor, fmt: str):
    q = formats.quantize(x, fmt)
    formats.check_qtensor(q, "q")
    want_q, want_s = ref_int8(x.numpy(), fmt)
    np.testing.assert_array_equal(q.data.numpy(), want_q)
    np.testing.assert_array_equal(q.scale.to(torch.float64).numpy().reshape(want_s.shape), want_s)
    back = formats.dequantize(q).numpy()
    s = np.repeat(want_s, 32, -1) if fmt == "int8" else want_s
    np.testing.assert_array_equal(back, want_q.astype(np.float32) * s.astype(np.float32))  # fp32 product
    return q


@pytest.mark.parametrize("fmt", ["int8", "int8_t", "int8_w"])
@pytest.mark.parametrize("shape", [(64,), (3, 5, 96), (1, 7, 32), (2, 3, 4, 64)])
def test_random_inputs_match_the_independent_codec(rng, fmt, shape):
    if fmt == "int8_w" and len(shape) < 2:
        shape = (5,) + shape
    scale = torch.exp2(torch.randint(-20, 20, shape[:-1] + (1,), generator=rng).float())
    check(torch.randn(shape, generator=rng) * scale, fmt)


@pytest.mark.parametrize("fmt", ["int8", "int8_t", "int8_w"])
def test_edge_cases_zero_blocks_negative_zero_ties_saturation(fmt):
    x = torch.zeros(4, 64)
    x[1, :32] = -0.0  # negative zero: byte 0, like +0
    x[2, 0] = 127.0  # amax 127: scale 1 (int8; int8_t), so halves below are ties
    x[2, 1:9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    x[3, :] = torch.linspace(-3e-38, 3e-38, 64)  # below the amax floor: the floor sets the scale
    q = check(x, fmt)
    assert (q.data[0] == 0).all() and (q.data[1] == 0).all()
    assert q.data.min() >= -127  # -128 is never produced
    if fmt != "int8_w":
        assert q.data[2, 1:9].tolist() == [0, 2, 2, 0, -2, -2, 126, -126]


def test_int8_w_scale_rounding_saturates_at_127():
    """A bf16 scale rounded down makes amax / scale exceed 127: the element clamps to 127."""
    row = torch.full((1, 32), 0.001)
    row[0, 0] = 1.0 + 2.0**-7  # amax / 127 rounds down in bf16 for this amax
    q = formats.quantize(row, "int8_w")
    assert float(q.scale) < row.max().item() / 127
    assert int(q.data[0, 0]) == 127
    check(row, "int8_w")


def test_layouts_and_validation():
    assert formats.expected_layout("int8", (3, 64)) == (torch.Size([3, 64]), torch.Size([3, 2]))
    assert formats.expected_layout("int8_t", (3, 5, 40)) == (torch.Size([3, 5, 40]), torch.Size([3, 5, 1]))
    assert formats.expected_layout("int8_w", (2, 16, 40)) == (torch.Size([2, 16, 40]), torch.Size([2, 16, 1]))
    with pytest.raises(ValueError, match="multiple of 32"):
        flashrt.ops.quantize(torch.randn(4, 40), "int8")
    with pytest.raises(ValueError, match="at least 2 dims"):
        flashrt.ops.quantize(torch.randn(40), "int8_w")
    q = formats.quantize(torch.randn(4, 64), "int8")
    bad = QTensor(q.data, q.scale.view(torch.uint8), "int8", q.shape)
    with pytest.raises(ValueError, match="scale"):
        flashrt.ops.dequantize(bad)
    bad = QTensor(q.data.to(torch.uint8), q.scale, "int8", q.shape)
    with pytest.raises(ValueError, match="data"):
        flashrt.ops.dequantize(bad)


def test_ops_accept_the_new_formats(rng):
    kv = flashrt.ops.quantize(torch.randn(2, 9, 64, generator=rng), "int8")
    assert kv.narrow(1, 2, 4).shape == (2, 4, 64)
    q = torch.randn(2, 3, 4, 64, generator=rng)
    idx = torch.randint(-1, 9, (2, 3, 5), generator=rng, dtype=torch.int32)
    out = flashrt.ops.sparse_attention(q, kv, idx, None, 0.125)
    want = flashrt.ops.sparse_attention(q, formats.dequantize(kv), idx, None, 0.125)
    torch.testing.assert_close(out, want)
    w = flashrt.ops.quantize(torch.randn(16, 64, generator=rng), "int8_w")
    assert flashrt.ops.linear(torch.randn(3, 64, generator=rng), w).shape == (3, 16)
