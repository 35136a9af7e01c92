"""The op contract (docs/ops.md): every model graph is written only against these functions.

Each op validates its inputs (``ValueError`` naming the argument, the expected and the given
shape or dtype; out-of-range indices rejected) and then calls the implementation resolved once
for (op, device type) by :mod:`flashrt.dispatch`. Notation: ``B`` batch, ``S`` query positions,
``T`` KV entries, ``H`` heads, ``D`` head dim, ``K`` top-k. Index tensors are int32 unless said.
Ops never mutate their inputs, except the ones that say they write in place (``store_paged``,
``store_paged_many``, ``store_rows``, ``compress_decode``). Outputs live on the device of the inputs.

This module holds the norm, rotary, quantization, linear and sampling ops and names every op of the
groups kept beside it: :mod:`flashrt.ops_attention`, :mod:`flashrt.ops_kv`, :mod:`flashrt.ops_moe`,
:mod:`flashrt.ops_mhc` and :mod:`flashrt.ops_engram`; :data:`OPS` lists them all.
"""
from __future__ import annotations

import torch

from . import checks as c
from .checks import F32, WEIGHT_FORMATS
from .dispatch import impl as _impl
from .formats import QTensor, check_shape
# the op groups kept beside this module, named here too: ``flashrt.ops.<op>`` is the contract
from .ops_attention import (candidate_blocks, compress_decode, compress_pool, dense_attention, index_scores,  # noqa: F401
                            prefix_attention, sparse_attention, topk_positions)
from .ops_engram import engram_gate, engram_hash, engram_lookup  # noqa: F401
from .ops_kv import (gather_cold_rows, resolve_paged, store_paged, store_paged_many, store_rows,  # noqa: F401
                     window_indices)
from .ops_mhc import hc_coefficients, hc_collapse, hc_collapse_norm, hc_expand  # noqa: F401
from .ops_moe import moe_experts, moe_route  # noqa: F401
from . import ops_attention, ops_engram, ops_kv, ops_mhc, ops_moe  # noqa: E402

MODULES = (ops_attention, ops_engram, ops_kv, ops_mhc, ops_moe)
"""The group modules; each, like this one, resolves implementations through its own ``_impl``
(a tool that routes every op call, e.g. to count launches, replaces ``_impl`` in all of them)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., N]`` float, ``weight [N]`` -> like ``x``.

    Computed in fp32: ``x * rsqrt(mean(x**2, -1) + eps) * weight``, cast back to ``x.dtype``.
    """
    c.tensor("x", x, None, {}, c.FLOATS)
    env = {"N": x.shape[-1]} if x.dim() else {}
    c.tensor("weight", weight, "N", env, c.FLOATS, x.device)
    c.number("eps", eps, 0.0)
    return _impl("rms_norm", x.device)(x, weight, eps)


