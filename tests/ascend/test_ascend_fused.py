"""The fused torch_npu operators of the Ascend backend, through the emulated torch_npu: MoE dispatch /
activation / combine, row gathers, the declined operators and the conformance routes.

Each op runs on ``use_backend("ascend")`` and on the reference with fresh random inputs; the
recorded operator calls show the argument mapping, the noted routes what served each call.
"""
import pytest
import torch

import flashrt
from flashrt import conformance, formats

from ascend_helpers import fallbacks, npu_emulation, run_both  # noqa: F401
from kernel_check import rel_err


def _experts(rng, N=11, D=64, I=32, E=6, k=3, dtype=torch.bfloat16, fmt=None):
    x = torch.randn(N, D, generator=rng).to(dtype)
    weights = torch.rand(N, k, generator=rng)
    idx = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(N)]).to(torch.int32)
    idx[: N // 2, 0] = 2  # a crowded expert: its rows come from many tokens
    ws = [torch.randn(E, I, D, generator=rng) * 0.2, torch.randn(E, I, D, generator=rng) * 0.2,
          torch.randn(E, D, I, generator=rng) * 0.2]
    ws = [formats.quantize(w, fmt) if fmt else w.to(dtype) for w in ws]
    return x, weights, idx, ws


def noted(op, *args):
    with flashrt.use_backend("ascend"):
        return conformance.run_noted(op, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("limit", [0.8, 0.0])
def test_moe_experts_dispatch_activation_combine(npu_emulation, rng, dtype, limit):
    x, weights, idx, ws = _experts(rng, dtype=dtype)
    N, k = idx.shape
    got, routes = noted("moe_experts", x, weights, idx, *ws, limit)
    with flashrt.use_backend("reference"):
        want = flashrt.ops.moe_experts(x, weights, idx, *ws, limit)
    assert got.dtype == torch.float32 and rel_err(got, want) < 2e-2 and not fallbacks("moe_experts")
    init = npu_emulation.CALLS[[c.name for c in npu_emulation.CALLS].index("npu_moe_init_routing_v2")]
    assert init.positional[1] is idx and init.keywords == dict(
        active_num=N * k, expert_num=6, expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1,
        active_expert_range=[0, 6], row_idx_type=0)
    expanded, row_idx, counts, _ = init.result
    gmm = npu_emulation.calls("npu_grouped_matmul")
    assert len(gmm) == 3 and gmm[0]["x"][0] is expanded and all(c["group_list"] is counts for c in gmm)
    fin = npu_emulation.calls("npu_moe_finalize_routing")[-1]
    assert fin["expanded_src_to_dst_row"] is row_idx and fin["scales"] is None and fin["skip1"] is None
    assert fin["drop_pad_mode"] == 2 and fin["k"] == k and fin["expanded_permuted_rows"].dtype == torch.float32
    swiglu = npu_emulation.calls("npu_clipped_swiglu")
    if limit:
        s = swiglu[-1]
        assert (s["alpha"], s["bias"], s["limit"], s["interleaved"], s["dim"]) == (1.0, 0.0, limit, False, -1)
        assert s["x"].dtype == torch.float32 and tuple(s["x"].shape) == (N * k, 64)
        assert routes == ["npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_clipped_swiglu", "npu_moe_finalize_routing"]
    else:  # no clamp: the operator always clamps, so the activation runs in plain torch
        assert not swiglu and any(r.startswith("not npu_clipped_swiglu: swiglu_limit 0") for r in routes)


def test_moe_experts_int8_w_quantizes_the_dispatched_rows_once(npu_emulation, rng):
    x, weights, idx, ws = _experts(rng, fmt="int8_w")
    got, routes = noted("moe_experts", x, weights, idx, *ws, 0.8)
    with flashrt.use_backend("reference"):
        want = flashrt.ops.moe_experts(x, weights, idx, *ws, 0.8)
    assert rel_err(got, want) < 2e-2
    quants, gmm = npu_emulation.calls("npu_dynamic_quant"), npu_emulation.calls("npu_grouped_matmul")
    assert len(quants) == 2 and gmm[0]["x"][0] is gmm[1]["x"][0] and gmm[0]["x"][0].dtype == torch.int8
    expanded = next(c for c in npu_emulation.CALLS if c.name == "npu_moe_init_routing_v2").result[0]
    assert quants[0]["input"] is expanded  # the dispatched rows, quantized once for W1 and W3
    assert any(r.startswith("not npu_grouped_matmul_swiglu_quant_v2: its SwiGLU has no clamp") for r in routes)


def test_moe_experts_without_tokens_falls_back(npu_emulation, rng):
    x, weights, idx, ws = _experts(rng)
    got, want = run_both("moe_experts", x[:0], weights[:0], idx[:0], *ws, 0.8)
    assert got.shape == (0, 64) and torch.equal(got, want) and fallbacks("moe_experts") == ["no tokens"]


def test_engram_lookup_gathers_table_bytes(npu_emulation, rng):
    table = formats.quantize(torch.randn(50, 64, generator=rng) * 3, "fp8")
    ids = torch.randint(0, 50, (2, 3, 5), generator=rng)
    got, want = run_both("engram_lookup", table, ids)
    assert torch.equal(got, want)
    data, scale = npu_emulation.calls("npu_gather_sparse_index")
    assert data["input"].dtype == torch.uint8 and data["input"].data_ptr() == table.data.data_ptr()
    assert torch.equal(data["index"], ids.reshape(-1)) and scale["input"].dtype == torch.uint8


def test_sparse_attention_gathers_rows_per_batch_and_from_shared_segments(npu_emulation, rng):
    B, S, H, K = 2, 3, 4, 6
    q = torch.randn(B, S, H, 512, generator=rng).bfloat16()
    own = torch.randn(B, 10, 512, generator=rng).bfloat16()  # one row block per sequence
    shared = formats.quantize(torch.randn(1, 20, 512, generator=rng), "fp4_b16")  # batch 1: every row
    idx = torch.randint(-1, 30, (B, S, K), generator=rng, dtype=torch.int32)
    got, want = run_both("sparse_attention", q, (own, shared), idx, torch.randn(H, generator=rng), 0.06)
    assert rel_err(got, want) < 1e-2 and not fallbacks("sparse_attention")
    gathers = npu_emulation.calls("npu_gather_sparse_index")
    rows = idx.clamp_min(0).long()
    assert torch.equal(gathers[0]["index"], rows.clamp(0, 9) + torch.tensor([0, 10]).view(B, 1, 1))
    assert tuple(gathers[0]["input"].shape) == (B * 10, 512)
    assert torch.equal(gathers[1]["index"], (rows - 10).clamp(0, 19)) and gathers[1]["input"].dtype == torch.uint8


def test_conformance_report_on_the_emulation_lists_each_route(npu_emulation):
    with flashrt.use_backend("ascend"):
        report = conformance.run("cpu", seed=int(torch.randint(0, 2**30, (1,))))
    assert report["passed"] == report["total"] and all(r["backend"] == "ascend" for r in report["rows"])
    assert all(r["route"] for r in report["rows"]), [r["op"] for r in report["rows"] if not r["route"]]
    routes = {}
    for r in report["rows"]:
        routes.setdefault(r["op"], []).append(r["route"])
    assert ["npu_rms_norm"] in routes["rms_norm"] and ["npu_rotary_mul"] in routes["rope"]
    assert ["npu_dynamic_quant", "npu_quant_matmul"] in routes["linear"]
    assert ["npu_moe_gating_top_k"] in routes["moe_route"] and ["npu_gather_sparse_index"] in routes["engram_lookup"]
    assert any({"npu_moe_init_routing_v2", "npu_clipped_swiglu", "npu_moe_finalize_routing"} <= set(r)
               for r in routes["moe_experts"])
    assert all("Ascend 950 only" in r[0] for op in ("hc_coefficients", "hc_collapse", "hc_expand") for r in routes[op])
    assert routes["index_scores"][0][0].startswith("plain torch: npu_lightning_indexer / npu_quant_lightning_indexer")
    assert any(x.startswith("not npu_kv_quant_sparse_flash_attention") for r in routes["sparse_attention"] for x in r)
    assert routes["gather_cold_rows"][0][0].startswith("plain torch: the pages are in host memory")


def test_norm_rope_without_quantization_on_npu_operators(npu_emulation, rng):
    """``norm_rope_quantize`` with no ``fmt`` (the attention's query heads): npu_rms_norm then
    npu_rotary_mul, no quantize call, the reference's values."""
    B, S, H, D, P = 2, 3, 4, 64, 8
    x = (torch.randn(B, S, H, D, generator=rng) * 3).to(torch.bfloat16)
    f = torch.polar(torch.ones(B, S, P), torch.rand(B, S, P, generator=rng) * 6.3)
    got, want = run_both("norm_rope_quantize", x, torch.ones(D, dtype=torch.bfloat16), 1e-6, f, None)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert rel_err(got, want) < 1e-2
    names = [c.name for c in npu_emulation.CALLS]
    assert "npu_rms_norm" in names and "npu_rotary_mul" in names
    assert not any("quant" in n for n in names)
