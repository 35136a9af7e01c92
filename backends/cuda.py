"""CUDA backend: binds the ops to the Triton kernels of ``flashrt.kernels_cuda``.

The kernel package lists its families (``kernels_cuda.FAMILIES``); each declares its ops, what
they serve (checked once per call key by dispatch), its tiles and its warm-up. A call a family
declines goes to the next backend (the reference) in automatic mode, logged once, or fails with
``BackendError`` when ``cuda`` was chosen explicitly. With ``TRITON_INTERPRET=1`` (set before
flashrt is imported) the kernels also run on CPU tensors, but only when the backend is chosen
explicitly: that is how CI checks them.
"""
from __future__ import annotations

import torch

from flashrt.families import family_tables
from flashrt.hookspecs import Backend, hookimpl
from flashrt.jit_triton import interpreted


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:
        return None
    return triton.__version__


def supports_cuda() -> tuple[bool, str]:
    if _triton_version() is None:
        return False, "triton is not installed (pip install 'flashrt[cuda]')"
    if interpreted():
        return True, ""
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"compute capability sm_{major}{minor} is below sm_80"
    return True, ""


def kernel_families() -> tuple:
    """The families of ``flashrt.kernels_cuda`` (imports Triton and every kernel module)."""
    from flashrt.kernels_cuda import FAMILIES

    return FAMILIES


@hookimpl
def flashrt_backend():
    ok, _ = supports_cuda()
    families = ()
    if ok and not interpreted():
        from flashrt import jit

        jit.install()  # compiled kernels go through flashrt's locked, checksummed cache
    if ok or _triton_version() is not None:
        families = kernel_families()
    return Backend(
        name="cuda",
        device_types=("cuda",),
        explicit_device_types=("cpu",) if interpreted() else (),
        **family_tables(families),
        families=families,
        priority=50,
        is_available=supports_cuda,
        description="Triton kernels (kernels_cuda); CPU tensors under TRITON_INTERPRET=1 when chosen explicitly",
    )
