"""engram_lookup and engram_gate against independent computations (not backends/reference)."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from flashrt import QTensor, ops


def _dequant_fp8_rows64(q: QTensor) -> np.ndarray:
    """[rows, Dh] fp8 QTensor -> float64, from the stored bytes (E4M3 via ml_dtypes, UE8M0 bits)."""
    el = q.data.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scale = np.exp2(q.scale.view(torch.uint8).numpy().astype(np.float64) - 127.0)
    return el * np.repeat(scale, 32, axis=-1)


@pytest.mark.parametrize("rows,Dh,ids_shape", [(10, 32, (1, 1, 1)), (37, 64, (2, 3, 4)), (5, 96, (3, 1, 2)), (1, 32, (1, 2, 3))])
def test_engram_lookup(rows, Dh, ids_shape, rng):
    g = rng
    t = torch.randn(rows, Dh, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(-1)
    table = ops.quantize(t, "fp8")
    ids = torch.randint(0, rows, ids_shape, generator=g, dtype=torch.int64)
    ids.view(-1)[0] = rows - 1  # the last row is reachable
    out = ops.engram_lookup(table, ids)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (*ids_shape, Dh)
    deq = _dequant_fp8_rows64(table)
    want = np.empty((*ids_shape, Dh))
    for idx in np.ndindex(*ids_shape):
        want[idx] = deq[int(ids[idx])]
    # an E4M3 value times a power of two is exact in bf16: the lookup is exact
    np.testing.assert_array_equal(out.double().numpy(), want)
    # and it stands for the original rows up to fp8 rounding
    orig = t.double().numpy()[ids.numpy()]
    scale = np.repeat(np.exp2(table.scale.view(torch.uint8).numpy().astype(np.float64) - 127.0), 32, -1)[ids.numpy()]
    assert np.all(np.abs(want - orig) <= 2.0**-4 * np.abs(orig) + 2.0**-10 * scale)


def test_engram_lookup_does_not_mutate():
    t = torch.randn(4, 32)
    table = ops.quantize(t, "fp8")
    ids = torch.tensor([[[3, 0]]])
    before = table.data.view(torch.uint8).clone(), table.scale.view(torch.uint8).clone(), ids.clone()
    ops.engram_lookup(table, ids)
    assert torch.equal(table.data.view(torch.uint8), before[0])
    assert torch.equal(table.scale.view(torch.uint8), before[1])
    assert torch.equal(ids, before[2])


def test_engram_lookup_errors():
    table = ops.quantize(torch.randn(6, 32), "fp8")
    ok = torch.zeros(1, 2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="ids"):
        ops.engram_lookup(table, ok + 6)  # == rows
    with pytest.raises(ValueError, match="ids"):
        ops.engram_lookup(table, ok - 1)
    with pytest.raises(ValueError, match="ids"):
        ops.engram_lookup(table, ok.to(torch.int32))
    with pytest.raises(ValueError, match="ids"):
        ops.engram_lookup(table, ok[0])  # [S, C]: rank
    with pytest.raises(ValueError, match="ids"):
        ops.engram_lookup(table, ok.float())
    with pytest.raises(ValueError, match="table"):
        ops.engram_lookup(torch.randn(6, 32), ok)  # plain tensor
    with pytest.raises(ValueError, match="table"):
        ops.engram_lookup(ops.quantize(torch.randn(6, 32), "fp4_b32"), ok)
    with pytest.raises(ValueError, match="table"):
        ops.engram_lookup(ops.quantize(torch.randn(6, 32), "fp8_w"), ok)
    with pytest.raises(ValueError, match="table"):
        ops.engram_lookup(ops.quantize(torch.randn(2, 6, 32), "fp8"), ok)  # 3-D table
    bad = QTensor(table.data, table.scale[:, :0], "fp8", table.shape)
    with pytest.raises(ValueError, match="table"):
        ops.engram_lookup(bad, ok)


# --------------------------------------------------------------------------------- engram_gate


def _gate64(h, key, value, weight, eps):
    h, key, value, weight = (t.double().numpy() for t in (h, key, value, weight))
    B, S, hc, D = h.shape
    out = np.empty_like(h)
    gates = np.empty((B, S, hc))
    for b in range(B):
        for s in range(S):
            for k in range(hc):
                hk, kk = h[b, s, k], key[b, s, k]
                r = 1 / math.sqrt(sum(v * v for v in hk) / D + eps) / math.sqrt(sum(v * v for v in kk) / D + eps)
                d = sum(hk[i] * weight[k, i] * kk[i] for i in range(D)) * r / math.sqrt(D)
                gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(d), 1e-6)), d)))
                gates[b, s, k] = gate
                out[b, s, k] = hk + gate * value[b, s]
    return out, gates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,hc,D", [(1, 1, 4, 16), (2, 3, 4, 7), (1, 2, 1, 33), (2, 1, 3, 64)])
def test_engram_gate(dtype, wdtype, B, S, hc, D, rng):
    g = rng
    h = (torch.randn(B, S, hc, D, generator=g) * 3).to(dtype)
    key = torch.randn(B, S, hc, D, generator=g).to(dtype)
    # correlate key with h for some streams so that |d| spans small and large values, both signs
    key = (key + torch.randn(1, 1, hc, 1, generator=g).to(dtype) * h).to(dtype)
    value = torch.randn(B, S, D, generator=g).to(dtype)
    weight = (torch.rand(hc, D, generator=g) * 2).to(wdtype)
    eps = 1e-6
    out = ops.engram_gate(h, key, value, weight, eps)
    assert out.dtype == dtype and out.shape == h.shape
    want, _ = _gate64(h, key, value, weight, eps)
    mag = np.abs(h.double().numpy()) + np.abs(value.double().numpy())[:, :, None]
    rel = 2.0**-8 if dtype == torch.bfloat16 else 0
    err = np.abs(out.double().numpy() - want)
    assert np.all(err <= rel * np.abs(want) + 1e-5 * mag), err.max()


def test_engram_gate_small_d_and_signs():
    # d = 0 (zero key): the gate is sigmoid(+sqrt(1e-6)); a tiny negative d uses the floor with its sign
    D = 8
    h = torch.ones(1, 1, 3, D)
    key = torch.zeros(1, 1, 3, D)
    key[0, 0, 1] = -1.0  # d = -1 * r / sqrt(D) * ... -> negative
    key[0, 0, 2] = 1.0
    weight = torch.ones(3, D)
    weight[2] = 1e-8  # tiny positive d, below the 1e-6 floor
    value = torch.ones(1, 1, D)
    out = ops.engram_gate(h, key, value, weight, 1e-6)
    want, gates = _gate64(h, key, value, weight, 1e-6)
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-6, atol=1e-6)
    assert gates[0, 0, 0] == pytest.approx(1 / (1 + math.exp(-1e-3)))
    assert gates[0, 0, 2] == pytest.approx(1 / (1 + math.exp(-1e-3)))
    assert gates[0, 0, 1] < 0.5


def test_engram_gate_errors():
    h = torch.randn(1, 2, 4, 8)
    key, value, weight = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 8), torch.rand(4, 8)
    with pytest.raises(ValueError, match="h"):
        ops.engram_gate(h[0], key, value, weight, 1e-6)
    with pytest.raises(ValueError, match="h"):
        ops.engram_gate(h.to(torch.int32), key, value, weight, 1e-6)
    with pytest.raises(ValueError, match="key"):
        ops.engram_gate(h, key[:, :, :3], value, weight, 1e-6)
    with pytest.raises(ValueError, match="value"):
        ops.engram_gate(h, key, value[..., :7], weight, 1e-6)
    with pytest.raises(ValueError, match="value"):
        ops.engram_gate(h, key, value.unsqueeze(2), weight, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        ops.engram_gate(h, key, value, weight[:3], 1e-6)
    with pytest.raises(ValueError, match="weight"):
        ops.engram_gate(h, key, value, weight[0], 1e-6)
    with pytest.raises(ValueError, match="eps"):
        ops.engram_gate(h, key, value, weight, -1.0)
