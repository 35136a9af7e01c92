"""QTensor layouts, dequantize dtypes, dequantize_rows, input errors and property tests (all formats)."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from _formats_ref import q_bytes, rand_input, ref_quantize, to_np
from flashrt import QTensor, formats, ops

ALL = ["fp8", "fp4_b16", "fp4_b32", "fp8_w", "fp4_w"]
F8, E8, U8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8

# (fmt, logical shape, data dtype, data shape, scale dtype, scale shape), written out by hand
LAYOUTS = [
    ("fp8", (3, 5, 64), F8, (3, 5, 64), E8, (3, 5, 2)),
    ("fp8", (1, 96), F8, (1, 96), E8, (1, 3)),
    ("fp8", (7, 2, 3, 32), F8, (7, 2, 3, 32), E8, (7, 2, 3, 1)),
    ("fp4_b16", (3, 5, 64), U8, (3, 5, 32), F8, (3, 5, 4)),
    ("fp4_b16", (2, 512), U8, (2, 256), F8, (2, 32)),
    ("fp4_b16", (16,), U8, (8,), F8, (1,)),
    ("fp4_b32", (7, 2, 3, 32), U8, (7, 2, 3, 16), E8, (7, 2, 3, 1)),
    ("fp4_b32", (1, 96), U8, (1, 48), E8, (1, 3)),
    ("fp8_w", (64, 96), F8, (64, 96), E8, (2, 3)),
    ("fp8_w", (33, 70), F8, (33, 70), E8, (2, 3)),
    ("fp8_w", (1, 1), F8, (1, 1), E8, (1, 1)),
    ("fp8_w", (4, 65, 32), F8, (4, 65, 32), E8, (4, 3, 1)),
    ("fp4_w", (64, 96), U8, (64, 48), E8, (64, 3)),
    ("fp4_w", (5, 32), U8, (5, 16), E8, (5, 1)),
]


@pytest.mark.parametrize("fmt,shape,ddt,dshape,sdt,sshape", LAYOUTS)
def test_layout(fmt, shape, ddt, dshape, sdt, sshape, rng):
    q = ops.quantize(rand_input(shape, torch.float32, rng, spread=8), fmt)
    assert isinstance(q, QTensor) and q.fmt == fmt and q.shape == shape and q.ndim == len(shape)
    assert (q.data.dtype, tuple(q.data.shape), q.scale.dtype, tuple(q.scale.shape)) == (ddt, dshape, sdt, sshape)
    assert formats.expected_layout(fmt, shape) == (torch.Size(dshape), torch.Size(sshape))
    formats.check_qtensor(q, "q")
    assert q.nbytes == int(np.prod(dshape)) * q.data.element_size() + int(np.prod(sshape))
    assert q.device == torch.device("cpu") and q.to("cpu").shape == q.shape


@pytest.mark.parametrize("fmt,shape,ddt,dshape,sdt,sshape", LAYOUTS[:3] + LAYOUTS[-2:])
def test_check_qtensor_rejects_a_bad_layout_after_a_good_one(fmt, shape, ddt, dshape, sdt, sshape, rng):
    """The layout of a valid (fmt, shape) is kept after its first check: a QTensor of the same
    fmt and shape with the wrong data or scale dtype or shape is still rejected, naming the part."""
    q = ops.quantize(rand_input(shape, torch.float32, rng, spread=8), fmt)
    formats.check_qtensor(q, "q")  # kept
    bad_dtype = torch.int16 if q.data.dtype != torch.int16 else torch.uint8
    cases = {"q.data": QTensor(q.data.view(-1)[:-1], q.scale, fmt, q.shape),
             "q.data:dtype": QTensor(q.data.to(bad_dtype), q.scale, fmt, q.shape),
             "q.scale": QTensor(q.data, q.scale.unsqueeze(0), fmt, q.shape),
             "q.scale:dtype": QTensor(q.data, q.scale.view(torch.uint8).to(torch.int16), fmt, q.shape)}
    for part, bad in cases.items():
        with pytest.raises(ValueError, match=part.split(":")[0].replace(".", r"\.") + ": expected"):
            formats.check_qtensor(bad, "q")
    formats.check_qtensor(q, "q")  # the good one still passes
    with pytest.raises(ValueError, match="fmt: expected one of"):
        formats.check_qtensor(QTensor(q.data, q.scale, ["fp8"], q.shape), "q")  # unhashable


def test_fp4_b16_entry_is_288_bytes():
    q = ops.quantize(torch.randn(1, 512), "fp4_b16")
    assert q.nbytes == 288


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_dtype(fmt, out_dtype, rng):
    x = rand_input((4, 64), torch.bfloat16, rng, spread=4)
    q = ops.quantize(x, fmt)
    got = ops.dequantize(q, out_dtype)
    assert got.dtype == out_dtype and got.shape == x.shape
    _, _, _, _, deq = ref_quantize(to_np(x), fmt)
    assert torch.equal(got, torch.from_numpy(deq.astype(np.float32)).to(out_dtype))


@pytest.mark.parametrize("fmt", ["fp8", "fp4_b16", "fp4_b32"])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_dequantize_rows(fmt, idx_dtype, rng):
    # [rows, N] with a 1-D and a 2-D index
    x = rand_input((37, 64), torch.float32, rng, spread=10)
    q = ops.quantize(x, fmt)
    full = ops.dequantize(q)
    for shape in [(11,), (3, 4), (0,)]:
        idx = torch.randint(0, 37, shape, generator=rng).to(idx_dtype)
        got = formats.dequantize_rows(q, idx)
        assert got.shape == (*shape, 64)
        assert torch.equal(got, full[idx.long()])
    assert torch.equal(formats.dequantize_rows(q, torch.tensor([5]), torch.bfloat16), full[5:6].bfloat16())
    # [B, rows, N] with a [B, K] index
    xb = rand_input((3, 20, 64), torch.bfloat16, rng, spread=10)
    qb = ops.quantize(xb, fmt)
    fullb = ops.dequantize(qb)
    idx = torch.randint(0, 20, (3, 7), generator=rng).to(idx_dtype)
    got = formats.dequantize_rows(qb, idx)
    want = torch.stack([fullb[b, idx[b].long()] for b in range(3)])
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "x,fmt,name",
    [
        (torch.randn(2, 32), "fp6", "fmt"),
        (torch.randn(2, 32), None, "fmt"),
        (torch.randn(2, 32), "FP8", "fmt"),
        (torch.randn(2, 48), "fp8", "x"),
        (torch.randn(2, 8), "fp4_b16", "x"),
        (torch.randn(2, 48), "fp4_b32", "x"),
        (torch.randn(3, 48), "fp4_w", "x"),
        (torch.randn(64), "fp8_w", "x"),
        (torch.randn(64), "fp4_w", "x"),
        (torch.tensor(1.0), "fp8", "x"),
        (np.zeros((2, 32), np.float32), "fp8", "x"),
        ([[0.0] * 32], "fp8", "x"),
        (torch.zeros(2, 32, dtype=torch.int32), "fp8", "x"),
        (torch.zeros(2, 32, dtype=F8), "fp8", "x"),
    ],
)
def test_quantize_errors(x, fmt, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        ops.quantize(x, fmt)


def test_dequantize_errors():
    q = ops.quantize(torch.randn(4, 64), "fp4_b16")
    with pytest.raises(ValueError, match=r"^q\b"):
        ops.dequantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"^dtype\b"):
        ops.dequantize(q, torch.int32)
    with pytest.raises(ValueError, match=r"^q\.scale\b"):
        ops.dequantize(QTensor(q.data, q.scale.view(torch.uint8), "fp4_b16", q.shape))
    with pytest.raises(ValueError, match=r"^q\.scale\b"):
        ops.dequantize(QTensor(q.data, q.scale[:, :2], "fp4_b16", q.shape))
    with pytest.raises(ValueError, match=r"^q\.data\b"):
        ops.dequantize(QTensor(q.data[:, :16], q.scale, "fp4_b16", q.shape))
    with pytest.raises(ValueError, match=r"^q\.data\b"):  # fp4_b16 bytes labelled fp8
        ops.dequantize(QTensor(q.data, q.scale, "fp8", q.shape))
    with pytest.raises(ValueError, match=r"^q\b.*'fp5'"):
        ops.dequantize(QTensor(q.data, q.scale, "fp5", q.shape))


# -------------------------------------------------------------------------------- property tests

FP32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
# mostly moderate numbers but also the extremes (subnormals, +-fp32 max) hypothesis likes
BLOCKS = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])), elements=FP32)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=BLOCKS, fmt=st.sampled_from(ALL), log2_mag=st.integers(-30, 30))
def test_property_matches_reference(x, fmt, log2_mag):
    with np.errstate(over="ignore"):
        x = np.nan_to_num(x * np.float32(2.0**log2_mag), posinf=3e38, neginf=-3e38).astype(np.float32)
    t = torch.from_numpy(x)
    q = ops.quantize(t, fmt)
    data, sbytes, _, _, deq = ref_quantize(x, fmt)
    np.testing.assert_array_equal(q_bytes(q.scale), sbytes)
    np.testing.assert_array_equal(q_bytes(q.data), data)
    with np.errstate(over="ignore"):  # 2**128 (fp32 max rounded up) dequantizes to inf in both
        np.testing.assert_array_equal(ops.dequantize(q).numpy(), deq.astype(np.float32))


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(ALL), out=st.integers(1, 70), n32=st.integers(1, 3), dtype=st.sampled_from(["f32", "bf16"]))
def test_property_shapes(fmt, out, n32, dtype):
    inp = 32 * n32 if fmt != "fp8_w" else 32 * n32 - (out % 7)
    g = torch.Generator().manual_seed(out * 31 + n32)
    x = rand_input((out, inp), torch.float32 if dtype == "f32" else torch.bfloat16, g, spread=16)
    q = ops.quantize(x, fmt)
    assert (q.data.shape, q.scale.shape) == formats.expected_layout(fmt, x.shape)
    data, sbytes, _, _, _ = ref_quantize(to_np(x), fmt)
    np.testing.assert_array_equal(q_bytes(q.data), data)
    np.testing.assert_array_equal(q_bytes(q.scale), sbytes)
