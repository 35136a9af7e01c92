"""Shared helpers for the Ascend backend tests (``tests/ascend/test_ascend_*.py``).

The fixture ``npu_emulation`` puts the fake ``torch_npu`` of ``tests/npu_emulation`` on
``sys.path`` and sets ``FLASHRT_NPU_EMULATION=1`` for one test only, re-collects the plugins (so
the ascend backend serves CPU tensors when chosen explicitly), and undoes all of it afterwards.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch

from flashrt import dispatch
from flashrt.kernels_ascend.npu_runtime import EMULATION_ENV, FALLBACKS
from kernel_check import run_on_and_reference

EMULATION_DIR = str(Path(__file__).parent / "npu_emulation")


def _forget_torch_npu() -> None:
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        del sys.modules[name]
    if hasattr(torch, "npu"):
        del torch.npu


@pytest.fixture
def npu_emulation():
    """The emulated torch_npu module (its ``CALLS`` cleared); the ascend backend available on CPU."""
    old_env = os.environ.get(EMULATION_ENV)
    os.environ[EMULATION_ENV] = "1"
    sys.path.insert(0, EMULATION_DIR)
    import importlib

    importlib.invalidate_caches()
    torch_npu = importlib.import_module("torch_npu")
    torch_npu.CALLS.clear()
    FALLBACKS.clear()
    dispatch.reload()
    try:
        yield torch_npu
    finally:
        sys.path.remove(EMULATION_DIR)
        if old_env is None:
            os.environ.pop(EMULATION_ENV, None)
        else:
            os.environ[EMULATION_ENV] = old_env
        _forget_torch_npu()
        dispatch.reload()


run_both = functools.partial(run_on_and_reference, "ascend")  # (ascend result, reference result)


def fallbacks(op: str) -> list[str]:
    """Reasons the ascend backend fell back to plain torch for ``op`` since the fixture started."""
    return [reason for (name, reason), n in FALLBACKS.items() if name == op and n]
