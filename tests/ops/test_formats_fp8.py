"""fp8 and fp8_w through flashrt.ops against the independent codec of _formats_ref."""
import numpy as np
import pytest
import torch

from _formats_ref import q_bytes, rand_input, ref_quantize, to_np
from flashrt import ops

DTYPES = [torch.float32, torch.bfloat16]
FP8_SHAPES = [(3, 5, 64), (1, 96), (7, 2, 3, 32), (2, 256), (32,)]
FP8W_SHAPES = [(64, 96), (33, 70), (5, 31), (1, 1), (2, 40, 64), (96, 32), (31, 33)]
E4M3 = {448.0: 0x7E, 224.0: 0x76, 1.0: 0x38, 0.0: 0x00}


def _check(x, fmt):
    """Quantize through ops and compare bytes and dequantized values with the reference."""
    q = ops.quantize(x, fmt)
    data, sbytes, _, full, deq = ref_quantize(to_np(x), fmt)
    np.testing.assert_array_equal(q_bytes(q.scale), sbytes, err_msg=f"{fmt} scale")
    np.testing.assert_array_equal(q_bytes(q.data), data, err_msg=f"{fmt} data")
    # element * power of two is exact in fp32 for these inputs, so the dequantized values are too
    np.testing.assert_array_equal(ops.dequantize(q).numpy(), deq.astype(np.float32), err_msg=f"{fmt} deq")
    return q, full, deq


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_matches_reference(shape, dtype, rng):
    _check(rand_input(shape, dtype, rng), "fp8")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_plain_randn(dtype, rng):
    for mag in (1e-5, 1e-2, 1.0, 37.0, 1e4):
        _check((torch.randn(4, 3, 128, generator=rng) * mag).to(dtype), "fp8")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FP8W_SHAPES)
