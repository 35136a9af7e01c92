"""MoE ops of the contract (:mod:`flashrt.ops`): expert routing and the routed SwiGLU experts."""
from __future__ import annotations

import torch

from . import checks as c
from .checks import F32, I32, SCORE_FUNCS, WEIGHT_FORMATS
from .dispatch import impl as _impl
from .formats import QTensor


def moe_route(x, weight, bias, topk: int, score_func: str, norm_topk: bool, route_scale: float):
    """Expert choice: ``x [N, D]``, ``weight [E, D]``, ``bias [E]`` fp32 or None ->
    ``(weights fp32 [N, topk], indices int32 [N, topk])``.

    ``s = f(x @ weight.T)`` in fp32, ``f`` softmax / sigmoid / sqrtsoftplus (``sqrt(softplus)``);
    ``indices = topk(s + bias)`` (the bias picks, it does not scale; ties to the lower expert);
    ``weights = s[indices]``, divided by their sum (+1e-20) when ``norm_topk`` and ``topk > 1``,
    times ``route_scale``.
    """
    env: dict = {}
    c.tensor("x", x, "N D", env, c.FLOATS)
    c.tensor("weight", weight, "E D", env, c.FLOATS, x.device)
    if bias is not None:
        c.tensor("bias", bias, "E", env, F32, x.device)
    c.integer("topk", topk, 1, env["E"])
    c.choice("score_func", score_func, SCORE_FUNCS)
    c.number("route_scale", route_scale)
    return _impl("moe_route", x.device)(x, weight, bias, topk, score_func, bool(norm_topk), float(route_scale))


def moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit: float, add=None,
                out_dtype: torch.dtype = torch.float32, shared: tuple | None = None) -> torch.Tensor:
    """Routed SwiGLU experts: ``x [N, D]``, ``weights [N, k]`` fp32, ``indices [N, k]`` int32 in
    ``[0, E)``, ``w1, w3 [E, I, D]``, ``w2 [E, D, I]`` plain or ``QTensor`` (``fp4_w``/``fp8_w``)
    -> ``[N, D]`` in ``out_dtype`` (fp32 by default).

    ``out = sum_e W2_e(weights_e * silu(min(W1_e x, L)) * clamp(W3_e x, -L, L))`` in fp32 with
    ``L = swiglu_limit`` (no clamp when 0). Each projection is an :func:`linear` (so quantized
    weights see fp8-quantized inputs); the routing weight multiplies W2's input before it is
    quantized, as the published model does. ``add`` (fp32 ``[N, D]`` or None, e.g. the shared
    expert's output) is added to the fp32 sum; the result is then cast to ``out_dtype``.

    ``shared`` (``(w1, w3, w2)`` of one expert, ``[1, I, D]`` / ``[1, D, I]``, plain or quantized,
    formats free of the routed ones' or None): an expert every token also takes with weight 1 (the
    model's shared expert); its output joins the fp32 sum after the k slots and before ``add``.
    """
    env: dict = {}
    c.tensor("x", x, "N D", env, c.FLOATS)
    c.tensor("weights", weights, "N k", env, F32, x.device)
    c.tensor("indices", indices, "N k", env, I32, x.device)
    for name, w, spec in (("w1", w1, "E I D"), ("w3", w3, "E I D"), ("w2", w2, "E D I")):
        c.maybe_quantized(name, w, spec, env, WEIGHT_FORMATS, x.device)
        if isinstance(w, QTensor) and w.shape[-1] % 32:  # its input is fp8-quantized, as in linear
            raise ValueError(f"{name}: a quantized weight needs its input dim % 32 == 0 (fp8 activations), "
                             f"got shape {tuple(w.shape)}")
    if shared is not None:
        _check_shared(shared, env, x.device)
    c.number("swiglu_limit", swiglu_limit, 0.0)
    if add is not None:
        c.tensor("add", add, "N D", env, F32, x.device)
    c.choice("out_dtype", out_dtype, c.FLOATS)
    c.index_range("indices", indices, 0, env["E"])
    tail = () if shared is None else (tuple(shared),)  # backends see a 10th argument only when given
    return _impl("moe_experts", x.device)(x, weights, indices, w1, w3, w2, float(swiglu_limit), add, out_dtype, *tail)


def _check_shared(shared, env: dict, device) -> None:
    """``shared``: (w1, w3, w2) of one expert with the routed experts' I and D."""
    if not isinstance(shared, (tuple, list)) or len(shared) != 3:
        raise ValueError(f"shared: expected (w1, w3, w2) of one expert or None, got {type(shared).__name__}"
                         + (f" of length {len(shared)}" if isinstance(shared, (tuple, list)) else ""))
    dims = {"I": env["I"], "D": env["D"]}
    for name, w, spec in (("shared[0] (w1)", shared[0], "1 I D"), ("shared[1] (w3)", shared[1], "1 I D"),
                          ("shared[2] (w2)", shared[2], "1 D I")):
        c.maybe_quantized(name, w, spec, dims, WEIGHT_FORMATS, device)
        if isinstance(w, QTensor) and w.shape[-1] % 32:
            raise ValueError(f"{name}: a quantized weight needs its input dim % 32 == 0 (fp8 activations), "
                             f"got shape {tuple(w.shape)}")
