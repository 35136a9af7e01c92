"""NaN / Inf weights, found at load with one reduction per tensor.

A weight holding NaN or Inf gives a model that silently emits one token forever, so a load checks
every value: float tensors by their minimum and maximum (``aminmax`` carries a NaN through, an
Inf is one of them); FP8 E4M3 data by its NaN bytes (``S.1111.111``: E4M3FN has no Inf: 0x7F is
the largest byte read as int8, 0xFF the largest read as uint8); UE8M0 scales by the NaN byte
``0xFF``, their largest. FP4 E2M1 codes are all finite. None of these reductions makes a copy of
the tensor.

The reductions leave a flag a tensor on its device; :class:`FiniteCheck` reads them back
``BATCH`` tensors at a time (one host sync a batch, not one a tensor) and counts the bad values
of a flagged tensor only to name them in the error.
"""
from __future__ import annotations

import contextlib

import torch

from flashrt.errors import CheckpointError
from flashrt.formats import QTensor

SLICE = 1 << 24  # elements per step of the error's count (its masks stay small)
BATCH = 64  # tensors whose flags are read back together
_STATE = {"enabled": True}


@contextlib.contextmanager
def weight_checks(enabled: bool):
    """Inside the block, loads that do not say otherwise check (or skip checking) weights for NaN /
    Inf (``flashrt run --no-check-weights``)."""
    old = _STATE["enabled"]
    _STATE["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _STATE["enabled"] = old


def checks_enabled(check_finite: bool | None) -> bool:
    """``check_finite`` when given, else the :func:`weight_checks` setting (on by default)."""
    return _STATE["enabled"] if check_finite is None else bool(check_finite)


def _bad_count(t: torch.Tensor) -> int:
    """Non-finite elements of ``t`` (0 for dtypes with no non-finite values): the error's count."""
    flat = t.reshape(-1)
    bad = 0
    for start in range(0, flat.numel(), SLICE):
        part = flat[start:start + SLICE]
        if part.dtype == torch.float8_e4m3fn:
            mask = (part.view(torch.uint8) & 0x7F) == 0x7F
        elif part.dtype == torch.float8_e8m0fnu:
            mask = part.view(torch.uint8) == 0xFF
        elif part.is_floating_point():
            mask = ~torch.isfinite(part)
        else:
            return 0  # integer storage (FP4 bytes): every code is a finite value
        bad += int(mask.sum())
    return bad


def _all_finite(t: torch.Tensor) -> torch.Tensor | None:
    """A 0-dim bool tensor on ``t``'s device, True when every value of ``t`` is finite (no host
    sync, no copy of ``t``); None when ``t`` cannot hold a non-finite value (integer storage, or
    empty)."""
    if t.numel() == 0:
        return None
    if t.dtype == torch.float8_e4m3fn:  # NaN: 0x7F, the largest int8, or 0xFF, the largest uint8
        return (t.view(torch.int8).amax() != 0x7F) & (t.view(torch.uint8).amax() != 0xFF)
    if t.dtype == torch.float8_e8m0fnu:
        return t.view(torch.uint8).amax() != 0xFF
    if not t.is_floating_point():
        return None
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def _parts(name: str, value: torch.Tensor | QTensor):
    """(label, tensor) of a weight: itself, or a QTensor's data and scale."""
    if not isinstance(value, QTensor):
        return ((name, value),)
    scale = name[: -len("weight")] + "scale" if name.endswith("weight") else name + ".scale"
    return (name, value.data), (scale, value.scale)


class FiniteCheck:
    """NaN / Inf checks over many weights with few host syncs: :meth:`add` reduces on the
    weight's device, every ``batch`` tensors (and at :meth:`finish`) the flags are read back in one
    transfer; a flagged tensor raises ``CheckpointError`` naming it with its count of bad values.
    Meta tensors (shapes only) are skipped."""

    def __init__(self, batch: int = BATCH):
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch: expected a positive int, got {batch!r}")
        self.batch, self.pending = batch, []

    def add(self, name: str, value: torch.Tensor | QTensor) -> None:
        for label, t in _parts(name, value):
            ok = None if t.device.type == "meta" else _all_finite(t)
            if ok is not None:
                self.pending.append((label, t, ok))
        if len(self.pending) >= self.batch:
            self.finish()

    def finish(self) -> None:
        """Reads the pending flags back; raises for the first tensor flagged."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        flags = torch.stack([ok.to(pending[0][2].device) for _, _, ok in pending]).tolist()
        for (label, t, _), ok in zip(pending, flags):
            if not ok:
                raise CheckpointError(f"tensor {label!r}: {_bad_count(t)} of {t.numel()} values are NaN or Inf "
                                      f"(load with check_finite=False / --no-check-weights to skip this check)")