def test_fp8_w_matches_reference(shape, dtype, rng):
    q, _, _ = _check(rand_input(shape, dtype, rng, spread=12), "fp8_w")
    assert q.scale.shape == (*shape[:-2], -(-shape[-2] // 32), -(-shape[-1] // 32))


def _block(vals, n=32, fill=0.0):
    x = torch.full((n,), fill, dtype=torch.float32)
    x[: len(vals)] = torch.tensor(vals, dtype=torch.float32)
    return x


def test_fp8_zero_block_uses_floor():
    # max(0, 1e-4) / 448 = 2.23e-7; 2**-23 = 1.19e-7 < that <= 2**-22 -> UE8M0 byte 127 - 22
    x = torch.zeros(2, 64)
    x[1, 3] = -0.0
    q = ops.quantize(x, "fp8")
    assert q_bytes(q.scale).tolist() == [[105, 105], [105, 105]]
    want = np.zeros((2, 64), np.uint8)
    want[1, 3] = 0x80  # negative zero keeps its sign bit
    np.testing.assert_array_equal(q_bytes(q.data), want)
    assert torch.equal(ops.dequantize(q), torch.zeros(2, 64))
    assert torch.signbit(ops.dequantize(q))[1, 3]


def test_fp8_tiny_amax_below_floor():
    # amax 1e-6 < 1e-4: scale stays 2**-22; 1e-6 * 2**22 = 4.19 -> 4 (E4M3 step 0.5 in [4, 8))
    q = ops.quantize(_block([1e-6, -1e-6, 5e-7]), "fp8")
    assert q_bytes(q.scale).tolist() == [105]
    deq = ops.dequantize(q)
    assert deq[:3].tolist() == [4 * 2.0**-22, -4 * 2.0**-22, 2 * 2.0**-22]  # 5e-7*2**22 = 2.097 -> 2


@pytest.mark.parametrize("fmt", ["fp8", "fp8_w"])
@pytest.mark.parametrize("k", [-22, -7, 0, 3, 40, 100])
def test_fp8_exact_power_of_two_amax(fmt, k):
    amax = 448.0 * 2.0**k
    x = _block([amax, -amax / 2, amax / 448]).view(1, 32)
    q = ops.quantize(x, fmt)
    assert q_bytes(q.scale).reshape(-1).tolist() == [127 + k]  # scale = amax / 448 exactly
    assert q_bytes(q.data)[0, :3].tolist() == [E4M3[448.0], 0x80 | E4M3[224.0], E4M3[1.0]]
    # one fp32 ulp above: the smallest power of two >= amax/448 is 2**(k+1)
    up = float(np.nextafter(np.float32(amax), np.float32(np.inf)))
    q = ops.quantize(_block([up]).view(1, 32), fmt)
    assert q_bytes(q.scale).reshape(-1).tolist() == [128 + k]
    assert q_bytes(q.data)[0, 0] == E4M3[224.0]
    # bf16: one bf16 ulp above
    upb = torch.tensor(amax, dtype=torch.bfloat16) + torch.tensor(amax * 2.0**-8, dtype=torch.bfloat16)
    xb = torch.zeros(1, 32, dtype=torch.bfloat16)
    xb[0, 0] = upb
    assert q_bytes(ops.quantize(xb, fmt).scale).reshape(-1).tolist() == [128 + k]
    _check(xb, fmt)


def test_fp8_ties_round_to_even():
    # amax 448 -> scale 1, so the element is the input itself
    vals = [1.0625, 1.1875, 1.3125, -1.0625, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, -(2.0**-10), 232.0, 240.0 + 8]
    want = [1.0, 1.25, 1.25, -1.0, 16.0, 20.0, 0.0, 2.0**-8, -0.0, 224.0, 256.0]
    q = ops.quantize(_block([448.0] + vals), "fp8")
    assert q_bytes(q.scale).tolist() == [127]
    got = ops.dequantize(q)[1 : 1 + len(vals)]
    assert got.tolist() == want
    assert torch.signbit(got[8])  # -2**-10 rounds to -0 (byte 0x80)
    assert q_bytes(q.data)[9] == 0x80


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_huge_values_stay_finite(dtype):
    big = torch.finfo(dtype).max
    x = torch.tensor([[big, -big] + [big / 3] * 30, [1e38, -3e37] + [0.0] * 30], dtype=dtype)
    q = ops.quantize(x, "fp8")
    codes = q_bytes(q.data)
    assert not np.any((codes & 0x7F) == 0x7F), "no NaN codes"
    assert np.all(np.abs(q.data.to(torch.float32).numpy()) <= 448)
    data, sbytes, _, _, _ = ref_quantize(to_np(x), "fp8")
    np.testing.assert_array_equal(codes, data)
    np.testing.assert_array_equal(q_bytes(q.scale), sbytes)


def test_fp8_w_partial_tiles_by_hand():
    x = torch.zeros(33, 40)
    x[0, 0] = 448.0  # tile (0, 0): scale 1
    x[31, 31] = -448.0 * 0.5
    x[32, 39] = 448.0 * 4  # tile (1, 1), the partial corner: scale 4
    x[32, 32] = 3.0
    x[5, 35] = 1e-6  # tile (0, 1): below the floor -> 2**-22
    q = ops.quantize(x, "fp8_w")
    assert q.scale.shape == (2, 2) and q.data.shape == (33, 40)
    assert q_bytes(q.scale).tolist() == [[127, 105], [105, 129]]
    deq = ops.dequantize(q)
    assert deq[0, 0] == 448 and deq[31, 31] == -224 and deq[32, 39] == 1792 and deq[32, 32] == 3.0  # 3/4 = 0.75 exact
    assert deq[5, 35] == 4 * 2.0**-22
    nz = torch.zeros_like(x, dtype=torch.bool)
    nz[0, 0] = nz[31, 31] = nz[32, 39] = nz[32, 32] = nz[5, 35] = True
    assert torch.all(deq[~nz] == 0)


def test_fp8_w_tiles_are_independent(rng):
    # a huge value in one tile changes only that tile's scale and elements
    x = rand_input((70, 100), torch.float32, rng, spread=4)
    q0 = ops.quantize(x, "fp8_w")
    x2 = x.clone()
    x2[40, 70] = 1e9
    q1 = ops.quantize(x2, "fp8_w")
    s0, s1 = q_bytes(q0.scale), q_bytes(q1.scale)
    changed = np.argwhere(s0 != s1).tolist()
    assert changed == [[1, 2]]
    d0, d1 = q_bytes(q0.data), q_bytes(q1.data)
    mask = np.ones_like(d0, dtype=bool)
    mask[32:64, 64:96] = False
    np.testing.assert_array_equal(d0[mask], d1[mask])


@pytest.mark.parametrize("fmt", ["fp8", "fp8_w"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_round_trip_error_bound(fmt, dtype, rng):
    x = rand_input((9, 3, 96), dtype, rng, spread=20)
    q, full, _ = _check(x, fmt)
    xf = to_np(x).astype(np.float64)
    err = np.abs(xf - ops.dequantize(q).numpy())
    # E4M3: half an ulp is <= 2**-4 relative for normals, 2**-10 * scale in the subnormal range
    assert np.all(err <= 2.0**-4 * np.abs(xf) + 2.0**-10 * full)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_w"])
def test_fp8_non_contiguous_input(fmt, rng):
    x = rand_input((64, 96), torch.float32, rng, spread=8)
    for view in (x.t(), x[:, :64], x[::2]):
        q, _, _ = _check(view, fmt)
        c = ops.quantize(view.contiguous(), fmt)
        assert torch.equal(q_bytes_t(q.data), q_bytes_t(c.data))


def q_bytes_t(t):
    return torch.from_numpy(q_bytes(t))
