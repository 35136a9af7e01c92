"""The kernel compiles of ``flashrt run`` and ``flashrt serve`` started before the model loads
(:mod:`flashrt.jit_parallel`; the server's: :func:`compiles_beside`).

On a CUDA device, with the CUDA kernels in use, the run forks a pool of compile workers before it
makes a CUDA context; once the profile is known, the pool plans the variants the kernel families'
warm-up launches compile at the model's dims on this device and compiles them into the compile
cache while the checkpoint is made or loaded. The run does not wait for it: a launch whose variant
a worker is compiling waits for that compile (the cache's per-key lock) and then loads it, one no
worker has reached is compiled by the run itself. ``FLASHRT_JIT_WORKERS`` sets the number of
workers (default: the CPUs the process may use; 0: no pool, every variant compiled at its first
launch), as for ``flashrt jit warmup``.
The variants the run loaded are added to the model's plan (:mod:`flashrt.jit_plans`), which the
next pool compiles too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
from types import SimpleNamespace

import torch

from flashrt.graphs.config import ModelConfig

log = logging.getLogger("flashrt")


def kernel_dims(cfg: ModelConfig) -> dict:
    """The config's values by key, as the kernel families' warm-up launches read them
    (``warmup_cases(device, dims, dtype)``): each compression ratio once, and no ``vision_*`` keys
    without a vision tower."""
    dims = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    dims["compress_ratios"] = tuple(sorted(set(cfg.compress_ratios)))
    return dims if cfg.vision_enabled else {k: v for k, v in dims.items() if not k.startswith("vision_")}


def start_precompile(cfg: ModelConfig | None, dev: torch.device, backend: str | None):
    """Fork the compile pool (:mod:`flashrt.jit_parallel`) for a model of config ``cfg`` when the
    run launches Triton kernels on a CUDA device, before this process makes a CUDA context; ``(pool,
    {name: dims})``, or ``(None, None)``."""
    from flashrt.jit_warmup import precompile_pool

    if cfg is None or dev.type != "cuda" or backend not in (None, "cuda"):
        return None, None
    models = {cfg.name: kernel_dims(cfg)}
    pool = precompile_pool(models)
    return (pool, models) if pool is not None else (None, None)


def begin(pool, dev: torch.device, profile, models: dict):
    """Start ``pool`` planning and compiling ``models`` for this device under ``profile``; the pool,
    or None when it could not start (logged: the kernels then compile at their first launch)."""
    if pool is None:
        return None
    from flashrt.jit_targets import device_arch

    try:
        return pool.start(device_arch(dev.index), profile, models, launcher=True)
    except Exception as exc:
        log.warning("flashrt.jit: the compile pool did not start (%s: %s)", type(exc).__name__, exc)
        pool.close()
        return None


def _compiled_cuda(dev: torch.device, backend: str | None) -> bool:
    """Whether the run launches compiled Triton kernels: a CUDA device, the CUDA backend (or the
    default), Triton not interpreted."""
    if dev.type != "cuda" or backend not in (None, "cuda"):
        return False
    from flashrt.jit_triton import interpreted

    return not interpreted()


def start_triton_key(dev: torch.device, backend: str | None):
    """Start hashing Triton's own sources and library on a thread (``triton_key``: once a process,
    cached, about 0.3 s of file reads and SHA-256, most of it outside the GIL), when the run will
    load Triton kernels on a CUDA device: the first kernel the run loads or compiles needs it, and
    the model loads meanwhile. Call it after the compile pool is forked (a thread before a fork is
    not safe). The thread, or None."""
    if not _compiled_cuda(dev, backend):
        return None
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # no Triton: no kernels to load
        return None

    def run():
        try:
            triton_key()
        except Exception as exc:  # the first kernel load computes it again and raises the real error
            log.debug("flashrt.jit: triton_key on a thread: %s: %s", type(exc).__name__, exc)

    thread = threading.Thread(target=run, name="flashrt-triton-key", daemon=True)
    thread.start()
    return thread


def start_preload(dev: torch.device, backend: str | None, profile, cfg: ModelConfig | None):
    """Load the cached variants of the model's plan into their kernels on a thread while the model
    loads (:mod:`flashrt.jit_preload`; opt-in, ``FLASHRT_JIT_PRELOAD=1``), when the run launches
    compiled Triton kernels on a CUDA device; the preload (``join()`` it before the first forward),
    or None."""
    from flashrt import jit_plans, jit_preload

    if cfg is None or not _compiled_cuda(dev, backend) or not jit_preload.enabled():
        return None
    from flashrt.jit_targets import device_arch

    try:
        return jit_preload.start(device_arch(dev.index), jit_plans.profile_names(profile), cfg.name, dev.index)
    except Exception as exc:  # no plan to read, no Triton: the launches load their kernels as before
        log.warning("flashrt.jit: no preload (%s: %s)", type(exc).__name__, exc)
        return None


def start_recording(dev: torch.device, backend: str | None):
    """A :class:`flashrt.jit_plans.Recorder` of the kernel variants this run loads, when it runs
    Triton kernels on a CUDA device (their plan makes the next cold start compile them at once);
    else None."""
    if not _compiled_cuda(dev, backend):
        return None
    try:
        from flashrt.jit_plans import Recorder

        return Recorder()
    except ImportError:  # no Triton: no kernels to record
        return None


def start_compiles(cfg: ModelConfig | None, dev: torch.device, backend: str | None):
    """The compiles of a process about to load a model of config ``cfg``: the pool forked
    (:func:`start_precompile`; call this before any CUDA work), then Triton's key hashed on a thread
    and the variants this process loads recorded; ``(pool, dims, recorder, compiled_count())``."""
    pool, dims = start_precompile(cfg, dev, backend)
    start_triton_key(dev, backend)  # after the fork: a thread before a fork is not safe
    return pool, dims, start_recording(dev, backend), compiled_count()


def stop_compiles(pool, recorder) -> dict | None:
    """The pool's report, its compiles not yet started cancelled (None without a pool), and the
    recorder closed."""
    precompiled = pool.result(timeout=0) if pool is not None else None
    if recorder is not None:
        recorder.close()
    return precompiled


def plan_model(cfg: ModelConfig | None, loaded: ModelConfig) -> str:
    """The name a run's plan is kept under: that of the config its compile pool read before the
    model loaded (``cfg``, from :func:`flashrt.engine.run.model_config`; a built-in model's
    checkpoint names itself ``<name>-seed<N>``, which no pool reads), else the loaded one's."""
    return cfg.name if cfg is not None else loaded.name


