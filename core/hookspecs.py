"""The contract a backend plugin implements.

A plugin is any object or module with a ``flashrt_backend`` hook implementation that returns one
:class:`Backend`. Built-in backends (``flashrt.backends.reference``, ``.trace``) register exactly
like third-party ones; third-party plugins are found through the entry-point group
``flashrt.backends``::

    # pyproject.toml of the plugin package
    [project.entry-points."flashrt.backends"]
    mybackend = "mypkg.flashrt_plugin"

    # mypkg/flashrt_plugin.py
    from flashrt.hookspecs import Backend, hookimpl

    @hookimpl
    def flashrt_backend():
        return Backend(name="mybackend", device_types=("cuda",), priority=20,
                       ops={"rms_norm": my_rms_norm},
                       supports={"rms_norm": Support(inputs={"x": (torch.bfloat16,)})})

Each implementation receives the op's arguments exactly as ``flashrt.ops.<op>`` documents them,
already validated (shapes, dtypes, index ranges), and must return what the op documents. A backend
made of kernel modules declares them as :class:`KernelFamily` objects (``families``) and builds its
tables with :func:`family_tables` (see :mod:`flashrt.families` and ``docs/kernels.md``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import pluggy

from .families import Dim, KernelFamily, Support, family_tables  # noqa: F401 (the plugin API)

PROJECT = "flashrt"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


def _always_available() -> tuple[bool, str]:
    return True, ""


@dataclass(frozen=True)
class Backend:
    """What one plugin provides.

    name: unique backend name (``FLASHRT_BACKEND`` / ``use_backend`` select it by this name).
    device_types: torch device types served (``"cpu"``, ``"cuda"``, ``"npu"``, ``"meta"``).
    ops: op name -> implementation; only the ops it declares are dispatched to it.
    priority: higher is tried first by the automatic choice (reference is 0).
    is_available: ``() -> (ok, reason)``, evaluated once per process (and after a reset); a
        backend that is unavailable says why (missing package, no device, ...).
    supports: op name -> :class:`Support` (or a plain predicate, ``Support(extra=predicate)``):
        what the implementation serves. Dispatch checks it once per call key (dtypes, formats,
        declared dimension ranges; see :mod:`flashrt.support`); a declined call goes to
        the next backend (logged once), or fails with ``BackendError`` when this backend was
        chosen explicitly. An op with no entry serves every call its device type allows.
    explicit_device_types: device types served only when the backend is chosen explicitly
        (``FLASHRT_BACKEND`` / ``use_backend``), e.g. the CUDA kernels on CPU tensors under the
        Triton interpreter.
    zero_copy: op name -> ``(device) -> bool``: whether this backend's implementation reads
        host-memory inputs of the op in place on that device, with no host synchronisation (so a
        CUDA-graph capture may contain the call); see ``flashrt.dispatch.zero_copy``.
    families: the kernel families the backend is made of (their tiles, tile checks and warm-up
        reach core through dispatch: ``flashrt jit warmup``, profile validation, ``flashrt tune``).
    """

    name: str
    device_types: tuple[str, ...]
    ops: Mapping[str, Callable]
    priority: int = 10
    is_available: Callable[[], tuple[bool, str]] = _always_available
    supports: Mapping[str, Support | Callable[..., bool]] = field(default_factory=dict)
    description: str = ""
    explicit_device_types: tuple[str, ...] = ()
    zero_copy: Mapping[str, Callable] = field(default_factory=dict)
    families: tuple[KernelFamily, ...] = ()


@hookspec
def flashrt_backend() -> Backend:
    """Return the :class:`Backend` this plugin provides (or ``None`` to provide none)."""
