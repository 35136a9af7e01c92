"""Cross-compilation without a GPU (``flashrt jit compile --arch sm_80 sm_89 sm_90``).

For each architecture, each shipped CUDA profile of a device of that architecture (its
``match_capability``) is made active and every kernel family's warm-up launches
(``KernelFamily.warmup_cases``, reached through dispatch) run on CPU tensors at the shipped models'
dims, with the device facts of that architecture (:mod:`flashrt.jit_targets`) and a stand-in
Triton driver reporting its target. Triton's ``_do_compile`` is replaced for the duration: each
specialization a launcher would compile is recorded, not compiled or launched. Each distinct
(kernel, signature, constexprs, options) is then compiled by ``triton.compile`` with the ``ptxas``
Triton ships, and the cubin's resource usage is read with its ``cuobjdump``: registers, local
memory (``spill_bytes``: the per-thread stack frame ptxas gives spilled registers and local
arrays), shared memory against the architecture's per-block limit. A compiler error, a
launcher that raises, or shared memory over the limit is a failure.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import torch

from . import dispatch, dtypes, profiles
from .jit_targets import Arch, targeting


@dataclass
class Variant:
    """One kernel specialization a run launches on one architecture."""

    arch: Arch
    fn: object
    signature: dict
    constexprs: dict
    options: object
    attrs: dict
    families: set = field(default_factory=set)
    launches: set = field(default_factory=set)
    profiles: set = field(default_factory=set)

    @property
    def kernel(self) -> str:
        return self.fn.__name__

    def describe(self) -> dict:
        """The constexpr arguments by name (values JSON can hold)."""
        names = self.fn.arg_names
        return {names[k[0]]: _shown(v) for k, v in self.constexprs.items() if isinstance(k, tuple) and len(k) == 1}


def _shown(v) -> object:
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)


class _StandInDriver:
    """The parts of Triton's active driver a launch or a compile asks for, answering as one GPU of
    compute capability ``cc`` (an :class:`Arch` or its number). Its device id is that number, so
    Triton's per-device binders (which hold the target's backend and options) are never shared
    between architectures."""

    def __init__(self, arch: Arch | int):
        from triton.backends.compiler import GPUTarget

        self.cc = arch if isinstance(arch, int) else arch.cc
        self.target = GPUTarget("cuda", self.cc, 32)

    def get_current_device(self):
        return self.cc

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def recording(arch: Arch, record):
    """Triton launches inside the block call ``record(fn, signature, constexprs, options, attrs)``
    instead of compiling and launching; the device facts are ``arch``'s."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        record(self, signature, constexprs, options, attrs)
        return None  # run() returns before launching

    real, active = JITFunction._do_compile, driver._active
    driver.set_active(_StandInDriver(arch))
    JITFunction._do_compile = _do_compile
    try:
        with targeting(arch):
            yield
    finally:
        JITFunction._do_compile = real
        driver._active = active  # (reset_active would make a real driver: none exists without a GPU)


def cuda_profiles(arch: Arch) -> list:
    """The shipped CUDA profiles of devices of ``arch`` (``match_capability``), by name."""
    cap = f"{arch.capability[0]}.{arch.capability[1]}"
    out = []
    for name in sorted(profiles.available_profiles()):
        p = profiles.load_profile(name)
        if p.backend == "cuda" and cap in p.match_capability:
            out.append(p)
    return out


def launch_sources() -> list[tuple[str, object]]:
    """(family name, its ``warmup_cases``) of every CUDA kernel family that declares launches."""
    return [(fam.name, fam.warmup_cases) for fam in dispatch.families().get("cuda", ()) if fam.warmup_cases]


def kernel_name(fn) -> str:
    """The name a ``triton.jit`` kernel has in its module (the qualified name of the function it wraps)."""
    return getattr(fn, "fn", fn).__qualname__


def variant_key(module: str, name: str, signature: dict, constexprs: dict, attrs: dict, options: dict) -> tuple:
    """What tells two kernel variants apart: Triton's cache key less the source and the target's
    facts (the kernel by module and name, its signature, constexprs, specialization attributes and
    compile options)."""
    return (module, name, repr(signature), repr(sorted(constexprs.items(), key=repr)),
            repr(sorted(attrs.items(), key=repr)), repr(sorted(options.items(), key=repr)))


def collect(arch: Arch, profile, models: dict, sources, variants: dict, failures: list) -> int:
    """Record every specialization ``sources`` launch under ``profile`` on ``arch`` into ``variants``
    (keyed: one entry per distinct compile: kernel, signature, constexprs, specialization attributes
    such as pointer alignment, options); a launcher that raises goes to ``failures``. Returns
    the number of launches made."""
    where = {}

    def record(fn, signature, constexprs, options, attrs):
        key = variant_key(fn.__module__, kernel_name(fn), signature, constexprs, attrs, options.__dict__)
        v = variants.setdefault(key, Variant(arch, fn, signature, constexprs, options, attrs))
        v.families.add(where["family"])
        v.launches.add(where["launch"])
        v.profiles.add(profile.name)

    launches = 0
    dtype = dtypes.activation_dtype(profile.compute_dtype)
    with profiles.using(profile), recording(arch, record):
        for family, cases in sources:
            for model, dims in models.items():
                where["family"] = family
                try:
                    for launch in cases(torch.device("cpu"), dims, dtype):
                        where["launch"] = launch.name
                        launches += 1
                        launch.fn(*launch.args)
                except Exception as exc:  # a launcher that cannot plan this case: a failure, the others go on
                    failures.append({"arch": arch.name, "profile": profile.name, "family": family, "model": model,
                                     "kernel": None, "status": "failed",
                                     "error": f"launcher: {type(exc).__name__}: {exc}"})
    return launches


