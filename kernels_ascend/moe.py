"""moe_route on torch_npu.npu_moe_gating_top_k; moe_experts on npu_moe_init_routing_v2 (dispatch),
npu_grouped_matmul (expert GEMMs), npu_clipped_swiglu (activation) and npu_moe_finalize_routing
(combine)."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from flashrt import refmath as ref
from flashrt.refmath_moe import experts_loop, finish_experts, with_shared
from flashrt.refmath_wide import linear32
from flashrt.formats import QTensor

from .npu_runtime import declined, fallback, npu_family, operator
from .quant import HALF, linear_exact, quant_rows

GATING_MAX_EXPERTS = 2048  # npu_moe_gating_top_k: align32(E) * group_count <= 2048, E / group_count > 2
GMM_MAX_GROUPS = 1024  # npu_grouped_matmul: group_list up to 1024 entries
SWIGLU_QUANT = "npu_grouped_matmul_swiglu_quant_v2"
SWIGLU_QUANT_WHY = ("its SwiGLU has no clamp limit and it quantizes the fp32 product itself; moe_experts clamps at "
                    "swiglu_limit, multiplies by the routing weight and rounds to x.dtype before W2 quantizes")


def moe_route_plan(x, weight, bias, topk, score_func, norm_topk, route_scale) -> str | None:
    E = weight.shape[0]
    if score_func not in ("softmax", "sigmoid"):
        return f"npu_moe_gating_top_k scores with softmax or sigmoid only, not {score_func}"
    if score_func == "softmax" and bias is not None:
        return "npu_moe_gating_top_k documents its selection bias for sigmoid scoring only"
    if E <= 2 or -(-E // 32) * 32 > GATING_MAX_EXPERTS:
        return f"npu_moe_gating_top_k needs 2 < E and align32(E) <= {GATING_MAX_EXPERTS}, got E={E}"
    return None


def _canonical_order(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Reorder each row of ``idx [N, k]`` by value descending, ties to the lower index (k x k ranks)."""
    v_i, v_j = values.unsqueeze(-1), values.unsqueeze(-2)
    before = (v_j > v_i) | ((v_j == v_i) & (idx.unsqueeze(-2) < idx.unsqueeze(-1)))  # [N, i, j]: j goes first
    rank = before.sum(-1)
    return torch.empty_like(idx).scatter_(-1, rank, idx)


def moe_route(x, weight, bias, topk, score_func, norm_topk, route_scale):
    """``moe_route`` -> ``torch_npu.npu_moe_gating_top_k(logits, topk, bias=bias, k_group=1,
    group_count=1, renorm=0, norm_type=1 (sigmoid) / 0 (softmax), out_flag=True)``.

    Layout: ``logits = x @ weight.T`` in fp32 (plain torch, ``[N, E]``) is the operator's ``x``; one
    group (no group-limited routing). From its outputs only ``expertIdxOut`` and ``normOut`` (the
    fp32 scores ``s``) are used; the weights are ``s[indices]`` renormalised and scaled here, as
    docs/ops.md says. The operator documents no tie rule, so the result is made exact: the k picks are
    ordered by score descending, ties to the lower expert (a k x k rank), and a tie at the k-th
    place (an unpicked expert scoring like the last pick) falls back to plain torch for the call
    (one host sync). Falls back for ``sqrtsoftplus`` scoring, softmax with a bias, ``E <= 2`` or
    ``align32(E) > 2048``.
    """
    why = moe_route_plan(x, weight, bias, topk, score_func, norm_topk, route_scale)
    if why:
        fallback("moe_route", why)
        return ref.moe_route(x, weight, bias, topk, score_func, norm_topk, route_scale)
    logits = F.linear(x.to(torch.float32), weight.to(torch.float32))
    _, idx, s = operator("moe_route", "npu_moe_gating_top_k")(
        logits, topk, bias=bias, k_group=1, group_count=1, group_select_mode=0, renorm=0,
        norm_type=1 if score_func == "sigmoid" else 0, out_flag=True, routed_scaling_factor=1.0, eps=1e-20)
    key = s if bias is None else s + bias
    picked = key.gather(-1, idx.long())
    if bool(((key >= picked.amin(-1, keepdim=True)).sum(-1) > topk).any()):
        fallback("moe_route", "a tie at the k-th place (the operator's choice among equals is undocumented)")
        return ref.moe_route(x, weight, bias, topk, score_func, norm_topk, route_scale)
    idx = _canonical_order(picked, idx.long())
    w = s.gather(-1, idx)
    if norm_topk and topk > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * route_scale, idx.to(torch.int32)


