"""Loading a model's planned kernel variants from the compile cache while the model loads.

A process's first launch of each kernel variant goes through Triton's compile path even when the
variant is in the compile cache: the cache key (and once a process Triton's own, ``triton_key``),
the cached group read and checked, the kernel object made, then at the launch its binary loaded
into the device's context and its launcher made. A run of ``small`` loads about two hundred
variants, so a warm run's prefill spends most of its time there. ``start`` does that work for the
variants of the model's plan (:mod:`flashrt.jit_plans`, the variants earlier runs loaded) on a
thread while the model loads, through Triton's ``JITFunction.preload`` (which files each kernel in
its function's in-memory cache under the key a launch of that specialization computes), under
:func:`flashrt.jit_triton.cached_only`: a variant not in the cache, or being compiled by the pool
now, is skipped without waiting (the pool or the launch compiles it). The run joins the thread
before its first forward, so no CUDA graph capture runs beside it.

Opt-in: ``FLASHRT_JIT_PRELOAD=1`` (off until timed on a GPU; docs/performance.md).
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
import time

log = logging.getLogger("flashrt")
PRELOAD_ENV = "FLASHRT_JIT_PRELOAD"
JOIN_TIMEOUT = 120.0  # seconds a run waits for the preload after its model has loaded, then stops it


def enabled() -> bool:
    return os.environ.get(PRELOAD_ENV, "").strip() == "1"


def _function(entry: dict):
    """The ``triton.jit`` function a plan entry names, or None."""
    from triton.runtime.jit import JITFunction

    try:
        obj = importlib.import_module(str(entry["module"]))
        for part in str(entry["name"]).split("."):
            obj = getattr(obj, part, None)
    except ImportError:
        return None
    return obj if isinstance(obj, JITFunction) else None


class Preload:
    """A thread loading ``entries`` (plan entries: module, name, Triton's specialization data)
    into their kernels for CUDA device ``device_index``; ``join()`` waits and reports."""

    def __init__(self, entries: list[dict], device_index: int, handles: bool = True):
        self._stop = threading.Event()
        self.report = {"entries": len(entries), "loaded": 0, "not_cached": 0, "failed": 0, "seconds": None,
                       "done": False}
        self._thread = threading.Thread(target=self._run, args=(entries, device_index, handles),
                                        name="flashrt-preload", daemon=True)
        self._thread.start()

    def _run(self, entries: list[dict], device_index: int, handles: bool) -> None:
        from .jit_triton import NotCached, cached_only

        t0, report = time.perf_counter(), self.report
        try:
            if device_index is not None:
                import torch

                torch.cuda.set_device(device_index)  # Triton asks the current device; its context here
            for entry in entries:
                if self._stop.is_set():
                    break
                try:
                    fn = _function(entry)
                    if fn is None:
                        report["failed"] += 1
                        continue
                    with cached_only():
                        kernel = fn.preload(entry["data"])
                    init = getattr(kernel, "_init_handles", None)
                    if handles and init is not None:
                        init()  # the binary into the context, the launcher made: the launch's first work
                    report["loaded"] += 1
                except NotCached:
                    report["not_cached"] += 1
                except Exception as exc:  # a stale or foreign entry: its launch (if any) compiles it
                    report["failed"] += 1
                    log.debug("flashrt.jit: preload of %s.%s: %s: %s", entry.get("module"), entry.get("name"),
                              type(exc).__name__, exc)
        except Exception as exc:
            log.warning("flashrt.jit: the preload stopped (%s: %s)", type(exc).__name__, exc)
        finally:
            report["seconds"] = round(time.perf_counter() - t0, 3)
            report["done"] = True

    def join(self, timeout: float = JOIN_TIMEOUT) -> dict:
        """Wait for the thread (at most ``timeout`` seconds, then stop it after its current entry);
        the report: ``entries``, ``loaded``, ``not_cached``, ``failed``, ``seconds``, ``done``."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        return dict(self.report)


def start(arch, profile, model: str, device_index: int | None, handles: bool = True) -> Preload | None:
    """Preload the plan of (``arch``, ``profile``, ``model``) on a thread when ``FLASHRT_JIT_PRELOAD``
    is 1 and the plan has entries (``profile``: a name or a lineage, :func:`.jit_plans.plan_paths`);
    the :class:`Preload`, or None."""
    if not enabled():
        return None
    from .jit_plans import entries

    found = entries(arch, profile, model)
    return Preload(found, device_index, handles) if found else None
