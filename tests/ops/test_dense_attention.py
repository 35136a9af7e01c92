"""``dense_attention``: the reference against a float64 evaluation of the docs/ops.md formula, the
input checks, the CUDA kernel (Triton interpreter on CPU, small shapes) and the Ascend adapter
(emulated torch_npu) against the reference, the trace backend's shapes."""
import math

import pytest
import torch

import flashrt
from flashrt import ops

from ascend_helpers import fallbacks, npu_emulation, run_both as run_ascend  # noqa: F401
from kernel_check import DEVICE, assert_error, rel_err, requires_kernels, run_both as run_cuda


def formula(q, k, v, scale):
    """float64 [B, S, H, D], one query row and head at a time."""
    B, S, H, D = q.shape
    out = torch.empty(B, S, H, D, dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for b in range(B):
        for h in range(H):
            for s in range(S):
                logits = [scale * float(q[b, s, h] @ k[b, t, h]) for t in range(k.shape[1])]
                top = max(logits)
                w = torch.tensor([math.exp(x - top) for x in logits], dtype=torch.float64)
                out[b, s, h] = (w / w.sum()) @ v[b, :, h]
    return out


def inputs(B, S, T, H, D, dtype, g):
    r = lambda n: torch.randn(B, n, H, D, generator=g).to(dtype)
    return r(S), r(T), r(T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 8), (2, 5, 7, 3, 16), (1, 9, 9, 2, 12)])
def test_reference_matches_the_formula(rng, dtype, shape):
    q, k, v = inputs(*shape, dtype, rng)
    scale = float(torch.rand(1, generator=rng)) + 0.1
    with flashrt.use_backend("reference"):
        got = ops.dense_attention(q, k, v, scale)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(got, formula(q, k, v, scale)) < tol


def test_bad_inputs(rng):
    q, k, v = inputs(1, 4, 6, 2, 16, torch.bfloat16, rng)
    assert_error(lambda: ops.dense_attention(q, k.float(), v, 1.0), "k", "bfloat16", "float32")
    assert_error(lambda: ops.dense_attention(q, k, v[:, :5], 1.0), "v", "T=6")
    assert_error(lambda: ops.dense_attention(q, k[:, :0], v[:, :0], 1.0), "k", "T >= 1")
    assert_error(lambda: ops.dense_attention(q[0], k, v, 1.0), "q", "4 dims")
    assert_error(lambda: ops.dense_attention(q, k[..., :8], v, 1.0), "k", "D=16")
    assert_error(lambda: ops.dense_attention(q, k, v, "1"), "scale", "number")


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 16), (2, 70, 37, 2, 16), (1, 33, 100, 3, 48), (1, 17, 5, 1, 64)])
def test_cuda_kernel_matches_the_reference(rng, dtype, shape):
    q, k, v = (t.to(DEVICE) for t in inputs(*shape, dtype, rng))
    scale = shape[-1] ** -0.5
    got, want = run_cuda("dense_attention", q, k, v, scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


@requires_kernels
def test_cuda_kernel_strided_inputs(rng):
    qkv = torch.randn(2, 40, 3, 4, 32, generator=rng).bfloat16().to(DEVICE)  # q, k, v as views of one tensor
    q, k, v = qkv.unbind(2)
    got, want = run_cuda("dense_attention", q, k, v, 0.2)
    assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ascend_fusion_attention(npu_emulation, rng, dtype):
    q, k, v = inputs(2, 9, 11, 4, 32, dtype, rng)
    got, want = run_ascend("dense_attention", q, k, v, 0.17)
    assert got.dtype == dtype and rel_err(got, want) < 1e-2 and not fallbacks("dense_attention")
    call = npu_emulation.calls("npu_fusion_attention")[-1]
    assert call["input_layout"] == "BSND" and call["head_num"] == 4 and call["scale"] == 0.17


def test_ascend_falls_back_where_the_operator_does_not_apply(npu_emulation, rng):
    for q, k, v in (inputs(1, 3, 4, 2, 16, torch.float32, rng), inputs(1, 3, 4, 2, 24, torch.bfloat16, rng)):
        got, want = run_ascend("dense_attention", q, k, v, 0.3)
        assert torch.equal(got, want)
    assert len(fallbacks("dense_attention")) == 2 and not npu_emulation.calls("npu_fusion_attention")


def test_trace_shapes():
    from flashrt.backends import trace

    q = torch.empty(2, 10, 4, 16, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 12, 4, 16, device="meta", dtype=torch.bfloat16)
    with flashrt.use_backend("trace"), trace.record() as graph:
        out = ops.dense_attention(q, k, k, 0.25)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert graph.calls[-1].op == "dense_attention" and graph.calls[-1].flops == 4 * 2 * 10 * 12 * 4 * 16
