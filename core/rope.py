"""Rotary tables: ``rope_table(dim, max_len, base, yarn=None)`` -> complex64 ``[max_len, dim/2]``."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YaRN:
    """YaRN frequency interpolation (docs/model.md: factor 16 over 65536, beta 32 / 1)."""

    original_seq_len: int
    factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def _correction_dim(rotations: float, dim: int, base: float, original_seq_len: int) -> float:
    """The (fractional) frequency index that turns ``rotations`` times over ``original_seq_len``."""
    return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_frequencies(dim: int, base: float, yarn: YaRN | None = None) -> torch.Tensor:
    """fp32 ``[dim/2]`` angular frequencies, YaRN-blended when ``yarn`` is given.

    ``f_i = base**(-2i/dim)``; with YaRN, ``f_i' = f_i/factor * ramp_i + f_i * (1 - ramp_i)``,
    ``ramp_i = clamp((i - low) / max(high - low, 1e-3), 0, 1)``, ``low = floor(corr(beta_fast))``
    clamped at 0, ``high = ceil(corr(beta_slow))`` clamped at ``dim - 1`` (as the published model).
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"dim: expected a positive even int, got {dim}")
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None:
        return freqs
    low = max(math.floor(_correction_dim(yarn.beta_fast, dim, base, yarn.original_seq_len)), 0)
    high = min(math.ceil(_correction_dim(yarn.beta_slow, dim, base, yarn.original_seq_len)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return freqs / yarn.factor * ramp + freqs * (1 - ramp)


def rope_table(dim: int, max_len: int, base: float, yarn: YaRN | tuple | dict | None = None) -> torch.Tensor:
    """complex64 ``[max_len, dim/2]``: ``exp(i * p * f_k)`` for positions ``p < max_len``.

    ``yarn`` is a :class:`YaRN`, a dict of its fields, or a tuple
    ``(original_seq_len, factor, beta_fast, beta_slow)``.
    """
    if isinstance(yarn, dict):
        yarn = YaRN(**yarn)
    elif isinstance(yarn, tuple):
        yarn = YaRN(*yarn)
    if max_len <= 0:
        raise ValueError(f"max_len: expected a positive int, got {max_len}")
    freqs = rope_frequencies(dim, base, yarn)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)
