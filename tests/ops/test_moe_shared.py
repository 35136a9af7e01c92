"""``moe_experts(..., shared=)``: the shared expert (weight 1, every token) joins the fp32 sum after
the k routed slots and before ``add``: against a float64 computation of both experts sets on fresh
random inputs (routed ``fp4_w``, shared ``fp8_w`` or plain), and the argument's errors."""
import math

import numpy as np
import pytest
import torch

from flashrt import ops
from test_moe import _assert_quantized_close, _quantized_case, experts64


def _shared(D, I, fmt, g):
    w = (torch.randn(1, I, D, generator=g) / math.sqrt(D), torch.randn(1, I, D, generator=g) / math.sqrt(D),
         torch.randn(1, D, I, generator=g) / math.sqrt(I))
    return tuple(ops.quantize(t, fmt) for t in w) if fmt else w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,D,I,E,k,L,fmt", [(7, 64, 32, 4, 2, 0.0, "fp8_w"), (3, 32, 96, 3, 3, 1.5, "fp8_w"),
                                             (1, 96, 64, 5, 2, 0.0, None)])
def test_shared_expert_joins_the_sum(dtype, N, D, I, E, k, L, fmt, rng):
    x, weights, idx, w1, w3, w2 = _quantized_case(N, D, I, E, k, "fp4_w", rng)
    x = x.to(dtype)
    shared = _shared(D, I, fmt, rng)
    add = torch.randn(N, D, generator=rng)
    out = ops.moe_experts(x, weights, idx, w1, w3, w2, L, add=add, shared=shared)
    assert out.dtype == torch.float32 and tuple(out.shape) == (N, D)
    routed = experts64(x, weights, idx, w1, w3, w2, L)
    one = experts64(x, torch.ones(N, 1), torch.zeros(N, 1, dtype=torch.int32), *shared, L)
    want, mag, worst, omag = (a + b for a, b in zip(routed, one))
    want = want + add.double().numpy()
    _assert_quantized_close(out, want, mag + np.abs(add.double().numpy()), np.maximum(routed[2], one[2]), omag,
                            dtype)
    # the shared expert measurably contributes: the routed sum alone is off by its output
    alone = ops.moe_experts(x, weights, idx, w1, w3, w2, L, add=add)
    assert np.abs(alone.double().numpy() - want).max() > 10 * np.abs(out.double().numpy() - want).max()


def test_shared_is_the_shared_expert_as_add_then_cast(rng):
    """``shared`` equals running the shared expert as its own op and passing its output as
    ``add`` (no other add), cast to ``out_dtype`` after the sum."""
    N, D, I, E, k = 6, 64, 32, 4, 2
    x, weights, idx, w1, w3, w2 = _quantized_case(N, D, I, E, k, "fp4_w", rng)
    x = x.to(torch.bfloat16)
    shared = _shared(D, I, "fp8_w", rng)
    ones, first = torch.ones(N, 1), torch.zeros(N, 1, dtype=torch.int32)
    as_add = ops.moe_experts(x, weights, idx, w1, w3, w2, 0.7, add=ops.moe_experts(x, ones, first, *shared, 0.7),
                             out_dtype=torch.bfloat16)
    got = ops.moe_experts(x, weights, idx, w1, w3, w2, 0.7, out_dtype=torch.bfloat16, shared=shared)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, as_add)


def test_shared_errors(rng):
    N, D, I, E, k = 3, 32, 32, 4, 2
    x, weights, idx, w1, w3, w2 = _quantized_case(N, D, I, E, k, "fp4_w", rng)
    s1, s3, s2 = _shared(D, I, "fp8_w", rng)
    call = lambda shared: ops.moe_experts(x, weights, idx, w1, w3, w2, 0.0, shared=shared)
    with pytest.raises(ValueError, match=r"^shared: expected \(w1, w3, w2\).*got tuple of length 2"):
        call((s1, s3))
    with pytest.raises(ValueError, match="^shared: expected .*got QTensor"):
        call(s1)
    with pytest.raises(ValueError, match=r"^shared\[0\] \(w1\): expected shape"):
        call((ops.quantize(torch.randn(2, I, D, generator=rng), "fp8_w"), s3, s2))  # two experts
    with pytest.raises(ValueError, match=r"^shared\[2\] \(w2\): expected shape"):
        call((s1, s3, ops.quantize(torch.randn(1, D, 2 * I, generator=rng), "fp8_w")))  # another I
    with pytest.raises(ValueError, match=r"^shared\[1\] \(w3\): expected a plain tensor or a QTensor"):
        call((s1, ops.quantize(torch.randn(1, I, D, generator=rng), "fp8"), s2))  # not a weight format
    with pytest.raises(ValueError, match=r"^shared\[0\] \(w1\): expected dtype"):
        call((torch.zeros(1, I, D, dtype=torch.int32), s3, s2))
