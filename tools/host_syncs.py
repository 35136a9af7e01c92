"""Host syncs of a forward run on CPU tensors, counted by the flashrt source line that makes them.

On a GPU each of these waits for the device's whole queue: a value read to the host (``.item()``,
``bool(t)`` / ``int(t)``, ``.tolist()``, ``.numpy()``, ``.cpu()``) or an operation whose output
shape depends on the values (``nonzero``, boolean indexing, ``unique``, ``masked_select``,
``repeat_interleave`` without ``output_size``, ``bincount``), and host data made into a tensor on a
given device (``torch.tensor(data, device=d)``, ``torch.as_tensor``: a copy from pageable memory
that torch follows with a stream synchronize), and an advanced-index assignment of a Python number
(``t[idx] = 0`` with a tensor or list index: the number becomes a host tensor that ``index_put_``
copies to the device synchronously; ``index_fill_`` does not wait). On CPU tensors they cost nothing, so
a CPU profile hides them; :class:`HostSyncs` finds them without a GPU.

    with HostSyncs() as syncs:
        model.forward(ids, state=state)
    syncs.total, syncs.sites   # count, Counter of "file:line (function) op"
"""
from __future__ import annotations

import collections
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashrt

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(flashrt.__file__)))  # the checkout
# aten operations that read a value to the host or size their output by the values
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique",
                      "_unique2", "unique_consecutive", "unique_dim", "bincount", "histc"})
# Tensor methods that read the values on the host with no aten call of their own on CPU tensors
_READS = ("tolist", "numpy", "cpu")
_MADE = ("tensor", "as_tensor")  # torch functions making a tensor of host data
_PUTS = ("index_put_", "index_put", "_index_put_impl_")


def _site(depth: int) -> str:
    """``file:line (function)`` of the innermost frame in the flashrt checkout outside tools/ (and
    outside a virtual environment kept inside the checkout: its packages are not flashrt's)."""
    f = sys._getframe(depth)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_PKG) and not any(p in path for p in ("/tools/", "/triton/", "-packages/")):
            return f"{os.path.relpath(path, _PKG)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _sized_by_values(func, args, kwargs) -> bool:
    """A boolean-mask index, or ``repeat_interleave`` of tensor repeats with no ``output_size``."""
    name = func.overloadpacket.__name__
    if name == "repeat_interleave":
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name in ("index", "_index_put_impl_", "index_put", "index_put_"):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
    return False


class HostSyncs(TorchDispatchMode):
    """Counts, inside the block, the host syncs a CUDA run would make (module docstring)."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()
        self._depth = 0  # inside a patched read: its own aten calls are not counted again
        self._number = None  # a weak reference to the tensor the latest Python number was made into

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def _note(self, op: str) -> None:
        self.sites[f"{_site(3)} {op}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._depth and (name in SYNC_OPS or _sized_by_values(func, args, kwargs or {})):
            self._note(name)
        elif not self._depth and name in _PUTS and len(args) > 2 and self._number is not None \
                and self._number() is args[2]:
            self._note(f"{name} of a number")
        out = func(*args, **(kwargs or {}))
        if name == "lift_fresh" and isinstance(out, torch.Tensor) and out.dim() == 0:
            self._number = weakref.ref(out)  # (lift_fresh: a Python number made a tensor by indexing)
        return out

    def __enter__(self):
        self._real = {m: getattr(torch.Tensor, m) for m in _READS}
        for m, real in self._real.items():
            setattr(torch.Tensor, m, self._wrap(m, real))
        self._made = {m: getattr(torch, m) for m in _MADE}
        for m, real in self._made.items():
            setattr(torch, m, self._wrap_made(m, real))
        return super().__enter__()

    def __exit__(self, *exc):
        for m, real in self._real.items():
            setattr(torch.Tensor, m, real)
        for m, real in self._made.items():
            setattr(torch, m, real)
        return super().__exit__(*exc)

    def _wrap_made(self, name, real):
        def made(data, *a, **k):
            if not self._depth and k.get("device") is not None and not isinstance(data, torch.Tensor):
                self._note(f"{name}(host data, device)")
            return real(data, *a, **k)
        return made

    def _wrap(self, name, real):
        def read(t, *a, **k):
            if not self._depth:
                self._note(name)
            self._depth += 1
            try:
                return real(t, *a, **k)
            finally:
                self._depth -= 1
        return read
