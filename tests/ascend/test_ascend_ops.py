"""Ascend backend through the emulated torch_npu: quantize, dequantize, linear, sparse attention,
index scores and MoE (see test_ascend_backend.py for the rest).

``int8_w`` weights see ``int8_t`` (per-token) activations (ops.linear); the oracle for them is
written here from the formats module, as the reference backend's linear/_project would compute it.
"""
import pytest
import torch
import torch.nn.functional as F

from flashrt import formats

from ascend_helpers import fallbacks, npu_emulation, run_both  # noqa: F401
from kernel_check import rel_err

import flashrt


def oracle_linear(x, w, wide: bool = False):
    """int8_t activations times ``w``, summed in fp32 (``wide``: in fp64, rounded to fp32 as the
    reference backend does), in ``x``'s dtype."""
    xq = formats.dequantize(formats.quantize(x, "int8_t"))
    if wide:
        return F.linear(xq.double(), formats.dequantize(w).double()).float().to(x.dtype)
    return F.linear(xq, formats.dequantize(w)).to(x.dtype)


def ascend(op, *args):
    with flashrt.use_backend("ascend"):
        return getattr(flashrt.ops, op)(*args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_int8_t_through_npu_dynamic_quant(npu_emulation, rng, dtype):
    x = (torch.randn(3, 6, 64, generator=rng) * 4).to(dtype)
    x[0, 1] = 0  # 0 / 0 in the operator: the emulation writes -128 there
    x[1, 2] = 1e-39 if dtype == torch.bfloat16 else 0  # below the amax floor
    got = ascend("quantize", x, "int8_t")
    want = formats.quantize(x, "int8_t")
    assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
    assert npu_emulation.calls("npu_dynamic_quant")[-1]["input"] is x


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp4_b16", "fp4_b32"])
def test_quantize_falls_back_to_the_codec(npu_emulation, rng, fmt):
    x = torch.randn(4, 64, generator=rng).bfloat16()
    got, want = run_both("quantize", x, fmt)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert fallbacks("quantize") and not npu_emulation.calls("npu_dynamic_quant")


@pytest.mark.parametrize("fmt", ["fp8", "fp4_b16", "fp4_b32", "int8", "int8_t", "fp8_w", "fp4_w", "int8_w"])
def test_dequantize_decodes_bytes_exactly(npu_emulation, rng, fmt):
    x = torch.randn(3, 40, 64, generator=rng) * torch.exp2(torch.randint(-8, 8, (3, 40, 1), generator=rng).float())
    q = formats.quantize(x, fmt)
    got, want = run_both("dequantize", q, torch.float32)
    assert torch.equal(got, want)


def test_linear_plain_weight(npu_emulation, rng):
    x = torch.randn(2, 5, 64, generator=rng).bfloat16()
    w = torch.randn(48, 64, generator=rng).bfloat16()
    got, want = run_both("linear", x, w)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-2 and not fallbacks("linear")
    got, want = run_both("linear", x.float(), w)  # mixed dtypes: fp32, as the reference
    assert torch.equal(got, want) and fallbacks("linear")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_int8_w_maps_to_npu_quant_matmul(npu_emulation, rng, dtype):
    x = torch.randn(2, 5, 96, generator=rng).to(dtype)
    x[0, 0] = 0
    w = formats.quantize(torch.randn(40, 96, generator=rng), "int8_w")
    got = ascend("linear", x, w)
    assert got.dtype == dtype and got.shape == (2, 5, 40)
    assert rel_err(got, oracle_linear(x, w)) < 1e-2
    call = npu_emulation.calls("npu_quant_matmul")[-1]
    assert tuple(call["x1"].shape) == (10, 96) and call["x1"].dtype == torch.int8
    assert tuple(call["x2"].shape) == (96, 40) and call["x2"].stride() == (1, 96)  # w.data.t(): a view
    assert call["x2"].data_ptr() == w.data.data_ptr()
    assert call["scale"].shape == (40,) and call["scale"].dtype == (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    assert call["pertoken_scale"].shape == (10,) and call["output_dtype"] == dtype
    assert not fallbacks("linear")


def test_linear_fallbacks_fp32_x_and_fp8_weights(npu_emulation, rng):
    x = torch.randn(4, 64, generator=rng)
    w = formats.quantize(torch.randn(16, 64, generator=rng), "int8_w")
    assert torch.equal(ascend("linear", x, w), oracle_linear(x, w, wide=True))  # the reference backend's bits
    w8 = formats.quantize(torch.randn(16, 64, generator=rng), "fp8_w")
    got, want = run_both("linear", x.bfloat16(), w8)
    assert torch.equal(got, want)
    assert len(fallbacks("linear")) == 2 and not npu_emulation.calls("npu_quant_matmul")


def _attention_inputs(rng, B=2, S=3, H=4, T=24, K=8, dtype=torch.bfloat16):
    q = torch.randn(B, S, H, 512, generator=rng).to(dtype)
    kv = torch.randn(B, T, 512, generator=rng)
    idx = torch.randint(0, T, (B, S, K), generator=rng, dtype=torch.int32)
    idx[torch.rand(B, S, K, generator=rng) < 0.3] = -1  # -1 anywhere: order is irrelevant
    idx[1, 2] = -1  # a row with no valid slot
    sink = torch.randn(H, generator=rng)
    return q, kv, idx, sink


@pytest.mark.parametrize("with_sink", [False, True])
def test_sparse_attention_plain_kv(npu_emulation, rng, with_sink):
    q, kv, idx, sink = _attention_inputs(rng)
    sink = sink if with_sink else None
    got, want = run_both("sparse_attention", q, kv.bfloat16(), idx, sink, 0.05)
    assert rel_err(got, want) < 1e-2 and not fallbacks("sparse_attention")
    assert with_sink or (torch.equal(got[1, 2], want[1, 2]) and not got[1, 2].any())  # no slot, no sink: zeros
    call = npu_emulation.calls("npu_sparse_flash_attention")[-1]
    B, S, K = idx.shape
    extra = 1 if with_sink else 0
    assert call["key"] is call["value"] and tuple(call["key"].shape) == (B, S * K + extra, 1, 512)
    assert call["sparse_mode"] == 0 and call["attention_mode"] == 2 and call["scale_value"] == 0.05
    si = call["sparse_indices"]
    assert tuple(si.shape) == (B, S, 1, K + extra)
    assert ((si >= 0).sum(-1) == (idx >= 0).sum(-1).unsqueeze(-1) + extra).all()
    if with_sink:
        assert (si[..., 0] == S * K).all()  # the sink entry first, always valid
        carried = call["query_rope"][..., :3].float().sum(-1) * 0.05
        torch.testing.assert_close(carried, sink.expand(B, S, -1), rtol=1e-6, atol=1e-6)


def test_sparse_attention_quantized_segments(npu_emulation, rng):
    q, kv, idx, sink = _attention_inputs(rng, T=40)
    window = formats.quantize(kv[:, :8], "int8")
    main = formats.quantize(kv[:, 8:], "fp4_b16")
    got, want = run_both("sparse_attention", q, (window, main), idx, sink, 0.05)
    assert rel_err(got, want) < 1e-2 and not fallbacks("sparse_attention")
    key = npu_emulation.calls("npu_sparse_flash_attention")[-1]["key"]
    assert key.dtype == torch.bfloat16  # decoded exactly into bf16 on the way in


def test_sparse_attention_fallbacks(npu_emulation, rng):
    q, kv, idx, sink = _attention_inputs(rng)
    got, want = run_both("sparse_attention", q.float(), kv, idx, sink, 0.05)  # fp32 q
    assert torch.equal(got, want)
    q64 = torch.randn(2, 3, 4, 64, generator=rng).bfloat16()  # D != 512
    got, want = run_both("sparse_attention", q64, kv[..., :64].bfloat16(), idx, None, 0.1)
    assert torch.equal(got, want)
    got, want = run_both("sparse_attention", q, kv, idx, sink, 0.05)  # fp32 kv under bf16 q
    assert torch.equal(got, want)
    assert len(fallbacks("sparse_attention")) == 3 and not npu_emulation.calls("npu_sparse_flash_attention")


def test_index_scores_plain_torch(npu_emulation, rng):
    B, S, Hi, Di, T = 2, 3, 4, 64, 30
    q = torch.randn(B, S, Hi, Di, generator=rng).bfloat16()
    k = formats.quantize(torch.randn(B, T, Di, generator=rng), "fp4_b32")
    w = torch.randn(B, S, Hi, generator=rng)
    vis = torch.randint(0, T + 1, (B, S), generator=rng, dtype=torch.int32)
    got, want = run_both("index_scores", q, k, w, vis)
    assert torch.equal(got, want) and fallbacks("index_scores")
    from test_paged_keys import paged  # paged keys: gathered, then the same plain torch

    got, _ = run_both("index_scores", q, paged(k, 8, rng), w, vis)
    assert torch.equal(got, want)


@pytest.mark.parametrize("score_func,bias", [("sigmoid", True), ("softmax", False), ("sigmoid", False)])
def test_moe_route_maps_to_npu_moe_gating_top_k(npu_emulation, rng, score_func, bias):
    N, D, E, k = 7, 32, 16, 4
    x = torch.randn(N, D, generator=rng).bfloat16()
    w = torch.randn(E, D, generator=rng)
    w[5], w[9] = w[3], w[3]  # equal scores: the emulation breaks ties towards the higher expert
    b = torch.randn(E, generator=rng) * 0.1 if bias else None
    if bias:
        b[5], b[9] = b[3], b[3]
    got, want = run_both("moe_route", x, w, b, k, score_func, True, 2.5)
    assert torch.equal(got[1], want[1])
    # the backend's logits are an fp32 GEMM, the reference's float64 sums rounded once: a few fp32
    # ulps of a logit, which the softmax carries into the weights
    torch.testing.assert_close(got[0], want[0], rtol=2e-5, atol=1e-6)
    call = npu_emulation.calls("npu_moe_gating_top_k")[-1]
    assert call["norm_type"] == (1 if score_func == "sigmoid" else 0) and call["out_flag"] and call["k"] == k
    assert call["group_count"] == 1 and call["x"].dtype == torch.float32 and tuple(call["x"].shape) == (N, E)


def test_moe_route_fallbacks(npu_emulation, rng):
    x, w = torch.randn(5, 32, generator=rng), torch.randn(8, 32, generator=rng)
    b = torch.randn(8, generator=rng)
    for args in ((b, 2, "sqrtsoftplus"), (b, 2, "softmax")):
        got, want = run_both("moe_route", x, w, args[0], args[1], args[2], True, 1.0)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    wt = torch.zeros(8, 32)  # every score equal: a tie at the k-th place
    got, want = run_both("moe_route", x, wt, None, 3, "sigmoid", False, 1.0)
    assert torch.equal(got[1], want[1])
    assert len(fallbacks("moe_route")) == 3


def _experts_inputs(rng, N=9, D=64, I=32, E=6, k=2):
    x = torch.randn(N, D, generator=rng).bfloat16()
    weights = torch.rand(N, k, generator=rng)
    idx = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(N)]).to(torch.int32)
    ws = [torch.randn(E, I, D, generator=rng) * 0.2, torch.randn(E, I, D, generator=rng) * 0.2,
          torch.randn(E, D, I, generator=rng) * 0.2]
    return x, weights, idx, ws


