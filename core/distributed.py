"""Collectives: ``torch.distributed`` with the process-group backend the device type needs.

Model code never names a collective backend. It calls :func:`init` with the device it runs on
(or nothing: the current device of the active flashrt backend's kind), and the communication
backend follows from the device type, the way the op backend does: ``hccl`` on ``npu`` (registered
by ``torch_npu``, imported here only for an NPU), ``nccl`` on ``cuda``, ``gloo`` on ``cpu``.
The collectives below are thin wrappers that keep call sites free of ``torch.distributed``.
"""
from __future__ import annotations

import datetime
import importlib
import os

import torch
import torch.distributed as dist

COLLECTIVE_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


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
    dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def shutdown() -> None:
    """Leave the process group (no-op when not in one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In place over every rank (``sum`` / ``max`` / ``min``); identity outside a group."""
    if dist.is_initialized() and world_size() > 1:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t


def all_gather(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` in rank order."""
    if not dist.is_initialized() or world_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def broadcast(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In place: rank ``src``'s ``t`` on every rank."""
    if dist.is_initialized() and world_size() > 1:
        dist.broadcast(t, src)
    return t
