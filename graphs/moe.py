"""MoE FFN: routed experts chosen by the gate (the bias picks, it does not scale) + a shared expert.

With a :class:`~flashrt.graphs.parallel.Parallel` context a rank holds only its (whole) experts:
each (token, expert) pair runs on the rank holding the expert and the outputs come back to the
group that owns the token (gathered and reduce-scattered, or sent both ways all-to-all:
:mod:`flashrt.graphs.ep_dispatch`); the shared expert runs on one rank of each group (docs/parallel.md).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from flashrt import ops, profiles
from flashrt.formats import QTensor, as_expert_stack


def stack_experts(weights: list) -> torch.Tensor | QTensor:
    """Per-expert [out, in] weights (plain or QTensor) -> one [E, out, in] tensor or QTensor, its
    scales laid out as the active profile's ``expert_scales`` says (row or K major); fp4_w ones with
    their largest scale byte recorded (``scale_max``: the packed decode folds its re-bias into scales
    up to 128)."""
    if isinstance(weights[0], QTensor):
        first = weights[0]
        stacked = QTensor(torch.stack([w.data for w in weights]), torch.stack([w.scale for w in weights]),
                          first.fmt, (len(weights), *first.shape))
        profile = profiles.active_profile()
        return as_expert_stack(stacked, profile.expert_scales == "k_major", profile.expert_fp4 == "words")
    return torch.stack(weights)


def expert_view(stacked: torch.Tensor | QTensor, e: int) -> torch.Tensor | QTensor:
    """Expert ``e`` of a stacked [E, out, in] weight, as a view (no copy)."""
    if isinstance(stacked, QTensor):
        return replace(stacked, data=stacked.data[e], scale=stacked.scale[e], shape=tuple(stacked.shape[1:]))
    return stacked[e]


def stack_in_place(w: dict, names: list[str]) -> torch.Tensor | QTensor:
    """Stack the weights ``w[names]`` and rebind each name to its view of the stack, so the model
    holds one copy of the expert weights (the per-expert tensors are freed unless the caller keeps
    other references to them)."""
    stacked = stack_experts([w[n] for n in names])
    for e, n in enumerate(names):
        w[n] = expert_view(stacked, e)
    return stacked


class MoE:
    def __init__(self, cfg, layer: int, w: dict, prefix: str, parallel=None):
        p = prefix + "ffn."
        self.cfg, self.par = cfg, parallel
        n_routed, self.topk = cfg.n_experts(layer)
        self.n_routed = n_routed
        self.first, last = (0, n_routed) if parallel is None else parallel.layout.experts(n_routed)
        gate = w[p + "gate.weight"]
        self.gate = gate if cfg.gate_temp == 1.0 else (gate.to(torch.float32) / cfg.gate_temp)
        self.bias = w[p + "gate.bias"]
        self.bias_vl = w.get(p + "gate.bias_vl")  # models with a vision tower: image-span tokens' bias
        self.w1, self.w2, self.w3 = (
            stack_in_place(w, [f"{p}experts.{e}.{name}.weight" for e in range(self.first, last)])
            for name in ("w1", "w2", "w3"))
        self.shared = None
        if cfg.n_shared_experts and (parallel is None or parallel.layout.holds_shared(layer)):
            self.shared = tuple(stack_in_place(w, [f"{p}shared_experts.{name}.weight"]) for name in ("w1", "w3", "w2"))

    def forward(self, h: torch.Tensor, shared_route: tuple | None = None,
                vl_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``shared_route``: :class:`SharedRoutes` of the call's tokens (the expert-parallel path's
        shared expert; made there when None).
        ``vl_mask`` (bool, ``h.shape[:-1]``): tokens inside image spans, whose experts ``bias_vl``
        picks instead of ``bias`` (the weights come from the same unbiased scores)."""
        cfg = self.cfg
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        vl = vl_mask.reshape(-1) if vl_mask is not None and self.bias_vl is not None else None
        if self.par is not None:
            return self._forward_parallel(x, shared_route, vl).to(h.dtype).view(shape)
        weights, indices = self.routes(x, vl)
        # the routed experts and the shared one in one op, summed and cast to h's dtype inside it
        y = ops.moe_experts(x, weights, indices, self.w1, self.w3, self.w2, cfg.swiglu_limit, out_dtype=h.dtype,
                            shared=self.shared)
        return y.view(shape)

    def route(self, x: torch.Tensor, bias: torch.Tensor):
        """``moe_route`` of tokens ``x`` [N, dim] with the selection bias ``bias``."""
        cfg = self.cfg
        return ops.moe_route(x, self.gate, bias, self.topk, cfg.score_func, cfg.norm_topk_prob, cfg.route_scale)

    def routes(self, x: torch.Tensor, vl: torch.Tensor | None = None):
        """``moe_route`` of tokens ``x`` [N, dim]; rows where ``vl`` [N] (bool) is True (image spans)
        pick their experts with ``bias_vl`` (the weights come from the same unbiased scores)."""
        weights, indices = self.route(x, self.bias)
        if vl is not None and self.bias_vl is not None:
            inside = vl.reshape(-1, 1)
            w_vl, i_vl = self.route(x, self.bias_vl)
            weights, indices = torch.where(inside, w_vl, weights), torch.where(inside, i_vl, indices)
        return weights, indices

    def _forward_parallel(self, x: torch.Tensor, shared_route: tuple | None = None,
                          vl: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [N, D]: every rank's experts over this group's tokens (graphs/ep_dispatch.py), the
        shared expert where this rank holds it, summed over the tensor-parallel group. ``vl`` [N]
        bool: the tokens inside image spans (routed with ``bias_vl``)."""
        from .ep_dispatch import DISPATCH, routed_static

        own = (routed_static if self.par.static or _capturing(x) else DISPATCH[self.par.dispatch])(self, x, vl)
        if self.shared is not None and x.shape[0]:
            ones, first = shared_route if shared_route is not None else SharedRoutes.make(x.shape[0], x.device)
            own[: x.shape[0]] += ops.moe_experts(x, ones, first, *self.shared, self.cfg.swiglu_limit)
        return self.par.tp_all_reduce(own)[: x.shape[0]]


def _capturing(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SharedRoutes:
    """The shared expert's routes (weight 1.0, expert 0) for ``n`` tokens: made once per token count
    and device and reused by every layer and call (two fills fewer per layer and step), never kept
    from inside a CUDA-graph capture (a capture records the fill without running it)."""

    LIMIT = 64  # prefill chunks of many lengths: keep the set small

    def __init__(self):
        self._routes: dict = {}

    @staticmethod
    def make(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.ones(n, 1, dtype=torch.float32, device=device),
                torch.zeros(n, 1, dtype=torch.int32, device=device))

    def __call__(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        hit = self._routes.get((n, device))
        if hit is None:
            hit = self.make(n, device)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                if len(self._routes) >= self.LIMIT:
                    self._routes.clear()
                self._routes[(n, device)] = hit
        return hit
