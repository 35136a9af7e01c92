"""Ascend backend: binds the ops to the torch_npu operator adapters of ``flashrt.kernels_ascend``.

The adapter package lists its families (``kernels_ascend.FAMILIES``; each module's ``FAMILY``:
functions with the op's signature) and, where an operator has preconditions, its ``PLANS``
(``plan(*args) -> None`` when the operator serves the call exactly, else the reason it falls
back). Every op serves every valid call on an ``npu`` tensor: through its operator where ops.md's
semantics hold exactly, through plain torch on the device otherwise (counted in
``kernels_ascend.npu_runtime.FALLBACKS``, logged once per reason), so ``FLASHRT_BACKEND=ascend``
never fails on a valid call. The families decline float64 only (the AI cores have no fp64): the
automatic choice then runs the reference.

Detection: torch_npu is looked up with ``importlib.util.find_spec`` and imported only by
:func:`supports_ascend` (when the backend is asked for or an ``npu`` device is in play) or by
``flashrt doctor`` when it is installed. Availability needs ``torch.npu.is_available()`` and an
Atlas A2/A3 SoC (``torch_npu.npu.get_soc_version()`` 220-255: 910B1-4, 910_93).

Target: torch_npu ``TORCH_NPU_TARGET`` (2.14.0). Every operator call of the adapters is checked in CI
against that wheel's operator schemas and meta functions (tests/ascend/test_ascend_schema.py).

Tests: with ``FLASHRT_NPU_EMULATION=1`` and the fake ``torch_npu`` of ``tests/npu_emulation`` on
``sys.path``, the backend also serves CPU tensors, only when chosen explicitly; the emulated
operators have the signatures of the torch_npu 2.14.0 schemas and implement the documented layouts
and constraints with reference math.
"""
from __future__ import annotations

import torch

from flashrt.families import family_tables
from flashrt.hookspecs import Backend, hookimpl
from flashrt.kernels_ascend.npu_runtime import EMULATION_ENV, emulation, npu, torch_npu_present

TORCH_NPU_TARGET = "2.14.0"  # the operator schemas the adapters are checked against (docs/ascend.md)
A2_A3_SOCS = range(220, 256)  # SocVersion: Ascend910B1..B4 (220-225), Ascend910_93xx (250-255)


def soc_version() -> int:
    """torch_npu's SoC version code of the current device (imports torch_npu)."""
    return int(npu().npu.get_soc_version())


def supports_ascend() -> tuple[bool, str]:
    """(available, why not): torch_npu importable, an NPU visible, an Atlas A2/A3 SoC."""
    if not torch_npu_present():
        return False, "torch_npu is not installed (pip install torch-npu matching the CANN toolkit)"
    try:
        tnpu = npu()
    except Exception as exc:  # a broken CANN install must not take the runtime down
        return False, f"import torch_npu failed: {type(exc).__name__}: {exc}"
    emulated = bool(getattr(tnpu, "FLASHRT_EMULATION", False))
    if emulation() or emulated:
        if emulation() and emulated:
            return True, ""
        return False, f"{EMULATION_ENV}=1 needs the emulated torch_npu of tests/npu_emulation and only it"
    if not torch.npu.is_available():
        return False, "no NPU visible to torch_npu (torch.npu.is_available() is False)"
    soc = soc_version()
    if soc not in A2_A3_SOCS:
        return False, f"SoC version {soc} is not an Atlas A2/A3 (910B / 910_93); the operators used need one"
    return True, ""


def versions() -> dict:
    """torch_npu / CANN versions and the SoC, for ``flashrt doctor`` (empty when not installed)."""
    if not torch_npu_present():
        return {}
    try:
        tnpu = npu()
    except Exception as exc:
        return {"torch_npu": f"import failed: {type(exc).__name__}: {exc}"}
    out = {"torch_npu": getattr(tnpu, "__version__", "unknown"), "torch_npu_target": TORCH_NPU_TARGET, "cann": None,
           "soc_version": None}
    try:
        out["cann"] = tnpu.npu.utils.get_cann_version(module="CANN")
    except Exception:  # older torch_npu has no get_cann_version
        pass
    try:
        if torch.npu.is_available():
            out["soc_version"] = soc_version()
            out["device"] = torch.npu.get_device_name(0)
    except Exception:
        pass
    return out


def plan(op: str, *args) -> str | None:
    """None when ``op`` would run its torch_npu operator on these arguments, else the reason it
    falls back to plain torch (each op evaluates the same plan before it runs)."""
    from flashrt.kernels_ascend import PLANS

    return PLANS[op](*args) if op in PLANS else "no torch_npu operator for this op"


@hookimpl
def flashrt_backend():
    families = ()
    if torch_npu_present() or emulation():
        from flashrt.kernels_ascend import FAMILIES as families
    return Backend(
        name="ascend",
        device_types=("npu",),
        explicit_device_types=("cpu",) if emulation() else (),
        **family_tables(families),
        families=families,
        priority=50,
        is_available=supports_ascend,
        description="torch_npu operators (kernels_ascend); CPU tensors under the test emulation when chosen explicitly",
    )
