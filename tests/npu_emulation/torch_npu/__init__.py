"""A test double of ``torch_npu`` 2.14.0 for CPU-only CI (flashrt's Ascend backend tests).

Put on ``sys.path`` only by the Ascend tests (fixture ``npu_emulation`` in
``tests/ascend_helpers.py``), never globally. It provides the operators the Ascend backend uses,
each with the exact signature of its schema in the torch_npu 2.14.0 wheel (argument names, order,
keyword-only split, defaults: ``tests/ascend/test_ascend_schema.py`` checks this against the wheel), the
documented constraints checked (a violation raises ``RuntimeError``, as the real operator's check
would; what the emulation does not cover raises too, never runs silently), and reference math on
CPU tensors. Every call is recorded in ``CALLS`` (``_emulated.Call``: the name, the arguments as
passed positionally and by keyword, the result) so tests can assert the layouts and argument
mapping the backend produced and replay the calls against the real schemas and meta functions.

Where the documentation leaves a behaviour open, the emulation picks the *least convenient*
choice, so the backend's conversions are exercised rather than assumed:
- ``npu_dynamic_quant`` on an all-zero row (0 / 0) writes -128;
- ``npu_moe_gating_top_k`` breaks ties towards the higher expert index;
- ``npu_sparse_flash_attention`` returns NaN for a row with no valid index;
- outputs or rows documented as undefined (``npu_moe_init_routing_v2``'s ``expanded_scale``
  without a scale, ``npu_clipped_swiglu`` rows past ``group_index``) are NaN.

Importing it also installs the ``torch.npu`` shims the backend uses (``is_available``,
``device_count``, ``get_device_name``, ``get_device_properties``); the fixture removes them.
"""
from __future__ import annotations

import types

import torch

from . import npu  # noqa: F401  (torch_npu.npu: SoC version, CANN version, device queries)
from ._emulated import CALLS, OPERATORS, Call, calls  # noqa: F401

FLASHRT_EMULATION = True
__version__ = "2.14.0+flashrt.emulation"

torch.npu = types.SimpleNamespace(  # what `import torch_npu` registers, reduced to what flashrt calls
    is_available=npu.is_available, device_count=npu.device_count,
    get_device_name=npu.get_device_name, get_device_properties=npu.get_device_properties)

from ._ops_attention import npu_fusion_attention, npu_sparse_flash_attention  # noqa: E402
from ._ops_basic import npu_clipped_swiglu, npu_gather_sparse_index, npu_rms_norm, npu_rotary_mul  # noqa: E402
from ._ops_moe import npu_grouped_matmul, npu_moe_gating_top_k  # noqa: E402
from ._ops_quant import npu_dynamic_quant, npu_quant_matmul  # noqa: E402
from ._ops_routing import npu_moe_finalize_routing, npu_moe_init_routing_v2  # noqa: E402

__all__ = ["CALLS", "calls", "npu", *sorted(OPERATORS)]
