"""Reference backend: every op of docs/ops.md in plain torch, on any device. The semantics of record.

The math lives in :mod:`flashrt.refmath` (core), which backend adapters that fall back to plain
torch share; this plugin binds it. Every public name of ``refmath`` is reachable here too
(``reference.sparse_attention``, ``reference.swiglu``, ...).
"""
from __future__ import annotations

from flashrt import refmath
from flashrt.hookspecs import Backend, hookimpl
from flashrt.ops import OPS as OP_NAMES

OPS = {name: getattr(refmath, name) for name in OP_NAMES}


def __getattr__(name: str):
    return getattr(refmath, name)


def _host_is_device(device) -> bool:
    """On the CPU the host pages are the device's memory: the gather reads them in place."""
    return device.type == "cpu"


@hookimpl
def flashrt_backend():
    return Backend(
        name="reference",
        device_types=("cpu", "cuda", "npu", "mps", "xpu"),
        ops=OPS,
        priority=0,
        zero_copy={"gather_cold_rows": _host_is_device},
        description="plain torch on any device; the semantics of record",
    )
