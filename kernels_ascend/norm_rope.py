"""rms_norm and rope on torch_npu operators (npu_rms_norm, npu_rotary_mul); norm_rope_quantize as
those two and the quantize adapter in sequence."""
from __future__ import annotations

import torch

from flashrt import refmath as ref

from flashrt.conformance import note_route

from . import quant
from .npu_runtime import fallback, npu_family, operator

ROTARY_MAX_DIM = 896  # npu_rotary_mul: D < 896
ROTARY_MAX_BN = 1000  # interleave mode: B * N < 1000


def rms_norm_plan(x, weight, eps) -> str | None:
    """None when npu_rms_norm serves the call exactly, else why not."""
    if x.dim() == 0 or x.dim() > 8:
        return "npu_rms_norm takes 1-8 dims"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"npu_rms_norm has no {x.dtype}"
    if weight.dtype != x.dtype:
        return "npu_rms_norm needs gamma in x.dtype; casting the weight would round it"
    return None


def rms_norm(x, weight, eps):
    """``rms_norm`` -> ``torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]``.

    The operator computes ``x * rsqrt(mean(x**2) + eps) * gamma`` in fp32 and returns ``x.dtype``
    (its second output, the rstd, is dropped), as docs/ops.md does. Layout: ``x [..., N]`` as is
    (a 1-D x is viewed ``[1, N]``), ``gamma = weight [N]``. Falls back to plain torch when the
    weight's dtype differs from x's (the operator wants them equal and casting would round the
    weight) or x is float64.
    """
    why = rms_norm_plan(x, weight, eps)
    if why:
        fallback("rms_norm", why)
        return ref.rms_norm(x, weight, eps)
    x2 = x if x.dim() >= 2 else x.reshape(1, -1)
    return operator("rms_norm", "npu_rms_norm")(x2, weight, epsilon=float(eps))[0].reshape(x.shape)


def rope_plan(x, freqs_cis, inverse) -> str | None:
    heads = x.shape[2] if x.dim() == 4 else 1
    if x.shape[-1] >= ROTARY_MAX_DIM:
        return f"npu_rotary_mul needs D < {ROTARY_MAX_DIM}"
    if heads >= ROTARY_MAX_BN:
        return f"npu_rotary_mul interleave mode needs B * N < {ROTARY_MAX_BN}"
    return None


def _bsnd(x: torch.Tensor) -> torch.Tensor:
    """[S, R] / [B, S, R] / [B, S, H, R] -> [1, B*S, H, R] (BSND with one batch row)."""
    if x.dim() == 2:
        return x.reshape(1, x.shape[0], 1, x.shape[1])
    if x.dim() == 3:
        return x.reshape(1, x.shape[0] * x.shape[1], 1, x.shape[2])
    return x.reshape(1, x.shape[0] * x.shape[1], x.shape[2], x.shape[3])


def _coefficients(x, freqs_cis, inverse) -> tuple[torch.Tensor, torch.Tensor]:
    """r1 = (cos, cos), r2 = (sin, sin) per pair, fp32, laid out 1S1D = [1, B*S, 1, R]."""
    f = freqs_cis
    if f.dim() == 2 and x.dim() >= 3:  # shared positions: one table row per (b, s)
        f = f.unsqueeze(0).expand(x.shape[0], *f.shape)
    f = f.reshape(-1, f.shape[-1])  # [B*S, R/2]
    cos = f.real.repeat_interleave(2, -1)
    sin = f.imag.repeat_interleave(2, -1)
    if inverse:
        sin = -sin
    return cos.reshape(1, -1, 1, cos.shape[-1]), sin.reshape(1, -1, 1, sin.shape[-1])


def rope(x, freqs_cis, inverse):
    """``rope`` -> ``torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode="interleave")``.

    Interleave mode computes ``r1 * x + r2 * rot(x)`` with ``rot(x)[2i] = -x[2i+1]``,
    ``rot(x)[2i+1] = x[2i]``; with ``r1 = (cos, cos)`` and ``r2 = (sin, sin)`` per pair (``-sin``
    when ``inverse``) that is exactly the complex product of docs/ops.md on adjacent pairs (the
    half-split mode would need a permutation; interleave needs none). Layout: x is viewed BSND
    ``[1, B*S, H, R]`` in fp32 (so the math is fp32, as docs/ops.md says; cast back after) and r1/r2 are
    ``[1, B*S, 1, R]`` fp32 (1S1D, the one r layout interleave mode takes for BSND; a shared
    ``[S, R/2]`` table is expanded over the batch). Falls back when ``R >= 896`` or ``H >= 1000``.
    """
    why = rope_plan(x, freqs_cis, inverse)
    if why:
        fallback("rope", why)
        return ref.rope(x, freqs_cis, inverse)
    head = x.shape[-1] // 2 - freqs_cis.shape[-1]
    if head:  # a tail table: the head pairs get the factor 1 + 0i (r1 = 1, r2 = 0): copied (a -0.0 may come back +0.0)
        one = torch.ones(*freqs_cis.shape[:-1], head, dtype=freqs_cis.dtype, device=freqs_cis.device)
        freqs_cis = torch.cat([one, freqs_cis], dim=-1)
    r1, r2 = _coefficients(x, freqs_cis, inverse)
    x4 = _bsnd(x.to(torch.float32).contiguous())
    out = operator("rope", "npu_rotary_mul")(x4, r1, r2, rotary_mode="interleave")
    return out.reshape(x.shape).to(x.dtype)


def norm_rope_quantize(x, weight, eps, freqs_cis, fmt, dequantize_to=None):
    """``norm_rope_quantize``: :func:`rms_norm` (when ``weight``), :func:`rope`, then the quantize
    adapter (and the dequantize adapter for a fake quantization), each on its own route."""
    note_route("norm_rope_quantize", "rms_norm, rope" + (" and quantize" if fmt is not None else "") + " in sequence"
               + (", then dequantize" if dequantize_to is not None else ""))
    y = rms_norm(x, weight, eps) if weight is not None else x
    if fmt is None:
        return rope(y, freqs_cis, False)
    q = quant.quantize(rope(y, freqs_cis, False), fmt)
    return q if dequantize_to is None else quant.dequantize(q, dequantize_to)


PLANS = {"rms_norm": rms_norm_plan, "rope": rope_plan, "norm_rope_quantize": lambda *args: None}


FAMILY = npu_family("norm_rope", {"rms_norm": rms_norm, "rope": rope, "norm_rope_quantize": norm_rope_quantize},
                    "RMSNorm (npu_rms_norm), rotary embedding (npu_rotary_mul), and the two before a quantize")
