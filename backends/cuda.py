"""CUDA backend: binds the ops to the Triton kernels of ``flashrt.kernels_cuda``.

Each kernel module ``kernels_cuda/<family>.py`` declares what it serves:

    OPS = {"sparse_attention": sparse_attention}          # launcher with the op's signature
    SUPPORTS = {"sparse_attention": supports_sparse}      # optional capability predicates

and is picked up here by name (no central list to edit). A call a predicate declines goes to the
next backend (the reference) in automatic mode, or fails with ``BackendError`` when ``cuda`` was
chosen explicitly. With ``TRITON_INTERPRET=1`` (set before flashrt is imported) the kernels also
run on CPU tensors, but only when the backend is chosen explicitly: that is how CI checks them.
"""
from __future__ import annotations

import os

import torch

from flashrt.dispatch import collect_module_attrs
from flashrt.hookspecs import Backend, hookimpl


def interpreter() -> bool:
    """Triton runs kernels in its interpreter (numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:
        return None
    return triton.__version__


def supports_cuda() -> tuple[bool, str]:
    if _triton_version() is None:
        return False, "triton is not installed (pip install 'flashrt[cuda]')"
    if interpreter():
        return True, ""
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"compute capability sm_{major}{minor} is below sm_80"
    return True, ""


def collect_kernels() -> tuple[dict, dict, dict]:
    """(ops, supports, load errors) from every module of flashrt.kernels_cuda."""
    (ops, supports), errors = collect_module_attrs("flashrt.kernels_cuda", "OPS", "SUPPORTS")
    return ops, supports, errors


@hookimpl
def flashrt_backend():
    ok, _ = supports_cuda()
    ops, supports = {}, {}
    if ok and not interpreter():
        from flashrt import jit

        jit.install()  # compiled kernels go through flashrt's locked, checksummed cache
    if ok or _triton_version() is not None:
        ops, supports, _ = collect_kernels()
    return Backend(
        name="cuda",
        device_types=("cuda",),
        explicit_device_types=("cpu",) if interpreter() else (),
        ops=ops,
        supports=supports,
        priority=50,
        is_available=supports_cuda,
        description="Triton kernels (kernels_cuda); CPU tensors under TRITON_INTERPRET=1 when chosen explicitly",
    )