def moe_experts_plan(x, weights, indices, w1, w3, w2, swiglu_limit, add=None, out_dtype=None,
                     shared=None) -> str | None:
    ws = (w1, w3, w2)
    if x.dtype not in HALF:
        return "npu_grouped_matmul returns fp16/bf16 (an fp32 x would be rounded)"
    if w1.shape[0] > GMM_MAX_GROUPS:
        return f"npu_grouped_matmul takes at most {GMM_MAX_GROUPS} groups"
    if x.shape[0] == 0:
        return "no tokens"
    if all(isinstance(w, QTensor) and w.fmt == "int8_w" for w in ws):
        return None
    if all(not isinstance(w, QTensor) and w.dtype == x.dtype for w in ws):
        return None
    return "weights are not all int8_w or all plain in x.dtype (no FP8/FP4 matmul on the 910B)"


def grouped_matmul(x2: torch.Tensor, w, counts: torch.Tensor, quantized=None) -> torch.Tensor:
    """Rows of ``x2 [M, in]`` grouped by expert (``counts [E]`` int64) times ``w [E, out, in]`` ->
    ``[M, out]`` in ``x2.dtype``: one ``npu_grouped_matmul`` call, weight passed transposed
    ``[E, in, out]`` (a view), ``group_type=0`` (groups along M), ``group_list_type=1`` (counts),
    ``split_item=3`` (one output tensor). ``quantized``: ``x2``'s int8_t rows and scales, when already made."""
    gmm = operator("moe_experts", "npu_grouped_matmul")
    kw = dict(group_list=counts, group_type=0, group_list_type=1, split_item=3, output_dtype=x2.dtype)
    if not isinstance(w, QTensor):
        return gmm([x2], [w.transpose(1, 2)], **kw)[0]
    xq, xs = quantized if quantized is not None else quant_rows("moe_experts", x2)
    scale = w.scale.view(w.shape[0], w.shape[1])  # [E, out]: bf16 for a bf16 output, fp32 for fp16
    if x2.dtype == torch.float16:
        scale = scale.to(torch.float32)
    return gmm([xq], [w.data.transpose(1, 2)], scale=[scale], per_token_scale=[xs], **kw)[0]


def _swiglu(gate, up, w_rows, limit):
    """fp32 ``silu(min(gate, L)) * clamp(up, -L, L) * w_rows``: ``npu_clipped_swiglu`` on
    ``[gate | up]`` (front/back halves, alpha 1 so ``A * sigmoid(A)`` is silu, bias 0), then the
    routing weight; ``L == 0`` (no clamp) in plain torch, as the operator always clamps."""
    if limit == 0:
        declined("moe_experts", "npu_clipped_swiglu", "swiglu_limit 0 means no clamp; the operator always clamps")
        return ref.swiglu(gate, up, w_rows, limit)
    both = torch.cat((gate, up), -1).to(torch.float32)
    act = operator("moe_experts", "npu_clipped_swiglu")(both, dim=-1, alpha=1.0, limit=float(limit), bias=0.0,
                                                        interleaved=False)
    return act * w_rows.unsqueeze(-1)


def moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit, add=None, out_dtype=torch.float32, shared=None):
    """``moe_experts``: :func:`_experts` (the fp32 sum), plus the ``shared`` expert by a second
    :func:`_experts` (one expert, every token's weight 1; its own weights' route), then ``add`` and
    the cast to ``out_dtype`` in torch."""
    out = with_shared(_experts(x, weights, indices, w1, w3, w2, swiglu_limit), x, shared, swiglu_limit, _experts)
    return finish_experts(out, add, out_dtype)