def rope(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotary embedding of ``x [S, R]``, ``[B, S, R]`` or ``[B, S, H, R]`` (R even) -> like ``x``.

    Adjacent pairs ``(x[2i], x[2i+1])`` form one complex number multiplied by
    ``freqs_cis [S, P]`` (complex64; ``[B, S, P]`` gives each sequence its own positions),
    or by its conjugate when ``inverse``. ``P = R/2`` rotates every pair; ``1 <= P < R/2`` rotates
    only the last ``2P`` channels (table entry ``i`` on the ``i``-th of the last ``P`` pairs) and
    copies the first ``R - 2P`` unchanged. Computed in fp32, cast back to ``x.dtype``.
    """
    c.tensor("x", x, None, {}, c.FLOATS)
    if x.dim() not in (2, 3, 4) or x.shape[-1] % 2:
        raise ValueError(f"x: expected [S, R], [B, S, R] or [B, S, H, R] with R even, got shape {tuple(x.shape)}")
    seq_axis = 1 if x.dim() >= 3 else 0
    pairs = x.shape[-1] // 2
    fdim = freqs_cis.dim() if isinstance(freqs_cis, torch.Tensor) else 0
    if fdim in (2, 3) and not 1 <= freqs_cis.shape[-1] <= pairs:
        raise ValueError(f"freqs_cis: expected a last dim P in [1, {pairs}] (x's R/2 pairs), got shape "
                         f"{tuple(freqs_cis.shape)}")
    env = {"S": x.shape[seq_axis], "P": freqs_cis.shape[-1] if fdim in (2, 3) else pairs, "B": x.shape[0]}
    spec = "B S P" if fdim == 3 else "S P"
    c.tensor("freqs_cis", freqs_cis, spec, env, (torch.complex64,), x.device)
    if freqs_cis.dim() == 3 and x.dim() == 2:
        raise ValueError(f"freqs_cis: per-sequence [B, S, P] needs x with a batch dim, got x shape {tuple(x.shape)}")
    return _impl("rope", x.device)(x, freqs_cis, bool(inverse))


def quantize(x: torch.Tensor, fmt: str) -> QTensor:
    """Quantize ``x`` float along its last dim (last two for ``fp8_w``) into ``fmt``.

    Formats, scale rules and packing: :mod:`flashrt.formats`.
    """
    c.tensor("x", x, None, {}, c.FLOATS)
    c.fmt("fmt", fmt)
    check_shape(fmt, x.shape, "x")
    return _impl("quantize", x.device)(x, fmt)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., G, in]`` float, ``weight [G * out, in]`` plain float -> ``[..., G * out]``: group
    ``g`` of ``x`` times rows ``[g * out, (g + 1) * out)`` of ``weight`` (each a :func:`linear`),
    the groups' outputs side by side. The attention's grouped output projection (``wo_a``)."""
    c.tensor("x", x, None, {}, c.FLOATS)
    if x.dim() < 2:
        raise ValueError(f"x: expected [..., G, in], got shape {tuple(x.shape)}")
    G, k = x.shape[-2], x.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != k or G < 1 \
            or weight.shape[0] % G:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight: expected a plain [G * out, in] tensor with G = {G}, in = {k}, got {got}")
    c.tensor("weight", weight, None, {}, c.FLOATS, x.device)
    return _impl("grouped_linear", x.device)(x, weight)


def norm_rope_quantize(x: torch.Tensor, weight, eps: float, freqs_cis: torch.Tensor, fmt: str,
                       dequantize_to: torch.dtype | None = None):
    """``quantize(rope(rms_norm(x, weight, eps), freqs_cis), fmt)`` in one op (no norm when
    ``weight`` is None): the KV path of a layer (a window ring's new rows, a compressed entry and
    its index key). ``x [B, S, D]`` or ``[B, S, H, D]`` float (the heads of a row share its table
    entry), ``weight [D]`` or None, ``freqs_cis [B, S, P]`` complex64 rotating the last ``2P``
    channels as :func:`rope`, ``fmt`` a block format (``fp8``, ``fp4_b16``, ``fp4_b32``,
    ``int8``). The norm and the rope round to ``x.dtype`` as the ops in sequence would.
    ``dequantize_to`` a float dtype: the values the quantized rows stand for, as that dtype (a
    fake quantization: ``dequantize(..., dequantize_to)``; the indexer's queries) instead of the
    ``QTensor``. ``fmt`` None: no quantization, ``rope(rms_norm(x, weight, eps), freqs_cis)`` in
    ``x.dtype`` (the attention's query heads).
    """
    env: dict = {}
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected [B, S, D] or [B, S, H, D], got {got}")
    c.tensor("x", x, "B S D" if x.dim() == 3 else "B S H D", env, c.FLOATS)
    if weight is not None:
        c.tensor("weight", weight, "D", env, c.FLOATS, x.device)
    c.number("eps", eps, 0.0)
    if env["D"] % 2 or not isinstance(freqs_cis, torch.Tensor) or freqs_cis.dim() != 3 \
            or not 1 <= freqs_cis.shape[-1] <= env["D"] // 2:
        got = tuple(freqs_cis.shape) if isinstance(freqs_cis, torch.Tensor) else type(freqs_cis).__name__
        raise ValueError(f"freqs_cis: expected [B, S, P] with P in [1, {env['D'] // 2}] and D even, got {got} "
                         f"for x of shape {tuple(x.shape)}")
    c.tensor("freqs_cis", freqs_cis, "B S P", env, (torch.complex64,), x.device)
    if fmt is not None:
        c.choice("fmt", fmt, BLOCK_FORMATS)
        check_shape(fmt, x.shape, "x")
    elif dequantize_to is not None:
        raise ValueError(f"dequantize_to: expected None when fmt is None (nothing to dequantize), got {dequantize_to}")
    if dequantize_to is not None:
        c.choice("dequantize_to", dequantize_to, c.FLOATS)
    return _impl("norm_rope_quantize", x.device)(x, weight, float(eps), freqs_cis, fmt, dequantize_to)


BLOCK_FORMATS = ("fp8", "fp4_b16", "fp4_b32", "int8")  # the activation / KV formats norm_rope_quantize writes


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values a ``QTensor`` stands for, as ``dtype`` (computed in fp32)."""
    if not isinstance(q, QTensor):
        raise ValueError(f"q: expected a QTensor, got {type(q).__name__}")
    c.maybe_quantized("q", q, None, {}, c.FORMATS)
    c.choice("dtype", dtype, c.FLOATS)
    return _impl("dequantize", q.device)(q, dtype)


def linear(x: torch.Tensor, weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., in]`` float, ``weight [out, in]`` plain or ``QTensor`` ``fp8_w``/``fp4_w`` -> ``[..., out]``.

    Plain weight: ``x @ weight.T`` accumulated in fp32. Quantized weight: ``x`` is first
    quantized to ``fp8`` (per 32, UE8M0; ``int8_t``, one scale per token, for an ``int8_w``
    weight), then ``dequant(xq) @ dequant(w).T`` accumulated in fp32.
    Output dtype ``out_dtype`` (default ``x.dtype``): the sums rounded once to it, so
    ``linear(x, w, torch.float32)`` is ``linear(x.float(), w)`` with no cast of ``x`` before it.
    """
    c.tensor("x", x, None, {}, c.FLOATS)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dim [..., in], got a scalar")
    env = {"in": x.shape[-1]}
    c.maybe_quantized("weight", weight, "out in", env, WEIGHT_FORMATS, x.device)
    if isinstance(weight, QTensor) and x.shape[-1] % 32:
        raise ValueError(f"x: a quantized weight needs in % 32 == 0 (fp8 activations), got in={x.shape[-1]}")
    if out_dtype is None or out_dtype == x.dtype:
        return _impl("linear", x.device)(x, weight)
    c.choice("out_dtype", out_dtype, c.FLOATS)
    return _impl("linear", x.device)(x, weight, out_dtype)


def sample(logits, temperature, generator=None) -> torch.Tensor:
    """``logits [B, V]`` float, ``temperature`` float >= 0 or fp32 ``[B]`` -> int64 ``[B]``.

    Greedy (argmax, ties to the lower id) where ``temperature == 0``, else Gumbel-max over
    ``softmax(logits / temperature)``: ``argmax(p / E)`` with ``E ~ Exp(1)`` drawn from
    ``generator``.
    """
    env: dict = {}
    c.tensor("logits", logits, "B V", env, c.FLOATS)
    if isinstance(temperature, torch.Tensor):
        c.tensor("temperature", temperature, "B", env, F32, logits.device)
        if c.values_checked() and bool((temperature < 0).any()):
            raise ValueError("temperature: expected values >= 0, got a negative temperature")
    else:
        c.number("temperature", temperature, 0.0)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    return _impl("sample", logits.device)(logits, temperature, generator)


OPS = (
    "rms_norm", "rope", "quantize", "norm_rope_quantize", "dequantize", "linear", "grouped_linear", "sparse_attention",
    "prefix_attention", "index_scores", "topk_positions", "candidate_blocks", "compress_pool", "compress_decode", "hc_coefficients",
    "hc_collapse", "hc_collapse_norm", "hc_expand", "engram_lookup", "engram_gate", "engram_hash", "moe_route",
    "moe_experts", "sample", "gather_cold_rows", "dense_attention", "store_paged", "resolve_paged", "store_rows",
    "window_indices", "store_paged_many",
)
