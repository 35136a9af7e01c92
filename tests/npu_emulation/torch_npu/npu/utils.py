"""``torch_npu.npu.utils`` of the emulation."""

CANN_VERSION = "8.3.RC1.emulated"


def get_cann_version(module: str = "CANN") -> str:
    return CANN_VERSION
