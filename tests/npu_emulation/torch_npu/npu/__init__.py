"""``torch_npu.npu`` of the emulation: one Atlas A2 device (Ascend910B3, SoC version code 223)."""
from __future__ import annotations

import types

from . import utils  # noqa: F401

SOC_VERSION = 223  # c10_npu::SocVersion::Ascend910B3
DEVICE_NAME = "Ascend910B3"
TOTAL_MEMORY = 64 << 30


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def get_soc_version() -> int:
    return SOC_VERSION


def get_device_name(device=None) -> str:
    return DEVICE_NAME


def get_device_properties(device=None):
    return types.SimpleNamespace(name=DEVICE_NAME, total_memory=TOTAL_MEMORY)
