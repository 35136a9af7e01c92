"""A test double of ``torch_npu`` for CPU-only CI (flashrt's Ascend backend tests).

Put on ``sys.path`` only by the Ascend tests (fixture ``npu_emulation`` in
``tests/ascend_helpers.py``), never globally. It provides the operators the Ascend backend uses,
with the signatures, argument names and layouts of the torch_npu documentation, the documented
constraints checked (a violation raises ``RuntimeError``, as the real operator's check would),
and reference math on CPU tensors. Every call is recorded in ``CALLS`` so tests can assert the
layouts and argument mapping the backend produced.

Where the documentation leaves a behaviour open, the emulation picks the *least convenient*
choice, so the backend's conversions are exercised rather than assumed:
- ``npu_dynamic_quant`` on an all-zero row (0 / 0) writes -128;
- ``npu_moe_gating_top_k`` breaks ties towards the higher expert index;
- ``npu_sparse_flash_attention`` returns NaN for a row with no valid index.

Importing it also installs the ``torch.npu`` shims the backend uses (``is_available``,
``device_count``, ``get_device_name``, ``get_device_properties``); the fixture removes them.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from . import npu  # noqa: F401  (torch_npu.npu: SoC version, CANN version, device queries)

FLASHRT_EMULATION = True
__version__ = "2.6.0.post0+flashrt.emulation"


@dataclass
class Call:
    name: str
    args: dict


CALLS: list[Call] = []


def calls(name: str) -> list[dict]:
    """Arguments of every recorded call of operator ``name``, oldest first."""
    return [c.args for c in CALLS if c.name == name]


def _record(name: str, **args) -> None:
    CALLS.append(Call(name, args))


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"[emulated torch_npu] {msg}")


torch.npu = types.SimpleNamespace(  # what `import torch_npu` registers, reduced to what flashrt calls
    is_available=npu.is_available, device_count=npu.device_count,
    get_device_name=npu.get_device_name, get_device_properties=npu.get_device_properties)

from ._ops_basic import npu_dynamic_quant, npu_quant_matmul, npu_rms_norm, npu_rotary_mul  # noqa: E402
from ._ops_moe import npu_grouped_matmul, npu_moe_gating_top_k  # noqa: E402
from ._ops_attention import npu_fusion_attention, npu_sparse_flash_attention  # noqa: E402

__all__ = ["CALLS", "calls", "npu", "npu_rms_norm", "npu_rotary_mul", "npu_dynamic_quant", "npu_quant_matmul",
           "npu_grouped_matmul", "npu_moe_gating_top_k", "npu_sparse_flash_attention", "npu_fusion_attention"]
