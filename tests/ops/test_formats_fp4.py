"""fp4_b16, fp4_b32 and fp4_w through flashrt.ops against the independent codec of _formats_ref."""
import ml_dtypes
import numpy as np
import pytest
import torch

from _formats_ref import BLOCK, E2M1_ALL, q_bytes, rand_input, ref_quantize, to_np
from flashrt import formats, ops

DTYPES = [torch.float32, torch.bfloat16]
FP4 = ["fp4_b16", "fp4_b32", "fp4_w"]
SHAPES = [(3, 5, 64), (1, 96), (7, 2, 3, 32), (2, 512), (4, 32)]
MIDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
MID_CODES = [0, 2, 2, 4, 4, 6, 6]  # ties go to the even code (mantissa bit 0)


def _check(x, fmt):
    q = ops.quantize(x, fmt)
    data, sbytes, codes, full, deq = ref_quantize(to_np(x), fmt)
    np.testing.assert_array_equal(q_bytes(q.scale), sbytes, err_msg=f"{fmt} scale")
    np.testing.assert_array_equal(q_bytes(q.data), data, err_msg=f"{fmt} data")
    np.testing.assert_array_equal(ops.dequantize(q).numpy(), deq.astype(np.float32), err_msg=f"{fmt} deq")
    return q, codes, full


def _codes(q):
    """Unpack by hand: element 2i is the low nibble."""
    b = q_bytes(q.data)
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)


def _row(vals, n):
    x = torch.zeros(1, n)
    x[0, : len(vals)] = torch.tensor(vals, dtype=torch.float32)
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FP4)
def test_fp4_matches_reference(fmt, shape, dtype, rng):
    _check(rand_input(shape, dtype, rng, spread=30), fmt)


@pytest.mark.parametrize("fmt", FP4)
def test_fp4_plain_randn(fmt, rng):
    for mag in (1e-4, 0.1, 1.0, 300.0, 1e6):
        for dtype in DTYPES:
            _check((torch.randn(5, 128, generator=rng) * mag).to(dtype), fmt)


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("k", [-9, -3, 0, 2, 8])
def test_fp4_ties_to_even(fmt, k):
    # amax 6 * 2**k -> scale 2**k (a power of two, also exact in E4M3 for k in [-9, 8])
    s = 2.0**k
    vals = [6 * s] + [m * s for m in MIDS] + [-m * s for m in MIDS]
    q = ops.quantize(_row(vals, 32), fmt)
    sb = q_bytes(q.scale)[0, 0]
    assert sb == (np.float32(s).astype(ml_dtypes.float8_e4m3fn).view(np.uint8) if fmt == "fp4_b16" else 127 + k)
    c = _codes(q)[0]
    assert c[0] == 7
    assert c[1:8].tolist() == MID_CODES
    assert c[8:15].tolist() == [8 | m for m in MID_CODES]
    assert c[15:].tolist() == [0] * 17


@pytest.mark.parametrize("s,byte", [(1.125, 0x39), (1.375, 0x3B), (0.0859375, 0x1B), (3 * 2.0**-9, 0x03), (448.0, 0x7E)])
def test_fp4_b16_ties_with_non_power_of_two_scale(s, byte):
    # amax = 6 * s with s an E4M3 value; mid * s is exact in fp32, and so is (mid * s) / s = mid
    vals = [6 * s] + [m * s for m in MIDS] + [-m * s for m in MIDS]
    q = ops.quantize(_row(vals, 16), "fp4_b16")
    assert q_bytes(q.scale).tolist() == [[byte]]
    c = _codes(q)[0]
    assert c[0] == 7 and c[1:8].tolist() == MID_CODES and c[8:15].tolist() == [8 | m for m in MID_CODES]


def test_fp4_packing_by_hand():
    # scale 1 (amax 6): values are their own codes; element 2i low nibble, 2i+1 high nibble
    vals = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0, 0.0, -0.0, 0.0, 0.0, -0.0, 1.0, -1.0]
    for fmt in FP4:
        q = ops.quantize(_row(vals, 32), fmt)
        assert q.data.dtype == torch.uint8 and q.data.shape == (1, 16)
        assert q_bytes(q.data)[0, :8].tolist() == [0x21, 0x43, 0x65, 0x97, 0x0F, 0x08, 0x80, 0xA2]
        assert ops.dequantize(q)[0, :16].tolist() == vals
    codes = torch.randint(0, 16, (3, 4, 64), dtype=torch.uint8)
    packed = formats.pack_fp4(codes)
    assert packed.shape == (3, 4, 32)
    assert torch.equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))
    assert torch.equal(formats.unpack_fp4(packed), codes)


