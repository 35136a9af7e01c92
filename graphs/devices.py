"""The device a model is loaded on: ``cpu``, ``cuda[:N]``, ``npu[:N]`` or ``meta`` (shapes only).

:func:`resolve_device` turns a user's ``device`` argument into a ``torch.device`` or raises
:class:`~flashrt.errors.DeviceError` naming the argument, what was asked for and the devices this
machine has (``flashrt doctor`` lists them with the reasons others are missing).
"""
from __future__ import annotations

import torch

from flashrt.errors import DeviceError

KINDS = ("cpu", "cuda", "npu", "meta")


def _npu():
    npu = getattr(torch, "npu", None)  # registered by torch_npu when it is imported
    return npu if npu is not None and npu.is_available() else None


def available_devices() -> list[str]:
    """``cpu`` and every visible ``cuda:N`` / ``npu:N``."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    npu = _npu()
    if npu is not None:
        out += [f"npu:{i}" for i in range(npu.device_count())]
    return out


def _fail(device, why: str) -> DeviceError:
    return DeviceError(f"device: {why}, got {device!r}; this machine has {', '.join(available_devices())}")


def resolve_device(device) -> torch.device | None:
    """``device`` (None, a ``torch.device``, ``"cuda:1"``, ...) as a ``torch.device`` this machine has
    (None stays None: the caller's default)."""
    if device is None:
        return None
    if isinstance(device, str) and device.split(":")[0] == "npu":
        _import_npu()
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise _fail(device, f"expected one of {', '.join(KINDS)} (optionally ':N')") from None
    else:
        raise _fail(device, "expected a device name such as 'cpu' or 'cuda:0'")
    if dev.type not in KINDS:
        raise _fail(device, f"expected one of {', '.join(KINDS)} (flashrt has no {dev.type} backend)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
            raise _fail(device, f"a CUDA device was asked for but there is none ({why})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise _fail(device, f"cuda:{dev.index} was asked for, there are {torch.cuda.device_count()}")
    if dev.type == "npu" and _npu() is None:
        raise _fail(device, "an Ascend NPU was asked for but there is none (torch_npu missing or no NPU visible)")
    return dev


def _import_npu() -> None:
    """``torch.device("npu")`` parses only once torch_npu is imported."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        pass
