"""Collectives: ``torch.distributed`` with the process-group backend the device type needs.

Model code never names a collective backend. It calls :func:`init` with the device it runs on
(or nothing: the current device of the active flashrt backend's kind), and the communication
backend follows from the device type, the way the op backend does: ``hccl`` on ``npu`` (registered
by ``torch_npu``, imported here only for an NPU), ``nccl`` on ``cuda``, ``gloo`` on ``cpu``.
The collectives below are thin wrappers that keep call sites free of ``torch.distributed``; each
takes an optional ``group`` (from :func:`new_group`) and is the identity outside a process group
or in a group of one. A collective that fails (a peer died, or it waited past the group's
timeout) raises :class:`~flashrt.errors.CollectiveError` naming this rank and the collective.
"""
from __future__ import annotations

import datetime
import importlib
import os

import torch
import torch.distributed as dist

from .errors import CollectiveError

COLLECTIVE_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
_timeout: datetime.timedelta | None = None  # the collective timeout :func:`init` gave the default group


def backend_for(device) -> str:
    """The torch.distributed backend for a device (``"npu"``, ``"cuda:1"``, a torch.device)."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    try:
        return COLLECTIVE_BACKENDS[kind]
    except KeyError:
        raise ValueError(f"device: expected one of {sorted(COLLECTIVE_BACKENDS)}, got {device!r}") from None


def default_device() -> str:
    """cuda when visible, else npu when torch_npu is loaded and sees one, else cpu."""
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


def init(device=None, *, rank: int | None = None, world_size: int | None = None,
         init_method: str | None = None, timeout_s: float = 600.0) -> str:
    """Join the default process group with the backend ``device`` needs; returns its name.

    ``rank`` / ``world_size`` default to the ``RANK`` / ``WORLD_SIZE`` variables torchrun sets and
    ``init_method`` to ``env://`` (``MASTER_ADDR`` / ``MASTER_PORT``). Calling it again with the same
    backend is a no-op; with another backend it is a ``ValueError``.
    """
    backend = backend_for(device if device is not None else default_device())
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise ValueError(f"device: the process group already uses {dist.get_backend()!r}, not {backend!r}")
        return backend
    if backend == "hccl":
        importlib.import_module("torch_npu")  # registers the hccl backend with torch.distributed
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    global _timeout
    _timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=rank,
                            world_size=world_size, timeout=_timeout)
    return backend


def shutdown() -> None:
    """Leave the process group (no-op when not in one)."""
    global _failure
    _failure = None
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def collective_device() -> torch.device:
    """Where this process group's collectives take their tensors: the current CUDA / NPU device for
    nccl / hccl, else the CPU."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def new_group(ranks: list[int]):
    """A process group over ``ranks`` (global ranks). Every rank of the default group must call this
    for every group, in the same order (torch.distributed's rule); None outside a process group.
    Its collectives wait as long as the default group's (the ``timeout_s`` given to :func:`init`)."""
    # the default group's timeout (torch's own default for a new group is 30 minutes)
    return dist.new_group(sorted(ranks), timeout=_timeout) if dist.is_initialized() else None


def group_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _active(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


_failure: CollectiveError | None = None  # the first collective of this process group that failed


def failure() -> CollectiveError | None:
    """The collective that failed in this process group, if one did (the group is unusable then)."""
    return _failure


def _call(name: str, fn, *args, **kwargs):
    """Run one collective; a failure becomes a CollectiveError naming this rank and the collective.
    Once one failed the group is broken: every later collective raises at once instead of waiting
    out the timeout again."""
    global _failure
    if _failure is not None:
        raise CollectiveError(f"rank {rank()}: {name} not run: an earlier collective failed ({_failure})",
                              rank=rank(), collective=name) from _failure
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:  # gloo / nccl / hccl failures (DistBackendError is a RuntimeError)
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        _failure = CollectiveError(f"rank {rank()}: {name} failed (a peer rank died, or it waited past the "
                                   f"collective timeout): {why}", rank=rank(), collective=name)
        raise _failure from exc


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In place over every rank of ``group`` (``sum`` / ``max`` / ``min``)."""
    if _active(group):
        _call("all_reduce", dist.all_reduce, t, op=_OPS[op], group=group)
    return t


def all_gather(t: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Every rank's ``t`` (same shape on every rank) concatenated along ``dim`` in rank order."""
    if not _active(group):
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    _call("all_gather", dist.all_gather, parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def reduce_scatter(t: torch.Tensor, group=None) -> torch.Tensor:
    """``t`` [n * size, ...] summed over the ranks of ``group``; this rank keeps its block of rows
    (block ``i`` of ``n`` rows for the ``i``-th rank of the group)."""
    if not _active(group):
        return t
    size = dist.get_world_size(group)
    if t.shape[0] % size:
        raise ValueError(f"t: expected a leading dim divisible by the group size {size}, got {tuple(t.shape)}")
    out = torch.empty((t.shape[0] // size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    _call("reduce_scatter", fn, out, t.contiguous(), group=group)
    return out


def all_to_all(t: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    """Rows of ``t`` sent in blocks of ``send[i]`` rows to the ``i``-th rank of ``group``; returns
    the rows received, ``recv[i]`` from the ``i``-th rank, in rank order."""
    if not _active(group):
        return t
    out = torch.empty((sum(recv), *t.shape[1:]), dtype=t.dtype, device=t.device)
    _call("all_to_all", dist.all_to_all_single, out, t.contiguous(), recv, send, group=group)
    return out


def broadcast(t: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """In place: global rank ``src``'s ``t`` on every rank of ``group``."""
    if _active(group):
        _call("broadcast", dist.broadcast, t, src, group=group)
    return t


def broadcast_object(obj=None, src: int = 0):
    """Global rank ``src``'s picklable ``obj`` on every rank (small host-side plans, not tensors)."""
    if not _active(None):
        return obj
    box = [obj]
    _call("broadcast_object", dist.broadcast_object_list, box, src)
    return box[0]


def barrier(group=None) -> None:
    if _active(group):
        _call("barrier", dist.barrier, group=group)
