"""Engram ops of the contract (:mod:`flashrt.ops`): the n-gram hash, the table lookup and the gate."""
from __future__ import annotations

import torch

from . import checks as c
from .dispatch import impl as _impl
from .formats import QTensor


def engram_lookup(table: QTensor, ids) -> torch.Tensor:
    """``table`` ``QTensor`` ``fp8 [rows, Dh]``, ``ids [B, S, C]`` int64 in ``[0, rows)`` ->
    bf16 ``[B, S, C, Dh]`` (the dequantized rows)."""
    env: dict = {}
    if not isinstance(table, QTensor):
        raise ValueError(f"table: expected a QTensor in 'fp8', got {type(table).__name__}")
    c.maybe_quantized("table", table, "rows Dh", env, ("fp8",))
    c.tensor("ids", ids, "B S C", env, (torch.int64,), table.device)
    c.index_range("ids", ids, 0, env["rows"])
    return _impl("engram_lookup", ids.device)(table, ids)


def engram_gate(h, key, value, weight, eps: float) -> torch.Tensor:
    """``h, key [B, S, hc, D]``, ``value [B, S, D]``, ``weight [hc, D]`` -> ``[B, S, hc, D]``.

    Per stream ``k``: ``r = rsqrt(mean(h_k**2) + eps) * rsqrt(mean(key_k**2) + eps)``,
    ``d = sum(h_k * weight_k * key_k) * r / sqrt(D)``,
    ``g = sigmoid(copysign(sqrt(max(|d|, 1e-6)), d))``, ``out_k = h_k + g * value``.
    Computed in fp32, cast to ``h.dtype``.
    """
    env: dict = {}
    c.tensor("h", h, "B S hc D", env, c.FLOATS)
    c.tensor("key", key, "B S hc D", env, c.FLOATS, h.device)
    c.tensor("value", value, "B S D", env, c.FLOATS, h.device)
    c.tensor("weight", weight, "hc D", env, c.FLOATS, h.device)
    c.number("eps", eps, 0.0)
    return _impl("engram_gate", h.device)(h, key, value, weight, eps)


def engram_hash(seq, multipliers, primes, offsets, pad: int) -> torch.Tensor:
    """Engram n-gram bucket ids: ``seq [B, N-1+S]`` int64 (compressed token ids, -1 for none;
    the ``N-1`` tokens before the chunk first), ``multipliers [L, N]``, ``primes`` and
    ``offsets [L, C]`` int64 (``C = (N-1) * H``, n-gram-size-major, head-minor), ``pad >= 0``
    -> int64 ``[B, S, L, C]``.

    At chunk position ``s`` and shift ``j`` (the token ``j`` back) the value is ``pad`` once that
    token or a newer one is -1, else the token; ``h_n = xor_{j<n} value_j * multipliers[l, j]``
    (int64, wrapping); column ``(n-2) * H + k`` holds ``remainder(h_n, prime) + offset``.
    """
    env: dict = {}
    c.tensor("seq", seq, "B T", env, (torch.int64,))
    c.tensor("multipliers", multipliers, "L N", env, (torch.int64,), seq.device)
    c.tensor("primes", primes, "L C", env, (torch.int64,), seq.device)
    c.tensor("offsets", offsets, "L C", env, (torch.int64,), seq.device)
    N, C = env["N"], env["C"]
    if N < 2:
        raise ValueError(f"multipliers: expected [L, N] with N >= 2 (n-gram sizes 2..N), got N={N}")
    if C % (N - 1):
        raise ValueError(f"primes: expected [L, C] with C a multiple of N - 1 = {N - 1}, got C={C}")
    if env["T"] < N - 1:
        raise ValueError(f"seq: expected [B, T] with T >= N - 1 = {N - 1} (the history), got T={env['T']}")
    c.integer("pad", pad, 0)
    c.index_range("seq", seq, -1, 2 ** 63 - 1)
    return _impl("engram_hash", seq.device)(seq, multipliers, primes, offsets, int(pad))