def save_plan(recorder, dev: torch.device, profile, model: str, last: bool = False) -> int:
    """Add what ``recorder`` saw to the plan of ``model`` on this device and ``profile`` (``last``:
    after the plan's entries, :func:`flashrt.jit_plans.save`); the new variants (0 without a recorder)."""
    if recorder is None:
        return 0
    from flashrt.jit_plans import save
    from flashrt.jit_targets import device_arch

    try:
        return save(device_arch(dev.index), profile.name, model, recorder.entries(), last)
    except OSError as exc:  # a read-only or full cache: the run's result stands, its plan is not kept
        log.warning("flashrt.jit: the plan of %s is not updated (%s)", model, exc)
        return 0


def compiled_count() -> int:
    """How many kernels this process has compiled itself so far (see :func:`jit_report`)."""
    triton_cache = sys.modules.get("flashrt.jit_triton")  # not imported: nothing was compiled through it
    return len(triton_cache.compiled_here()) if triton_cache else 0


def jit_report(precompiled: dict | None, plan_added: int = 0, since: int = 0, preloaded: dict | None = None) -> dict:
    """What the compile pool did (None: no pool), the kernels this process compiled itself after
    the ``since``-th (none when everything came from the cache or the pool), the variants added
    to the model's plan and what the preload loaded (None: none ran)."""
    triton_cache = sys.modules.get("flashrt.jit_triton")
    return {"precompile": precompiled, "plan_added": plan_added, "preload": preloaded,
            "compiled_in_process": triton_cache.compiled_here()[since:] if triton_cache else []}


@contextlib.contextmanager
def compiles_beside(model: str, dev: torch.device, backend: str | None = None):
    """The kernel compiles of a process that loads ``model`` and warms it up inside the block (``flashrt
    serve``): as :func:`flashrt.engine.run.run_with_model` does, the pool forked before the CUDA
    context (call this before any CUDA work) and started under the profile the load must use; Triton's
    key hashed on a thread; every variant the block loads recorded. Yields a namespace: ``profile``
    (pass it to the load), ``cfg`` (set it to the loaded model's config: the plan is kept under that
    model's name when the block ends without an error), and after the block ``report`` (as
    ``flashrt run``'s ``jit``; None until then, and on CPU). The variants the block loaded go after
    the plan's entries (a run's cold start keeps compiling its own first). The pool's compiles not
    started when the block ends are cancelled: serving does not share the CPUs with them."""
    from flashrt.engine.run import model_config
    from flashrt.graphs.loader import resolve_profile

    cfg = model_config(model) if dev.type == "cuda" else None
    pool, dims, recorder, before = start_compiles(cfg, dev, backend)
    state = SimpleNamespace(profile=resolve_profile(None, dev), cfg=None, report=None)
    pool = begin(pool, dev, state.profile, dims)
    try:
        yield state
    finally:
        precompiled = stop_compiles(pool, recorder)
    if state.cfg is not None and (pool is not None or recorder is not None):  # Triton kernels launched here
        added = save_plan(recorder, dev, state.profile, plan_model(cfg, state.cfg), last=True)
        state.report = jit_report(precompiled, added, before)