def test_moe_experts_plain_weights_grouped_matmul(npu_emulation, rng):
    x, weights, idx, ws = _experts_inputs(rng)
    ws = [w.bfloat16() for w in ws]
    got, want = run_both("moe_experts", x, weights, idx, *ws, 0.8)
    assert got.dtype == torch.float32 and rel_err(got, want) < 2e-2 and not fallbacks("moe_experts")
    calls = npu_emulation.calls("npu_grouped_matmul")
    assert len(calls) == 3 and all(c["group_type"] == 0 and c["group_list_type"] == 1 for c in calls)
    assert calls[0]["group_list"].tolist() == torch.bincount(idx.flatten().long(), minlength=6).tolist()
    assert tuple(calls[0]["weight"][0].shape) == (6, 64, 32)  # [E, in, out]: a transposed view


def oracle_experts(x, weights, idx, w1, w3, w2, limit, wide=False):
    """Each token through its experts one at a time (``wide``: every product summed in fp64, as the
    reference backend does, so fp32 inputs give the same ``h`` to the bit and the same int8 codes)."""
    out = torch.zeros(x.shape[0], x.shape[1])
    for n in range(x.shape[0]):
        for j, e in enumerate(idx[n].tolist()):
            pick = [formats.QTensor(w.data[e], w.scale[e], w.fmt, w.shape[1:]) for w in (w1, w3, w2)]
            gate = oracle_linear(x[n:n + 1], pick[0], wide).float().clamp_max(limit)
            up = oracle_linear(x[n:n + 1], pick[1], wide).float().clamp(-limit, limit)
            h = (F.silu(gate) * up * weights[n, j]).to(x.dtype)
            out[n] += oracle_linear(h, pick[2], wide).float()[0]
    return out


