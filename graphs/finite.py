"""NaN / Inf weights, found at load with one reduction per tensor.

A weight holding NaN or Inf gives a model that silently emits one token forever, so a load checks
every value: ``isfinite(...).all()`` for float tensors; for FP8 E4M3 data the NaN bytes
(``S.1111.111``: E4M3FN has no Inf); for UE8M0 scales the NaN byte ``0xFF``. FP4 E2M1 codes are
all finite. Large tensors are reduced in slices so the temporary mask stays small.
"""
from __future__ import annotations

import contextlib

import torch

from flashrt.errors import CheckpointError
from flashrt.formats import QTensor

SLICE = 1 << 24  # elements per reduction step
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
    """Non-finite elements of ``t`` (0 for dtypes with no non-finite values)."""
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


def check_finite(name: str, value: torch.Tensor | QTensor) -> None:
    """``CheckpointError`` naming ``name`` when ``value`` (or its data or scale) holds NaN or Inf;
    meta tensors (shapes only) are skipped."""
    parts = ((name, value),) if not isinstance(value, QTensor) else (
        (name, value.data), (name[: -len("weight")] + "scale" if name.endswith("weight") else name + ".scale",
                             value.scale))
    for label, t in parts:
        if t.device.type == "meta":
            continue
        bad = _bad_count(t)
        if bad:
            raise CheckpointError(f"tensor {label!r}: {bad} of {t.numel()} values are NaN or Inf "
                                  f"(load with check_finite=False / --no-check-weights to skip this check)")
