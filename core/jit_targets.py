"""The NVIDIA architectures kernels are compiled for, and the device facts a launcher asks for.

A launcher picks its path from the device: the compute capability (``tl.dot`` on FP8 operands
needs sm_89+) and the SM count (K splits fill the SMs). :func:`capability` and :func:`sm_count`
answer for the visible CUDA device, or, inside :func:`targeting`, for the architecture being
cross-compiled for (``flashrt jit compile``, :mod:`flashrt.jit_compile`): the launchers then
plan exactly what they would launch on that device, without one.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

from .tile_checks import SMEM_PER_BLOCK


@dataclass(frozen=True)
class Arch:
    """One compile target: ``name`` (``sm_90``), compute capability, SMs of its matrix device, and
    the opt-in shared memory one block may use (bytes)."""

    name: str
    capability: tuple[int, int]
    sms: int
    device: str

    @property
    def cc(self) -> int:
        """Triton's arch number (``90``)."""
        return self.capability[0] * 10 + self.capability[1]

    @property
    def smem_limit(self) -> int:
        return SMEM_PER_BLOCK[f"{self.capability[0]}.{self.capability[1]}"]


ARCHS = {a.name: a for a in (Arch("sm_80", (8, 0), 108, "A100"), Arch("sm_89", (8, 9), 128, "RTX 4090"),
                             Arch("sm_90", (9, 0), 132, "H100 / H200"))}

_TARGET: contextvars.ContextVar[Arch | None] = contextvars.ContextVar("flashrt_compile_target", default=None)


def parse_arch(name: str, option: str = "--arch") -> Arch:
    """``sm_80`` / ``sm80`` / ``80`` / ``8.0`` -> its :class:`Arch`; anything else is a ValueError
    naming ``option``, the architectures known and the value given."""
    key = str(name).strip().lower().replace(".", "").removeprefix("sm").lstrip("_")
    arch = ARCHS.get(f"sm_{key}")
    if arch is None:
        raise ValueError(f"{option}: expected one of {', '.join(ARCHS)}, got {name!r}")
    return arch


def device_arch(index: int | None = None) -> Arch:
    """The :class:`Arch` of CUDA device ``index`` (default: the current one): its capability, SM
    count and name, so that launchers planned for it (:func:`targeting`) plan what they launch there."""
    import torch

    index = torch.cuda.current_device() if index is None else index
    cap = _device_capability(index)
    return Arch(f"sm_{cap[0]}{cap[1]}", cap, _device_sms(index), torch.cuda.get_device_name(index))


def cross_target() -> Arch | None:
    """The architecture being compiled for inside :func:`targeting`, else None."""
    return _TARGET.get()


@contextlib.contextmanager
def targeting(arch: Arch):
    """Device facts (:func:`capability`, :func:`sm_count`) answer for ``arch`` inside the block."""
    token = _TARGET.set(arch)
    try:
        yield arch
    finally:
        _TARGET.reset(token)


def capability() -> tuple[int, int]:
    """(major, minor) of the cross-compile target, else of the current CUDA device."""
    target = _TARGET.get()
    if target is not None:
        return target.capability
    import torch

    return _device_capability(torch.cuda.current_device())


def sm_count(index: int | None = None) -> int:
    """SMs of the cross-compile target, else of CUDA device ``index`` (default: the current one)."""
    target = _TARGET.get()
    if target is not None:
        return target.sms
    import torch

    return _device_sms(torch.cuda.current_device() if index is None else index)


@functools.cache
def _device_capability(index: int) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(index))


@functools.cache
def _device_sms(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count