@pytest.mark.parametrize("fmt,floor_byte", [("fp4_b16", 0x01), ("fp4_b32", 1), ("fp4_w", 1)])
def test_fp4_zero_blocks_and_negative_zero(fmt, floor_byte):
    # b16: max(0, 6*2**-9)/6 = 2**-9, the smallest E4M3 subnormal (byte 1); b32/w: 2**-126 (byte 1)
    x = torch.zeros(2, 64)
    x[1, 0] = -0.0
    x[1, 5] = -0.0
    q = ops.quantize(x, fmt)
    assert np.all(q_bytes(q.scale) == floor_byte)
    b = q_bytes(q.data)
    assert b[0].tolist() == [0] * 32
    assert b[1, 0] == 0x08 and b[1, 2] == 0x80 and b[1, 1] == 0 and np.all(b[1, 3:] == 0)
    deq = ops.dequantize(q)
    assert torch.all(deq == 0) and torch.signbit(deq[1, 0]) and torch.signbit(deq[1, 5])


def test_fp4_tiny_amax_below_floor():
    # b16: amax 1e-3 < 6*2**-9 -> scale 2**-9; 1e-3 * 2**9 = 0.512 -> 0.5 (code 1), -2e-4 -> -0.1 -> code 8
    q = ops.quantize(_row([1e-3, -2e-4, 2e-3], 16), "fp4_b16")
    assert q_bytes(q.scale).tolist() == [[1]]
    assert _codes(q)[0, :3].tolist() == [1, 8, 2]  # 2e-3*2**9 = 1.024 -> 1.0 (code 2)
    # b32: a subnormal amax -> scale 2**-126; 1e-39 / 2**-126 = 0.085 -> 0
    q = ops.quantize(_row([1e-39, -1e-39, 5e-38], 32), "fp4_b32")
    assert q_bytes(q.scale).tolist() == [[1]]
    assert _codes(q)[0, :3].tolist() == [0, 8, 6]  # 5e-38 / 2**-126 = 4.25 -> 4 (code 6)


@pytest.mark.parametrize("fmt", ["fp4_b32", "fp4_w"])
@pytest.mark.parametrize("k", [-126, -20, 0, 7, 100])
def test_fp4_b32_exact_power_of_two_amax(fmt, k):
    amax = 6.0 * 2.0**k
    q = ops.quantize(_row([amax, -amax / 4], 32), fmt)
    assert q_bytes(q.scale).tolist() == [[127 + k]]
    assert _codes(q)[0, :2].tolist() == [7, 8 | 3]  # 6 and -1.5
    up = float(np.nextafter(np.float32(amax), np.float32(np.inf)))
    q = ops.quantize(_row([up, amax / 4], 32), fmt)
    assert q_bytes(q.scale).tolist() == [[128 + k]]  # scale doubles
    assert _codes(q)[0, :2].tolist() == [5, 2]  # 3.0000002 -> 3 (code 5); 0.75 is a tie -> 1.0 (code 2)
    _check(torch.tensor([[up, amax / 4] + [0.0] * 30], dtype=torch.bfloat16), fmt)