def compile_kernel(fn, signature: dict, constexprs: dict, attrs: dict, options: dict, cc: int) -> tuple[object, str | None]:
    """``triton.compile`` of one variant for a CUDA device of compute capability ``cc``, into the
    active compile cache: (the compiled kernel, None), or (None, the compiler's message)."""
    import triton

    try:
        with contextlib.redirect_stdout(io.StringIO()), answering_as(cc) as target:  # (ptxas errors print the PTX)
            return triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options), None
    except Exception as exc:
        return None, compiler_error(exc)


def source(fn, signature: dict, constexprs: dict, attrs: dict):
    """What ``triton.compile`` takes for a kernel: a Gluon kernel's source is its own kind."""
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource(fn, signature, constexprs, attrs)
    from triton.compiler import ASTSource

    return ASTSource(fn, signature, constexprs, attrs)


@contextlib.contextmanager
def answering_as(cc: int):
    """Triton's active driver answers as a GPU of compute capability ``cc`` inside the block (yields
    its target). Kernels branch on the target at compile time (``cuda_capability_geq``, read from
    the active driver, not from the target ``triton.compile`` is given): without this, compiling
    for sm_80 on an sm_90 machine would take the sm_90 branches, and compiling on a machine
    without a GPU would take the oldest ones."""
    from triton.runtime.driver import driver

    stand_in, active = _StandInDriver(cc), driver._active
    driver.set_active(stand_in)
    try:
        yield stand_in.target
    finally:
        driver._active = active


def compile_variant(v: Variant) -> dict:
    """Compile one recorded specialization for its architecture; its report row."""
    row = {"arch": v.arch.name, "kernel": v.kernel, "families": sorted(v.families), "launches": sorted(v.launches),
           "profiles": sorted(v.profiles), "constexprs": v.describe(), "num_warps": v.options.num_warps,
           "num_stages": v.options.num_stages, "smem_limit": v.arch.smem_limit}
    t0 = time.perf_counter()
    kernel, error = compile_kernel(v.fn, v.signature, v.constexprs, v.attrs, v.options.__dict__, v.arch.cc)
    if error is not None:
        return row | {"status": "failed", "error": error, "seconds": round(time.perf_counter() - t0, 2)}
    usage = resource_usage(kernel.asm["cubin"])
    shared = max(int(kernel.metadata.shared), usage.get("shared", 0))
    row |= {"registers": usage.get("registers"), "spill_bytes": usage.get("stack"), "shared_bytes": shared, "seconds": round(time.perf_counter() - t0, 2)}
    if shared > v.arch.smem_limit:
        return row | {"status": "failed", "error": f"shared memory {shared} B exceeds the {v.arch.name} per-block "
                                                   f"limit of {v.arch.smem_limit} B ({v.arch.device})"}
    return row | {"status": "compiled", "error": None}


def compiler_error(exc: BaseException, n: int = 6) -> str:
    """The compiler's message, innermost cause first (Triton wraps it in CompilationErrors that
    each hold a source excerpt): its last ``n`` lines, then the line each wrapper points at."""
    chain = []
    while exc is not None and len(chain) < 8:
        chain.append([line for line in f"{type(exc).__name__}: {exc}".splitlines() if line.strip()])
        exc = exc.__cause__ or exc.__context__
    inner, *outer = reversed(chain)
    where = [lines[-2].strip() for lines in outer if len(lines) >= 2]
    return "\n".join(inner[-n:] + [f"  in: {w}" for w in where])


def resource_usage(cubin: bytes) -> dict:
    """REG / STACK / SHARED / LOCAL of a cubin's kernel, from the ``cuobjdump`` Triton ships."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    return {"registers": found.get("reg"), **{k: found[k] for k in ("stack", "shared", "local") if k in found}}


def cross_compile(archs, models: dict, sources=None, progress=None) -> dict:
    """Compile every kernel variant the ``sources`` (default: :func:`launch_sources`) launch at
    ``models`` (name -> dims) under each CUDA profile of each of ``archs``. The report: ``rows``
    (one per distinct variant and architecture, plus launcher failures), ``failed`` (their count),
    per-architecture ``profiles`` and ``launches``, ``seconds``."""
    sources = launch_sources() if sources is None else list(sources)
    t0 = time.perf_counter()
    report = {"archs": [a.name for a in archs], "models": sorted(models), "profiles": {}, "launches": {}, "rows": []}
    for arch in archs:
        plist = cuda_profiles(arch)
        if not plist:
            raise ValueError(f"--arch {arch.name}: no shipped CUDA profile has match_capability "
                             f"{arch.capability[0]}.{arch.capability[1]}")
        variants, failures, launches = {}, [], 0
        for profile in plist:
            launches += collect(arch, profile, models, sources, variants, failures)
        report["profiles"][arch.name] = [p.name for p in plist]
        report["launches"][arch.name] = launches
        report["rows"] += failures
        for done, v in enumerate(variants.values(), 1):
            report["rows"].append(compile_variant(v))
            if progress:
                progress(arch.name, done, len(variants), report["rows"][-1])
    report["failed"] = sum(r["status"] != "compiled" for r in report["rows"])
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report
