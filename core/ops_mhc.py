"""mHC ops of the contract (:mod:`flashrt.ops`): the hyper-connection mixing coefficients and the
collapse and expansion of the residual streams."""
from __future__ import annotations

import torch

from . import checks as c
from .checks import F32
from .dispatch import impl as _impl


def hc_coefficients(x, fn, scale, base, iters: int, eps: float, norm_eps: float):
    """mHC mixing coefficients -> ``(pre [B, S, hc], post [B, S, hc], comb [B, S, hc, hc])`` fp32.

    ``x [B, S, hc, D]`` float, ``fn [(2+hc)*hc, hc*D]`` fp32, ``scale [3]``, ``base [(2+hc)*hc]``.
    With ``v = flatten(x)`` in fp32 and ``m = (v @ fn.T) * rsqrt(mean(v**2) + norm_eps)``:
    ``pre = sigmoid(m[:hc] * scale[0] + base[:hc]) + eps``;
    ``post = 2 * sigmoid(m[hc:2hc] * scale[1] + base[hc:2hc])``;
    ``c = softmax((m[2hc:] * scale[2] + base[2hc:]).view(hc, hc), -1) + eps``,
    ``c = c / (c.sum(-2) + eps)``, then ``iters - 1`` times row- then column-normalised
    (``c / (c.sum(-1) + eps)``, ``c / (c.sum(-2) + eps)``); ``comb = c``.
    """
    env: dict = {}
    c.tensor("x", x, "B S hc D", env, c.FLOATS)
    hc, d = env["hc"], env["D"]
    env.update({"M": (2 + hc) * hc, "hcD": hc * d})
    c.tensor("fn", fn, "M hcD", env, F32, x.device)
    c.tensor("scale", scale, "3", env, F32, x.device)
    c.tensor("base", base, "M", env, F32, x.device)
    c.integer("iters", iters, 1)
    c.number("eps", eps, 0.0)
    c.number("norm_eps", norm_eps, 0.0)
    return _impl("hc_coefficients", x.device)(x, fn, scale, base, iters, eps, norm_eps)


def hc_collapse(x, pre) -> torch.Tensor:
    """``x [B, S, hc, D]``, ``pre [B, S, hc]`` fp32 -> ``[B, S, D]``: ``sum_k pre[k] * x[k]`` in
    fp32, cast to ``x.dtype``."""
    env: dict = {}
    c.tensor("x", x, "B S hc D", env, c.FLOATS)
    c.tensor("pre", pre, "B S hc", env, F32, x.device)
    return _impl("hc_collapse", x.device)(x, pre)


def hc_collapse_norm(x, pre, weight, eps: float) -> torch.Tensor:
    """``rms_norm(hc_collapse(x, pre), weight, eps)`` in one op: ``x [B, S, hc, D]``, ``pre [B, S, hc]``
    fp32, ``weight [D]`` -> ``[B, S, D]`` in ``x.dtype``. The collapse is rounded to ``x.dtype``
    before the norm reads it, as the two ops in sequence would."""
    env: dict = {}
    c.tensor("x", x, "B S hc D", env, c.FLOATS)
    c.tensor("pre", pre, "B S hc", env, F32, x.device)
    c.tensor("weight", weight, "D", env, c.FLOATS, x.device)
    c.number("eps", eps, 0.0)
    return _impl("hc_collapse_norm", x.device)(x, pre, weight, eps)


def hc_expand(y, residual, post, comb) -> torch.Tensor:
    """``y [B, S, D]``, ``residual [B, S, hc, D]``, ``post [B, S, hc]``, ``comb [B, S, hc, hc]``
    fp32 -> ``[B, S, hc, D]``: ``out[k] = post[k] * y + sum_j comb[j, k] * residual[j]`` in fp32,
    cast to ``y.dtype``."""
    env: dict = {}
    c.tensor("y", y, "B S D", env, c.FLOATS)
    c.tensor("residual", residual, "B S hc D", env, c.FLOATS, y.device)
    c.tensor("post", post, "B S hc", env, F32, y.device)
    c.tensor("comb", comb, "B S hc hc", env, F32, y.device)
    return _impl("hc_expand", y.device)(y, residual, post, comb)