def test_moe_experts_int8_w_per_token_quantized(npu_emulation, rng):
    x, weights, idx, ws = _experts_inputs(rng)
    ws = [formats.quantize(w, "int8_w") for w in ws]
    got = ascend("moe_experts", x, weights, idx, *ws, 0.8)
    assert rel_err(got, oracle_experts(x, weights, idx, *ws, 0.8)) < 2e-2 and not fallbacks("moe_experts")
    c = npu_emulation.calls("npu_grouped_matmul")[-1]
    assert c["x"][0].dtype == torch.int8 and c["scale"][0].shape == (6, 64) and c["scale"][0].dtype == torch.bfloat16
    assert c["per_token_scale"][0].shape == (18,) and c["output_dtype"] == torch.bfloat16
    got32 = ascend("moe_experts", x.float(), weights, idx, *ws, 0.8)  # fp32 x: plain-torch fallback
    assert rel_err(got32, oracle_experts(x.float(), weights, idx, *ws, 0.8, wide=True)) < 1e-5
    assert fallbacks("moe_experts")


def test_moe_experts_shared_expert_second_grouped_matmul_route(npu_emulation, rng):
    """``shared``: the shared expert through the same operators as one expert with weight 1 (three
    more grouped matmuls), joined after the routed sum and before ``add``."""
    x, weights, idx, ws = _experts_inputs(rng)
    ws = [formats.quantize(w, "int8_w") for w in ws]
    _, _, _, sw = _experts_inputs(rng, E=1)
    shared = tuple(formats.quantize(w, "int8_w") for w in sw)
    add = torch.randn(x.shape[0], x.shape[1], generator=rng)
    got = ascend("moe_experts", x, weights, idx, *ws, 0.8, add, torch.bfloat16, shared)
    ones, first = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1, dtype=torch.int32)
    want = (oracle_experts(x, weights, idx, *ws, 0.8) + oracle_experts(x, ones, first, *shared, 0.8) + add)
    assert got.dtype == torch.bfloat16 and rel_err(got, want.bfloat16()) < 2e-2 and not fallbacks("moe_experts")
    assert len(npu_emulation.calls("npu_grouped_matmul")) == 6


def test_reference_backend_uses_int8_t_activations_for_int8_w(rng):
    x = torch.randn(3, 64, generator=rng).bfloat16()
    w = formats.quantize(torch.randn(16, 64, generator=rng), "int8_w")
    with flashrt.use_backend("reference"):
        got = flashrt.ops.linear(x, w)
    assert torch.equal(got, oracle_linear(x, w, wide=True))
