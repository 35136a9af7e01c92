"""Ahead-of-time compilation (``flashrt jit warmup``, :func:`flashrt.jit.warmup`) through the backends.

The kernel families the registered backends declare (``Backend.families``, reached through
dispatch: nothing is imported here) carry their warm-up hooks. A hook
compiles its kernels at the profile's tiles (``flashrt.profiles.tiles``) for the shapes the model
launches, through Triton's cache (ours, after ``flashrt.jit.install()``). It returns None or a
dict: ``{"launches": n, ...}`` when it compiled, ``{"skipped": why}`` (or just ``why``) when it
cannot here (no CUDA device): never an error for that. The report lists warmed, skipped (with why,
in ``notes``) and failed hooks; one broken hook does not stop the others.

Given the models' dims (``models``; ``flashrt jit warmup`` passes them) and a CUDA device, the
variants the hooks launch are first compiled on a pool of processes (:mod:`flashrt.jit_parallel`),
so the hooks then load them from the cache; the pool's report is ``precompile``, and a variant it
could not compile is listed in ``failed`` under ``compile <kernel>``.
"""
from __future__ import annotations

import logging
import multiprocessing
import time

from . import dispatch, profiles
from .jit import install
from .jit_triton import interpreted
from .progress import Progress

log = logging.getLogger("flashrt")


def warmup_targets() -> list[tuple[str, object]]:
    """(family name, its warm-up hook or None) of every family of the backends that compile ahead
    (those with at least one hook), in registration order; a name two backends share is prefixed
    with the backend's."""
    out, seen = [], set()
    for backend, fams in dispatch.families().items():
        if not any(f.warmup for f in fams):
            continue
        for fam in fams:
            name = fam.name if fam.name not in seen else f"{backend}:{fam.name}"
            seen.add(fam.name)
            out.append((name, fam.warmup))
    return out


PRECOMPILE_TIMEOUT = 1800.0  # seconds the warm-up waits for its pool (a hung compiler must not hang it)


def warmup(profile=None, targets=None, progress=None, models: dict | None = None) -> dict:
    """Run each hook with ``profile`` active (a Profile, name or path; default: the active one) and
    Triton's cache routed through ours. ``targets``: (name, hook) pairs (default:
    :func:`warmup_targets`); a hook of None is listed as skipped, an exception as failed.
    ``models`` (name -> kernel dims): first compile the hooks' variants at these dims in parallel."""
    pool = precompile_pool(models)  # forked before this process makes a CUDA context
    try:
        profile = profiles.load_profile(profile) if isinstance(profile, str) else profile or profiles.active_profile()
        targets = warmup_targets() if targets is None else list(targets)
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    progress = progress or Progress(f"jit warmup {profile.name}")
    report = {"profile": profile.name, "warmed": [], "skipped": [], "failed": {}, "notes": {}, "seconds": 0.0}
    install()
    t0 = time.perf_counter()
    if pool is not None:
        _precompile(pool, profile, models, targets, report)
    with profiles.using(profile):
        for done, (name, hook) in enumerate(targets, 1):
            if isinstance(hook, BaseException):
                report["failed"][name] = f"import: {type(hook).__name__}: {hook}"
            elif hook is None:
                report["skipped"].append(name)
            else:
                _call_hook(name, hook, profile, report)
            progress(done, len(targets))
    report["seconds"] = time.perf_counter() - t0
    return report


def _call_hook(name: str, hook, profile, report: dict) -> None:
    """Run one hook; a dict it returns with ``skipped`` (no device) marks it skipped, with why."""
    t0 = time.perf_counter()
    try:
        result = hook(profile)
    except Exception as exc:  # one broken hook must not stop the others
        report["failed"][name] = f"{type(exc).__name__}: {exc}"
        return
    if isinstance(result, str):  # a hook may return just why it had nothing to compile
        result = {"skipped": result}
    result = result if isinstance(result, dict) else {}
    if result.get("skipped"):
        report["skipped"].append(name)
        report["notes"][name] = str(result["skipped"])
        return
    report["warmed"].append(name)
    launches = f"{result['launches']} launches, " if "launches" in result else ""
    report["notes"][name] = f"{launches}{time.perf_counter() - t0:.1f} s"


def precompile_pool(models: dict | None):
    """A :class:`flashrt.jit_parallel.Precompile` pool when ``models`` are given and kernels can be
    compiled here (a CUDA device, Triton not interpreted, ``fork``, ``FLASHRT_JIT_WORKERS`` not 0);
    else None."""
    if not models or interpreted() or "fork" not in multiprocessing.get_all_start_methods():
        return None
    import torch

    from .jit_parallel import Precompile, worker_count

    if not torch.cuda.is_available() or worker_count() == 0:
        return None
    dispatch.families()  # the backends and their kernel modules, imported once here for every worker
    try:
        return Precompile()
    except (OSError, RuntimeError) as exc:  # no processes to be had (limits, memory), or a worker died at
        # its start (BrokenProcessPool): compile in this process as before
        log.warning("flashrt.jit: no compile pool (%s); kernels compile at their first launch", exc)
        return None


def _precompile(pool, profile, models: dict, targets, report: dict) -> None:
    """Compile the variants of the hooks' launches at ``models`` (and of the models' plans) on
    ``pool``; into ``report``. A plan's variant that does not compile is a note (a plan is a hint
    that may predate a kernel change), a warm-up case's a failure."""
    from .jit_targets import device_arch

    try:
        arch = device_arch()
        if arch.capability < (8, 0):
            return
        sources = [(name, hook.cases) for name, hook in targets if callable(getattr(hook, "cases", None))]
        result = pool.start(arch, profile, models, sources, launcher=True).result(PRECOMPILE_TIMEOUT)
    finally:
        pool.close()
    report["precompile"] = result
    stale = [row["kernel"] for row in result["failed"] if row["family"] == "plan"]
    if stale:
        report["notes"]["plan"] = f"{len(stale)} planned variants did not compile (a plan older than the kernels?): " \
                                  f"{', '.join(sorted(set(stale)))}"
    for row in result["failed"]:
        if row["family"] != "plan":
            report["failed"][f"compile {row['kernel'] or row['family']}"] = row["error"]
    if not result["done"]:
        report["failed"]["compile"] = f"the pool did not finish within {PRECOMPILE_TIMEOUT:.0f} s"