def test_fp4_b16_scale_rounds_to_nearest_e4m3():
    # amax/6 on E4M3 midpoints -> even; just above -> up; the clamp at 448
    cases = [
        (6 * 1.0625, 0x38),  # 1.0625 is between 1.0 (0x38) and 1.125 (0x39): tie -> 0x38
        (6 * 1.1875, 0x3A),  # between 1.125 and 1.25: tie -> 1.25 (0x3A)
        (float(np.nextafter(np.float32(6 * 1.0625), np.float32(9))), 0x39),
        (6 * 1.0624, 0x38),
        (6 * 3 * 2.0**-10, 0x02),  # 1.5 * 2**-9 between subnormals 2**-9 and 2**-8: tie -> 2**-8
        (6 * 448.0, 0x7E),
        (6 * 470.0, 0x7E),  # clamped to 448 (not NaN)
        (6 * 500.0, 0x7E),
        (1e30, 0x7E),
    ]
    x = torch.zeros(len(cases), 16)
    for i, (amax, _) in enumerate(cases):
        x[i, 3] = -amax
    q = ops.quantize(x, "fp4_b16")
    assert q_bytes(q.scale)[:, 0].tolist() == [b for _, b in cases]
    c = _codes(q)[:, 3].tolist()
    # x/scale: 6.375 (clamp), 5.7, 5.67, 6.37 (clamp), 4.5 (-> 4, code 6), 6, 6.29, 6.7, 2e27 (clamp)
    assert c == [15, 15, 15, 15, 8 | 6, 15, 15, 15, 15]
    _check(x, "fp4_b16")


@pytest.mark.parametrize("fmt,want", [("fp4_b16", [7, 15, 7, 15]), ("fp4_b32", [6, 14, 4, 11]), ("fp4_w", [6, 14, 4, 11])])
def test_fp4_huge_values(fmt, want):
    # b16: scale clamps to 448, so 1e38/448 etc. saturate to +-6 (codes 7 / 15).
    # b32: 1e38/6 -> 2**124; 1e38/2**124 = 4.70 -> 4, 5e37 -> 2.35 -> 2, -3.3e37 -> -1.57 -> -1.5
    x = _row([1e38, -1e38, 5e37, -1e38 / 3], 32)
    q, codes, _ = _check(x, fmt)
    assert codes[0, :4].tolist() == want
    assert q_bytes(q.scale)[0, 0] == (0x7E if fmt == "fp4_b16" else 127 + 124)
    assert torch.isfinite(ops.dequantize(q)).all()


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp4_round_trip_error_bound(fmt, dtype, rng):
    x = rand_input((6, 4, 64), dtype, rng, spread=6)  # amax/6 < 448: fp4_b16's scale is not clamped
    q, _, full = _check(x, fmt)
    xf = to_np(x).astype(np.float64)
    err = np.abs(xf - ops.dequantize(q).numpy())
    v = np.abs(xf) / full
    inside = v <= 6  # always for power-of-two scales; fp4_b16's E4M3 scale may round below amax/6
    half_gap = np.where(v <= 2, 0.25, np.where(v <= 4, 0.5, 1.0))
    assert np.all(err[inside] <= (half_gap * full)[inside])
    assert np.all(err[~inside] == (np.abs(xf) - 6 * full)[~inside])  # clamped to +-6 * scale
    assert fmt == "fp4_b16" or inside.all()


def test_e2m1_codes_all_fp32_grid_points():
    # every multiple of 1/8 in [-8, 8] plus the midpoints' fp32 neighbours, vs ml_dtypes
    v = np.arange(-64, 65, dtype=np.float32) / 8
    mids = np.array(MIDS, np.float32)
    v = np.concatenate([v, np.nextafter(mids, 0), np.nextafter(mids, 9), -np.nextafter(mids, 0), [-0.0, 1e30, -1e30]])
    v = v.astype(np.float32)
    want = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    got = formats.e2m1_codes(torch.from_numpy(v)).numpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(formats.e2m1_values(torch.from_numpy(got)).numpy(), E2M1_ALL[want])


def test_fp4_block_sizes_by_hand():
    # fp4_b16 has one scale per 16, fp4_b32 per 32: a spike in element 20 only affects its block
    x = torch.full((1, 64), 0.5)
    x[0, 20] = 96.0
    q16 = ops.quantize(x, "fp4_b16")
    # 0.5/6 = 0.0833 lies in [2**-4, 2**-3) (step 2**-7): nearest 11 * 2**-7 = 1.375 * 2**-4 -> E=3, m=3: 0x1B
    # 96/6 = 16 = 2**4 -> E=11, m=0: 0x58
    assert q_bytes(q16.scale).tolist() == [[0x1B, 0x58, 0x1B, 0x1B]]
    q32 = ops.quantize(x, "fp4_b32")
    assert q_bytes(q32.scale).tolist() == [[127 + 4, 127 - 3]]  # 96/6 = 16 = 2**4; 0.5/6 -> 2**-3
    assert BLOCK["fp4_b16"] == 16
