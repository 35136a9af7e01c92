"""Compiling the kernel variants a run needs on a pool of processes, into the compile cache.

``flashrt jit warmup`` (on a CUDA device) and the start of ``flashrt run`` use it:

1. plan: every kernel family's warm-up launches (``KernelFamily.warmup_cases``, reached through
   dispatch) are made at a model's dims with the profile active and the device's facts (compute
   capability, SM count: :mod:`flashrt.jit_targets`), with Triton's compile replaced by a record
   (:func:`flashrt.jit_compile.recording`): one :class:`Spec` per distinct (kernel, signature,
   constexprs, specialization attributes, options), exactly what the launcher would compile on
   that device; to these come the variants earlier runs of the model used on this device and
   profile (their plan, :mod:`flashrt.jit_plans`: token counts and routing the warm-up shapes miss),
   which go to the workers first, in the order the runs first launched them, before a worker plans
   the warm-up's (a run that starts launching while that planning runs finds its variants begun);
2. compile: forked worker processes each compile a share with ``triton.compile`` for the device's
   target. Triton's cache key covers the source, the constexprs and signature, the options and the
   target, and the cache is flashrt's (:mod:`flashrt.jit_triton`: atomic writes, a per-key lock, so
   one key is compiled once however many processes ask); where the device's driver is present each
   worker also builds the kernel's launcher (a C stub compiled with the host compiler on Triton
   versions that make one) into the same cache. The launch in the main process then loads both.

Planning runs in a worker too (``Precompile``): recording patches Triton process-wide, which must
not happen beside the main process's own launches. Workers are forked before the main process
touches CUDA, run with one torch thread and never use the device. A compile error is a row naming
the kernel (never raised: the run's own launch then compiles it and raises the real error); a
worker that dies fails the variants it had and the pool stops; nothing waits without a limit.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import queue
import threading
import time
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from .jit_targets import Arch

WORKERS_ENV = "FLASHRT_JIT_WORKERS"  # processes compiling at once; 0 turns the pool off
WORKER_NICENESS = 10  # added to a worker's niceness: the parent process comes first for the CPUs


@dataclass(frozen=True)
class Spec:
    """One kernel variant, in a form a worker process can receive (the kernel by module and name)."""

    module: str
    name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    cc: int
    families: tuple = ()
    launches: tuple = ()


def worker_count(tasks: int | None = None) -> int:
    """``FLASHRT_JIT_WORKERS`` (0: no pool), else the CPUs this process may use; at most ``tasks``."""
    raw = os.environ.get(WORKERS_ENV, "")
    try:
        n = int(raw) if raw.strip() else len(os.sched_getaffinity(0))
    except ValueError:
        raise ValueError(f"{WORKERS_ENV}: expected an int >= 0, got {raw!r}") from None
    if n < 0:
        raise ValueError(f"{WORKERS_ENV}: expected an int >= 0, got {raw!r}")
    return n if tasks is None else min(n, tasks)


def plan(arch: Arch, profile, models: dict, sources=None, plans: bool = True) -> tuple[list[Spec], list[dict]]:
    """The variants the families' warm-up launches (``sources``: (family, warmup_cases) pairs;
    default every CUDA family's) compile at ``models`` (name -> dims) under ``profile`` on
    ``arch``, then (``plans``) those earlier runs of these models used there
    (:mod:`flashrt.jit_plans`); and the launchers that raised (rows naming the family and the error)."""
    from .jit_compile import collect, kernel_name, launch_sources

    variants, failures = {}, []
    collect(arch, profile, models, launch_sources() if sources is None else list(sources), variants, failures)
    cases = [Spec(v.fn.__module__, kernel_name(v.fn), v.signature, v.constexprs, v.attrs,
                  portable_options(v.options.__dict__), arch.cc, tuple(sorted(v.families)), tuple(sorted(v.launches)))
             for v in variants.values()]
    planned = planned_specs(arch, profile, models) if plans else []  # (a profile's lineage: its plans too)
    specs, seen = [], set()
    for s in planned + cases:  # a plan lists its variants in the order a run first used them: those first
        if spec_key(s) not in seen:
            seen.add(spec_key(s))
            specs.append(s)
    return specs, failures


def portable_options(options: dict) -> dict:
    """Triton's compile options without the default ``extern_libs`` (libdevice by its absolute path
    on the machine that recorded them): ``triton.compile`` fills in the local one, the same as a
    launch here passes, so the cache key is the one the launch computes."""
    options = dict(options)
    if {name for name, _ in options.get("extern_libs") or ()} <= {"libdevice"}:
        options.pop("extern_libs", None)
    return options


def spec_key(s: Spec) -> tuple:
    """What tells two variants apart (:func:`flashrt.jit_compile.variant_key`)."""
    from .jit_compile import variant_key

    return variant_key(s.module, s.name, s.signature, s.constexprs, s.attrs, s.options)


def resolve(spec: Spec):
    """The ``triton.jit`` function ``spec`` names (ValueError naming it when it is not one)."""
    from triton.runtime.jit import JITFunction

    obj = importlib.import_module(spec.module)
    for part in spec.name.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, JITFunction):
        raise ValueError(f"{spec.module}.{spec.name}: expected a triton.jit kernel, got {type(obj).__name__}")
    return obj


def compile_spec(spec: Spec, launcher: bool = False) -> dict:
    """Compile one variant into the cache (:func:`flashrt.jit_compile.compile_kernel`; its launcher
    too when ``launcher``); its report row: ``kernel``, ``status`` (compiled / failed), ``error``
    (the compiler's message), ``seconds``, ``launcher`` (True, or why it was not built), ``start``
    (unix time), ``pid``, ``cache_key`` (Triton's) and ``compiled`` (False: found in the cache)."""
    from .jit_compile import compile_kernel, compiler_error
    from .jit_log import ENV as LOG_ENV
    from .jit_triton import COMPILED, last_key

    row = {"kernel": f"{spec.module}.{spec.name}", "families": list(spec.families), "status": "compiled",
           "error": None, "launcher": None, "start": time.time(), "pid": os.getpid(), "cache_key": None,
           "compiled": False}
    t0, before = time.perf_counter(), len(COMPILED)
    try:
        fn = resolve(spec)
    except Exception as exc:  # the module or the kernel is gone (a stale plan entry): a failed row
        return row | {"status": "failed", "error": compiler_error(exc), "seconds": round(time.perf_counter() - t0, 2)}
    kernel, error = compile_kernel(fn, spec.signature, spec.constexprs, spec.attrs, spec.options, spec.cc)
    if error is not None:
        return row | {"status": "failed", "error": error, "seconds": round(time.perf_counter() - t0, 2)}
    row |= {"cache_key": last_key(), "compiled": len(COMPILED) > before}
    if os.environ.get(LOG_ENV, "").strip():  # the key's pieces, for the log's comparison
        row["parts"] = _key_parts(spec, fn)
    if launcher:
        row["launcher"] = build_launcher(kernel)
    return row | {"seconds": round(time.perf_counter() - t0, 2)}


def _key_parts(spec: Spec, fn) -> dict:
    """The pieces of the cache key ``spec`` compiles under (:func:`flashrt.jit_log.key_parts`), or
    the error computing them."""
    try:
        from triton.compiler.compiler import make_backend

        from .jit_compile import answering_as, source
        from .jit_log import key_parts

        with answering_as(spec.cc) as target:
            backend = make_backend(target)
            return key_parts(source(fn, spec.signature, spec.constexprs, spec.attrs), backend,
                             backend.parse_options(dict(spec.options)))
    except Exception as exc:  # a diagnostic: the compile's row stands
        return {"error": f"{type(exc).__name__}: {exc}"}


def build_launcher(kernel) -> bool | str:
    """Build a compiled kernel's launcher as its first launch would (Triton keeps the module it
    compiles in the cache, under a key of the launcher's source); True, or why not (a launcher is an
    optimisation: the launch builds it anyway). The NVIDIA launcher class is used directly, not
    through ``driver.active``: a forked worker must not make a driver (it would ask CUDA for the
    devices); Triton versions whose launcher needs the driver have no launcher to build."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception as exc:
        return f"not built: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return True


SLOWEST = 12  # the report's longest compiles, by kernel


def _tally(report: dict, row: dict) -> None:
    """A compiled row into ``report``: its seconds summed (``compile_seconds``: the workers' time,
    a cache hit's too) and kept among the ``SLOWEST`` longest (``slowest``: [seconds, kernel])."""
    seconds = float(row.get("seconds") or 0.0)
    report["compile_seconds"] = round(report["compile_seconds"] + seconds, 2)
    slowest = report["slowest"]
    slowest.append([round(seconds, 2), row["kernel"].rsplit(".", 1)[-1]])
    slowest.sort(key=lambda r: -r[0])
    del slowest[SLOWEST:]


def _jit_log():
    """The process's ``FLASHRT_JIT_LOG`` (:mod:`flashrt.jit_log`), or None."""
    from .jit_log import active

    return active()


def _log_row(jit_log, spec: Spec, row: dict, submitted: float) -> None:
    """A worker's finished variant as a line of the JIT log (see :mod:`flashrt.jit_log`)."""
    jit_log.write({"t": round(row.get("start", submitted) + float(row.get("seconds") or 0.0), 3),
                   "s": row.get("seconds"), "pid": row.get("pid"), "module": spec.module, "name": spec.name,
                   "pool": True, "submitted": round(submitted, 3), "start": round(row.get("start", submitted), 3),
                   "cache_key": row.get("cache_key"), "compiled": row.get("compiled"), "status": row["status"],
                   "parts": row.get("parts")})


def planned_specs(arch: Arch, profile, models: dict) -> list[Spec]:
    """The variants the plans of ``models`` list for ``arch`` and ``profile`` (and the profiles it
    extends), in the plans' order (:mod:`flashrt.jit_plans`)."""
    from . import jit_plans

    names = jit_plans.profile_names(profile)
    return [s for model in models for s in jit_plans.load(arch, names, model)]


def _plan_task(arch: Arch, profile, models: dict, sources) -> tuple[list[Spec], list[dict]]:
    """The warm-up launches' variants (the plans' are submitted before this runs)."""
    return plan(arch, profile, models, sources, plans=False)


def _worker_init() -> None:
    """A forked worker: one torch thread (the parent's OpenMP pool does not survive a fork), Ctrl-C
    left to the parent (which cancels what has not started; a compile under way completes its
    atomic writes), the cache locks of the parent are the parent's (:mod:`flashrt.jit_triton`
    drops them), and a scheduling priority ``WORKER_NICENESS`` below the parent's: the pool has as
    many workers as CPUs, so the run's own loading, compiles and launches, which it waits on, take a
    CPU first and the workers the time left (a run whose variants are all cached then loses
    nothing to the pool's cache checks)."""
    import signal

    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the run; its compiles finish or are cancelled
    try:
        os.nice(WORKER_NICENESS)
    except OSError:  # not allowed here: the workers keep the parent's priority
        pass


def _niceness() -> int:
    """This process's niceness (submitted to a worker by its test and by benchmarks/pool_priority.py)."""
    return os.nice(0)


def _noop() -> None:
    return None


class Precompile:
    """A pool of forked compile workers and one background job on it (see the module doc).

    ``Precompile(workers)`` forks the workers at once (call it before the process makes a CUDA context);
    ``start(arch, profile, models)`` plans in a worker and compiles on all of them while the caller
    goes on; ``result(timeout)`` waits for the report and closes the pool."""

    def __init__(self, workers: int | None = None):
        from .jit import install

        install()  # the workers inherit TRITON_CACHE_MANAGER: they compile into flashrt's cache
        self.workers = worker_count() if workers is None else workers
        if self.workers < 1:
            raise ValueError(f"workers: expected an int >= 1, got {self.workers!r}")
        ctx = multiprocessing.get_context("fork")
        self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_worker_init)
        try:
            self._pool.submit(_noop).result()  # a fork pool starts every worker on its first task: now
        except BaseException:
            self._pool.shutdown(wait=False, cancel_futures=True)
            raise
        self._thread: threading.Thread | None = None
        self._report: dict = {}

    def start(self, arch: Arch, profile, models: dict, sources=None, launcher: bool = False) -> "Precompile":
        self._report = {"arch": arch.name, "profile": profile.name, "workers": self.workers, "variants": 0,
                        "compiled": 0, "cancelled": 0, "failed": [], "launchers": 0, "seconds": None,
                        "done": False, "compile_seconds": 0.0, "slowest": []}
        self._thread = threading.Thread(target=self._job, args=(arch, profile, models, sources, launcher),
                                        name="flashrt-precompile", daemon=True)
        self._thread.start()
        return self

    def _job(self, arch, profile, models, sources, launcher) -> None:
        report, t0 = self._report, time.perf_counter()
        done: queue.SimpleQueue = queue.SimpleQueue()
        futures, seen, submitted = {}, set(), {}
        jit_log = _jit_log()

        def submit(specs) -> None:
            for s in specs:
                key = spec_key(s)
                if key in seen:
                    continue
                seen.add(key)
                report["variants"] += 1
                try:
                    fut = self._pool.submit(compile_spec, s, launcher)
                except BrokenProcessPool:
                    raise
                except RuntimeError:  # closed meanwhile by result(timeout): the rest is not needed
                    report["cancelled"] += 1
                    continue
                futures[fut] = s
                submitted[fut] = time.time()
                fut.add_done_callback(done.put)  # also called on cancel (as_completed is not woken then)

        def finish(fut) -> None:
            """A variant's compile done (or cancelled, or its worker dead) into the report and the log."""
            spec = futures[fut]
            if fut.cancelled():  # result() closed the pool: not needed any more
                report["cancelled"] += 1
                return
            try:
                row = fut.result()
            except BaseException as exc:  # the worker died (BrokenProcessPool): name the kernel
                row = {"kernel": f"{spec.module}.{spec.name}", "status": "failed",
                       "error": f"worker: {type(exc).__name__}: {exc}", "launcher": None}
            if jit_log is not None:
                _log_row(jit_log, spec, row, submitted[fut])
            if row["status"] == "compiled":
                report["compiled"] += 1
                report["launchers"] += row["launcher"] is True
                _tally(report, row)
            else:
                report["failed"].append({"kernel": row["kernel"], "family": ",".join(spec.families),
                                         "error": row["error"]})

        try:
            # the plans' variants first, read here (files only, no recording): the workers start on what
            # earlier runs launched, in the order they launched it, while one of them plans the warm-up's
            try:
                submit(planned_specs(arch, profile, models))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # unreadable: the cases come
                # (family "plans", not "plan": a "plan" row is a planned variant that did not compile)
                report["failed"].append({"kernel": None, "family": "plans", "error": f"{type(exc).__name__}: {exc}"})
            planning = self._pool.submit(_plan_task, arch, profile, models, sources)
            planning.add_done_callback(done.put)
            handled, planned = 0, False
            while not planned or handled < len(futures):  # compiles are counted as they end, planning or not
                fut = done.get()
                if fut is not planning:
                    handled += 1
                    finish(fut)
                    continue
                planned = True
                try:
                    specs, failures = planning.result()
                except CancelledError:  # closed by result(timeout): the variants submitted are cancelled too
                    continue
                except Exception as exc:  # planning failed (or its worker died): the plans' variants go on
                    report["failed"].append({"kernel": None, "family": None, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                report["failed"] += [{"kernel": None, "family": f["family"], "error": f["error"]} for f in failures]
                submit(specs)
        except CancelledError:  # closed by result(timeout) before the plan was made
            pass
        except BaseException as exc:  # the pool broke before the compiles began
            report["failed"].append({"kernel": None, "family": None, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            report["seconds"] = round(time.perf_counter() - t0, 2)
            report["done"] = True

    def result(self, timeout: float | None = None) -> dict:
        """The report once the job is done (or ``timeout`` seconds have passed: ``done`` False, the
        variants not compiled yet are then compiled by the launches that need them): ``variants``,
        ``compiled``, ``launchers`` built, ``failed`` (rows naming the kernel), ``cancelled``,
        ``seconds``, ``compile_seconds`` (summed over the workers) and the ``slowest`` compiles. The
        pool is shut down, the compiles not started cancelled."""
        try:
            if self._thread is not None:
                self._thread.join(timeout)
        finally:
            self.close()
        return {**self._report, "failed": list(self._report.get("failed", ())),  # as of now
                "slowest": [list(r) for r in self._report.get("slowest", ())]}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
