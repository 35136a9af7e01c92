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

import torch

from flashrt.dispatch import collect_module_attrs
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


def kernel_modules() -> list[tuple[str, object]]:
    """(name, module or the exception its import raised) for each module of flashrt.kernels_cuda."""
    import importlib
    import pkgutil

    import flashrt.kernels_cuda as pkg

    out = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        try:
            out.append((info.name, importlib.import_module(f"{pkg.__name__}.{info.name}")))
        except Exception as exc:  # report it; the other modules still warm up
            out.append((info.name, exc))
    return out


def warmup_hooks() -> list[tuple[str, object]]:
    """(module, its ``warmup(profile)`` hook, None, or its import error) of the op modules and of
    helpers with a hook."""
    out = []
    for name, mod in kernel_modules():
        hook = mod if isinstance(mod, BaseException) else getattr(mod, "warmup", None)
        if hook is not None or hasattr(mod, "OPS"):
            out.append((name, hook))
    return out


def collect_kernels() -> tuple[dict, dict, dict]:
    """(ops, supports, load errors) from every module of flashrt.kernels_cuda."""
    (ops, supports, _), errors = collect_module_attrs("flashrt.kernels_cuda", "OPS", "SUPPORTS", "ZERO_COPY")
    return ops, supports, errors


def zero_copy() -> dict:
    """op -> ``(device) -> bool`` of the kernels that read pinned host memory in place."""
    return collect_module_attrs("flashrt.kernels_cuda", "ZERO_COPY")[0][0]


@hookimpl
def flashrt_backend():
    ok, _ = supports_cuda()
    ops, supports, copies = {}, {}, {}
    if ok and not interpreted():
        from flashrt import jit

        jit.install()  # compiled kernels go through flashrt's locked, checksummed cache
    if ok or _triton_version() is not None:
        ops, supports, _ = collect_kernels()
        copies = zero_copy()
    return Backend(
        name="cuda",
        device_types=("cuda",),
        explicit_device_types=("cpu",) if interpreted() else (),
        ops=ops,
        supports=supports,
        zero_copy=copies,
        priority=50,
        is_available=supports_cuda,
        warmup_hooks=warmup_hooks,
        description="Triton kernels (kernels_cuda); CPU tensors under TRITON_INTERPRET=1 when chosen explicitly",
    )
