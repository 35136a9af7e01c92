"""moe_route on torch_npu.npu_moe_gating_top_k; moe_experts on torch_npu.npu_grouped_matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt import refmath as ref
from flashrt.formats import QTensor

from .npu_runtime import fallback, npu, npu_family
from .quant import HALF, linear_exact, quant_rows

GATING_MAX_EXPERTS = 2048  # npu_moe_gating_top_k: align32(E) * group_count <= 2048, E / group_count > 2
GMM_MAX_GROUPS = 1024  # npu_grouped_matmul: group_list up to 1024 entries


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
    _, idx, s = npu().npu_moe_gating_top_k(
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


def moe_experts_plan(x, weights, indices, w1, w3, w2, swiglu_limit) -> str | None:
    ws = (w1, w3, w2)
    if x.dtype not in HALF:
        return "npu_grouped_matmul returns fp16/bf16 (an fp32 x would be rounded)"
    if w1.shape[0] > GMM_MAX_GROUPS:
        return f"npu_grouped_matmul takes at most {GMM_MAX_GROUPS} groups"
    if all(isinstance(w, QTensor) and w.fmt == "int8_w" for w in ws):
        return None
    if all(not isinstance(w, QTensor) and w.dtype == x.dtype for w in ws):
        return None
    return "weights are not all int8_w or all plain in x.dtype (no FP8/FP4 matmul on the 910B)"


def grouped_matmul(x2: torch.Tensor, w, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x2 [M, in]`` grouped by expert (``counts [E]`` int64) times ``w [E, out, in]`` ->
    ``[M, out]`` in ``x2.dtype``: one ``npu_grouped_matmul`` call, weight passed transposed
    ``[E, in, out]`` (a view), ``group_type=0`` (groups along M), ``group_list_type=1`` (counts),
    ``split_item=3`` (one output tensor)."""
    kw = dict(group_list=counts, group_type=0, group_list_type=1, split_item=3, output_dtype=x2.dtype)
    if not isinstance(w, QTensor):
        return npu().npu_grouped_matmul([x2], [w.transpose(1, 2)], **kw)[0]
    xq, xs = quant_rows(x2)
    scale = w.scale.view(w.shape[0], w.shape[1])  # [E, out]: bf16 for a bf16 output, fp32 for fp16
    if x2.dtype == torch.float16:
        scale = scale.to(torch.float32)
    return npu().npu_grouped_matmul([xq], [w.data.transpose(1, 2)], scale=[scale], per_token_scale=[xs], **kw)[0]


def moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit):
    """``moe_experts`` -> three ``torch_npu.npu_grouped_matmul`` calls (W1, W3, W2).

    Layout: the ``N * k`` (token, slot) pairs are sorted by expert (stable), the token rows
    gathered into ``[N*k, D]`` and the per-expert counts passed as ``group_list``. Plain weights
    (dtype of x) use the non-quantized grouped matmul; ``int8_w`` weights use its per-token
    quantized mode: rows quantized with ``npu_dynamic_quant`` (``int8_t``), ``scale = w.scale
    [E, out]``, ``per_token_scale`` from the quantization: ``(xq @ wq) * scale * per_token_scale``
    from an exact int32 accumulation, i.e. docs/ops.md's per-projection ``linear``. Between the calls,
    in fp32: ``silu(min(gate, L)) * clamp(up, -L, L) * weight``, cast to ``x.dtype`` before W2 (the
    routing weight multiplies W2's input, before it is quantized), then ``index_add`` back per
    token in fp32. Falls back to plain torch for fp32 x (the operator returns fp16/bf16), for
    ``fp8_w``/``fp4_w`` or mixed weights, or more than 1024 experts.
    """
    why = moe_experts_plan(x, weights, indices, w1, w3, w2, swiglu_limit)
    if why:
        fallback("moe_experts", why)
        if any(isinstance(w, QTensor) and w.fmt == "int8_w" for w in (w1, w3, w2)):
            return _experts_torch(x, weights, indices, w1, w3, w2, swiglu_limit)
        return ref.moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit)
    N, k = indices.shape
    flat = indices.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    tok, slot = order // k, order % k
    counts = torch.bincount(flat, minlength=w1.shape[0])
    xs = x[tok]  # [N*k, D], grouped by expert
    h = ref.swiglu(grouped_matmul(xs, w1, counts), grouped_matmul(xs, w3, counts), weights[tok, slot], swiglu_limit)
    y = grouped_matmul(h.to(x.dtype), w2, counts)
    out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tok, y.to(torch.float32))


def _project(x, w, e: int) -> torch.Tensor:
    """Plain-torch ``linear(x, w[e])`` in ``x.dtype`` (int8_t activations for int8_w, as linear)."""
    if isinstance(w, QTensor):
        return linear_exact(x, QTensor(w.data[e], w.scale[e], w.fmt, w.shape[1:]))
    return F.linear(x.to(torch.float32), w[e].to(torch.float32)).to(x.dtype)


def _experts_torch(x, weights, indices, w1, w3, w2, swiglu_limit):
    """The reference loop over experts, decoding weights with byte ops (no float8 math on the NPU)."""
    return ref.experts_loop(x, weights, indices, w1, w3, w2, swiglu_limit, _project)


PLANS = {"moe_route": moe_route_plan, "moe_experts": moe_experts_plan}


FAMILY = npu_family("moe", {"moe_route": moe_route, "moe_experts": moe_experts},
                    "MoE gate (npu_moe_gating_top_k) and grouped expert GEMMs")