def _experts(x, weights, indices, w1, w3, w2, swiglu_limit):
    """``moe_experts``' fp32 sum -> ``npu_moe_init_routing_v2`` + ``npu_grouped_matmul`` (W1, W3, W2) +
    ``npu_clipped_swiglu`` + ``npu_moe_finalize_routing``.

    Dispatch: ``npu_moe_init_routing_v2(x, indices, expert_num=E, active_num=N*k,
    expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, E],
    row_idx_type=0)`` sorts the ``N * k`` (token, slot) pairs by expert (stably, row-major source
    index ``n * k + j``), gathers the token rows ``[N*k, D]`` and counts per expert
    (``group_list``); its ``expanded_row_idx`` maps each source pair to its row. Plain weights (dtype
    of x) use the non-quantized grouped matmul; ``int8_w`` weights its per-token quantized mode: the
    rows quantized once with ``npu_dynamic_quant`` (``int8_t``) for W1 and W3, ``scale = w.scale
    [E, out]``, ``per_token_scale`` from the quantization, i.e. docs/ops.md's per-projection
    ``linear`` from an exact int32 accumulation. Activation in fp32 (:func:`_swiglu`), times the
    routing weight of each row, cast to ``x.dtype`` before W2 (the routing weight multiplies W2's
    input, before it is quantized). Combine: ``npu_moe_finalize_routing(y in fp32, scales=None,
    k=k, drop_pad_mode=2)`` (row-major source index, no scale: the weights were applied before W2)
    sums each token's k rows in fp32. ``npu_grouped_matmul_swiglu_quant_v2`` is not used (see
    ``SWIGLU_QUANT_WHY``). Falls back to plain torch for fp32 x (the operator returns fp16/bf16),
    for ``fp8_w``/``fp4_w`` or mixed weights, more than 1024 experts, or no tokens.
    """
    why = moe_experts_plan(x, weights, indices, w1, w3, w2, swiglu_limit)
    if why:
        fallback("moe_experts", why)
        if any(isinstance(w, QTensor) and w.fmt == "int8_w" for w in (w1, w3, w2)):
            return _experts_torch(x, weights, indices, w1, w3, w2, swiglu_limit)
        return ref.moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit)
    (N, k), E = indices.shape, w1.shape[0]
    xs, row_idx, counts, _ = operator("moe_experts", "npu_moe_init_routing_v2")(
        x, indices, active_num=N * k, expert_num=E, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        quant_mode=-1, active_expert_range=[0, E], row_idx_type=0)
    src = torch.empty_like(row_idx, dtype=torch.long).scatter_(0, row_idx.long(), torch.arange(N * k, device=x.device))
    xq = None
    if isinstance(w1, QTensor):
        declined("moe_experts", SWIGLU_QUANT, SWIGLU_QUANT_WHY)
        xq = quant_rows("moe_experts", xs)
    h = _swiglu(grouped_matmul(xs, w1, counts, xq), grouped_matmul(xs, w3, counts, xq),
                weights.reshape(-1)[src], swiglu_limit)
    y = grouped_matmul(h.to(x.dtype), w2, counts)
    return operator("moe_experts", "npu_moe_finalize_routing")(
        y.to(torch.float32), skip1=None, skip2=None, bias=None, scales=None, expanded_src_to_dst_row=row_idx,
        export_for_source_row=None, drop_pad_mode=2, k=k)


def _project(x, w, e: int) -> torch.Tensor:
    """Plain-torch ``linear(x, w[e])`` in ``x.dtype`` (int8_t activations for int8_w, as linear), row by
    row as the reference computes it."""
    if isinstance(w, QTensor):
        return linear_exact(x, replace(w, data=w.data[e], scale=w.scale[e], shape=w.shape[1:]))
    return linear32(x, w[e]).to(x.dtype)


def _experts_torch(x, weights, indices, w1, w3, w2, swiglu_limit):
    """The reference loop over experts, decoding weights with byte ops (no float8 math on the NPU)."""
    return experts_loop(x, weights, indices, w1, w3, w2, swiglu_limit, _project)


PLANS = {"moe_route": moe_route_plan, "moe_experts": moe_experts_plan}


FAMILY = npu_family("moe", {"moe_route": moe_route, "moe_experts": moe_experts},
                    "MoE gate (npu_moe_gating_top_k) and experts (npu_moe_init_routing_v2, npu_grouped_matmul, "
                    "npu_clipped_swiglu, npu_moe_finalize_routing)")
