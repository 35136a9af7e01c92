"""Reference math of the MoE ops: ``moe_route`` (expert choice) and ``moe_experts`` (routed SwiGLU
experts), with the SwiGLU and per-expert loop that backend adapters reuse with their own
projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import formats
from .formats import QTensor
from .refmath_attention import top_order
from .refmath_linear import activation_format, dequantized_weight
from .refmath_wide import linear32, pointwise

_SCORE = {
    "softmax": lambda z: torch.softmax(z, -1),
    "sigmoid": lambda z: pointwise(torch.sigmoid, z),
    "sqrtsoftplus": lambda z: pointwise(F.softplus, z).sqrt(),
}


def moe_route(x, weight, bias, topk, score_func, norm_topk, route_scale):
    s = _SCORE[score_func](linear32(x, weight))
    indices = top_order(s if bias is None else s + bias, topk)
    w = s.gather(-1, indices)
    if norm_topk and topk > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * route_scale, indices.to(torch.int32)


def _project(x, w, e: int) -> torch.Tensor:
    """``linear(x, w[e])`` of a stacked [E, out, in] weight, in ``x.dtype``."""
    if isinstance(w, QTensor):  # fp8 activations, as linear() does for a quantized weight
        xq = formats.dequantize(formats.quantize(x, activation_format(w)))
        return linear32(xq, dequantized_weight(w)[e]).to(x.dtype)
    return linear32(x, w[e]).to(x.dtype)


def swiglu(gate, up, weight, limit: float) -> torch.Tensor:
    """fp32 ``silu(min(gate, L)) * clamp(up, -L, L) * weight`` (no clamp when ``L == 0``);
    ``weight`` [n] is the routing weight, applied before W2 as the published model does."""
    gate, up = gate.to(torch.float32), up.to(torch.float32)
    if limit > 0:
        gate, up = gate.clamp_max(limit), up.clamp(-limit, limit)
    return pointwise(F.silu, gate) * up * weight.unsqueeze(-1)


def experts_loop(x, weights, indices, w1, w3, w2, swiglu_limit, project=_project):
    """``moe_experts`` as a loop over the experts used, ``project(x, w, e)`` being ``linear(x, w[e])``
    in ``x.dtype`` (a backend passes its own, e.g. decoding weight bytes without float8 math)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(indices).tolist():
        tok, slot = torch.nonzero(indices == e, as_tuple=True)
        xe = x[tok]
        h = swiglu(project(xe, w1, e), project(xe, w3, e), weights[tok, slot], swiglu_limit)
        out.index_add_(0, tok, project(h.to(x.dtype), w2, e).to(torch.float32))
    return out


def moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit, add=None, out_dtype=torch.float32, shared=None):
    out = with_shared(experts_loop(x, weights, indices, w1, w3, w2, swiglu_limit), x, shared, swiglu_limit)
    return finish_experts(out, add, out_dtype)


def with_shared(out: torch.Tensor, x, shared, swiglu_limit, experts=experts_loop) -> torch.Tensor:
    """The fp32 routed sum ``out`` plus the ``shared`` expert ((w1, w3, w2) of one expert, or None)
    over every token with weight 1; ``experts``: the backend's fp32 experts sum (``experts_loop``'s
    signature)."""
    if shared is None:
        return out
    n = x.shape[0]
    ones = torch.ones(n, 1, dtype=torch.float32, device=x.device)
    first = torch.zeros(n, 1, dtype=torch.int32, device=x.device)
    return out + experts(x, ones, first, *shared, swiglu_limit)


def finish_experts(out: torch.Tensor, add, out_dtype) -> torch.Tensor:
    """``moe_experts``' fp32 sum ``out`` plus ``add`` (fp32 or None), cast to ``out_dtype``."""
    if add is not None:
        out = out + add
    return out.to(out_dtype)
