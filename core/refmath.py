"""The semantics of record: every op of the contract (:mod:`flashrt.ops`) in plain torch, on any device.

The reference backend (``flashrt.backends.reference``) binds these functions as its ops; backend
adapters that fall back to plain torch on their device (``flashrt.kernels_ascend``) call them too,
so both share one implementation. Inputs arrive validated by :mod:`flashrt.ops`. Math runs in
fp32; large intermediates are chunked over query positions so that the math stays usable on
realistic shapes.

GEMMs, last-dim sums and the transcendental pointwise functions are evaluated wide (fp64 on CPU and
CUDA) and rounded to fp32, so that a row (a position, a head) gets the same bits whatever the other
rows of the call: a one-token decode step, a speculative verify chunk, a prefill and a
tensor-parallel rank's share of the heads agree bit for bit (:mod:`flashrt.refmath_wide`).

This module holds the norm, rotary, compression, mHC, Engram and sampling math and names every op
of the groups kept beside it: :mod:`flashrt.refmath_linear` (quantization, linear),
:mod:`flashrt.refmath_attention` (attention, indexer, top-k), :mod:`flashrt.refmath_moe` (MoE) and
:mod:`flashrt.refmath_kv` (KV paging).
"""
from __future__ import annotations

import math

import torch

from . import formats
# the op groups kept beside this module, named here too: the reference backend binds them from here
from .refmath_attention import (block_scores, candidate_blocks, dense_attention, index_scores,  # noqa: F401
                                prefix_attention, prefix_indices, sparse_attention, topk_positions)
from .refmath_kv import (gather_cold_rows, resolve_paged, store_paged, store_paged_many, store_rows,  # noqa: F401
                         window_indices)
from .refmath_linear import (activation_format, dequantize, dequantized_weight, grouped_linear,  # noqa: F401
                             linear, quantize)
from .refmath_moe import moe_experts, moe_route, swiglu  # noqa: F401
from .refmath_wide import linear32, mean_sq, pointwise, row_sum


def rms_norm(x, weight, eps):
    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(mean_sq(xf) + eps) * weight.to(torch.float32)
    return y.to(x.dtype)


def rope(x, freqs_cis, inverse):
    rot = 2 * freqs_cis.shape[-1]
    if rot < x.shape[-1]:  # the last 2P channels rotate, the rest is copied
        return torch.cat([x[..., :-rot], rope(x[..., -rot:], freqs_cis, inverse)], dim=-1)
    # contiguous: view_as_complex needs even strides, which a sliced x (e.g. q[..., -R:]) may lack
    xc = torch.view_as_complex(x.to(torch.float32).contiguous().reshape(*x.shape[:-1], x.shape[-1] // 2, 2))
    f = freqs_cis.conj() if inverse else freqs_cis
    if x.dim() == 4:  # [B, S, H, R/2]: broadcast over heads
        f = f.unsqueeze(-2)
    return torch.view_as_real(xc * f).flatten(-2).to(x.dtype)


def norm_rope_quantize(x, weight, eps, freqs_cis, fmt, dequantize_to=None):
    y = rms_norm(x, weight, eps) if weight is not None else x
    if fmt is None:
        return rope(y, freqs_cis, False)
    q = quantize(rope(y, freqs_cis, False), fmt)
    return q if dequantize_to is None else dequantize(q, dequantize_to)


def compress_pool(kv, score):
    return (torch.softmax(score, dim=2) * kv).sum(2)


def compress_decode(kv, score, kv_state, score_state, positions, weight, eps, dtype):
    r = kv_state.shape[1]
    rows, slot = torch.arange(kv.shape[0], device=kv.device), positions % r
    kv_state[rows, slot] = kv
    score_state[rows, slot] = score
    latent = rms_norm(compress_pool(kv_state.unsqueeze(1), score_state.unsqueeze(1)).to(dtype), weight, eps)
    done = positions + 1
    return latent, (done // r - 1).unsqueeze(1), (done % r == 0).unsqueeze(1)


def hc_coefficients(x, fn, scale, base, iters, eps, norm_eps):
    B, S, hc, _ = x.shape
    v = x.to(torch.float32).flatten(2)
    m = linear32(v, fn) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm_eps)
    pre = pointwise(torch.sigmoid, m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * pointwise(torch.sigmoid, m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).view(B, S, hc, hc)
    comb = torch.softmax(comb, -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse(x, pre):
    return (pre.unsqueeze(-1) * x.to(torch.float32)).sum(2).to(x.dtype)


def hc_collapse_norm(x, pre, weight, eps):
    return rms_norm(hc_collapse(x, pre), weight, eps)


def hc_expand(y, residual, post, comb):
    mixed = torch.einsum("bsjk,bsjd->bskd", comb, residual.to(torch.float32))
    return (post.unsqueeze(-1) * y.to(torch.float32).unsqueeze(2) + mixed).to(y.dtype)


def engram_lookup(table, ids):
    return formats.dequantize_rows(table, ids, torch.bfloat16)


def engram_gate(h, key, value, weight, eps):
    hf, kf = h.to(torch.float32), key.to(torch.float32)
    r = torch.rsqrt(mean_sq(hf)[..., 0] + eps) * torch.rsqrt(mean_sq(kf)[..., 0] + eps)
    d = row_sum(hf * weight.to(torch.float32) * kf) * r / math.sqrt(h.shape[-1])
    g = pointwise(torch.sigmoid, torch.copysign(d.abs().clamp_min(1e-6).sqrt(), d))
    return (hf + g.unsqueeze(-1) * value.to(torch.float32).unsqueeze(2)).to(h.dtype)


def engram_hash(seq, multipliers, primes, offsets, pad):
    N, H = multipliers.shape[1], primes.shape[1] // (multipliers.shape[1] - 1)
    S = seq.shape[1] - (N - 1)
    blocked = torch.zeros(seq.shape[0], S, dtype=torch.bool, device=seq.device)
    rolling, cols = None, []
    for shift in range(N):  # shift: the token ``shift`` positions back; DEAD there or newer blocks it
        src = seq[:, N - 1 - shift: N - 1 - shift + S]
        blocked = blocked | (src == -1)
        prod = torch.where(blocked, pad, src).unsqueeze(-1) * multipliers[:, shift]  # [B, S, L], wraps
        rolling = prod if rolling is None else torch.bitwise_xor(rolling, prod)
        if shift:
            cols.append(rolling.unsqueeze(-1).expand(-1, -1, -1, H))
    return torch.remainder(torch.cat(cols, dim=-1), primes) + offsets


def gumbel_sample(logits, temperature, generator, argmax=lambda t: t.argmax(-1)):
    """Greedy where ``temperature == 0``, else ``argmax(p / E)``, ``E ~ Exp(1)`` (Gumbel-max)."""
    lf = logits.to(torch.float32)
    greedy = argmax(lf)
    if not isinstance(temperature, torch.Tensor):
        if temperature == 0:
            return greedy
        temperature = torch.full(lf.shape[:1], float(temperature), device=lf.device)
    p = torch.softmax(lf / temperature.clamp_min(1e-5).unsqueeze(-1), -1)
    noise = torch.empty_like(p).exponential_(1, generator=generator)
    return torch.where(temperature == 0, greedy, argmax(p / noise))


def sample(logits, temperature, generator):
    return gumbel_sample(logits, temperature, generator)
