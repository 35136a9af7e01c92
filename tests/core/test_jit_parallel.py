"""The parallel compile (``flashrt.jit_parallel``): the same variants and cache keys as compiling
one by one, what the launches then find in the cache, and failures named, never a hang.

Compiling needs Triton without its interpreter: those checks run in a subprocess (this process
imported Triton with ``TRITON_INTERPRET=1``) that cross-compiles for sm_90 with the ``ptxas``
Triton ships. The pool's bookkeeping (errors, a dying worker) is checked here with the compile
replaced.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashrt import jit_parallel
from flashrt.jit_targets import ARCHS

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
needs_ptxas = pytest.mark.skipif(not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
                                 reason="Triton without its bundled ptxas (no NVIDIA backend)")

CHECK = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    from flashrt import profiles
    from flashrt.jit_compile import Variant, collect, compile_variant, launch_sources, recording, _StandInDriver
    from flashrt.jit_parallel import Precompile, Spec, plan
    from flashrt.jit_targets import ARCHS, targeting
    from flashrt.kernels_cuda.warmup import MODELS, plan as launches

    families, root = sys.argv[1].split(","), Path(sys.argv[2])
    arch, profile, models = ARCHS["sm_90"], profiles.load_profile("h200"), {"tiny": MODELS["tiny"]}
    sources = [s for s in launch_sources() if s[0] in families]
    keys = lambda d: sorted(p.name for p in (d / "jit" / "triton").iterdir())
    out = {}

    # one by one, in this process (flashrt jit compile's path)
    os.environ["FLASHRT_CACHE_DIR"] = str(root / "serial")
    from flashrt.jit import install
    install()
    variants, failures = {}, []
    collect(arch, profile, models, sources, variants, failures)
    rows = [compile_variant(v) for v in variants.values()]
    out["serial"] = {"keys": keys(root / "serial"), "failed": [r for r in rows if r["status"] != "compiled"]}

    # on the pool, into another cache; one variant broken on purpose
    os.environ["FLASHRT_CACHE_DIR"] = str(root / "parallel")
    specs, _ = plan(arch, profile, models, sources)
    out["specs"] = sorted(f"{s.module}.{s.name}" for s in specs)
    out["variants"] = sorted(f"{v.fn.__module__}.{v.kernel}" for v in variants.values())
    pool = Precompile(2)
    report = pool.start(arch, profile, models, sources).result(600)
    out["parallel"] = {"keys": keys(root / "parallel"), "report": report}
    bad = specs[0]
    bad = Spec(bad.module, bad.name, bad.signature, bad.constexprs, bad.attrs, bad.options | {"num_warps": 3}, bad.cc)
    from flashrt.jit_parallel import compile_spec
    out["bad"], out["bad_name"] = compile_spec(bad), bad.name
    os.environ["FLASHRT_JIT_LOG"] = str(root / "unused.log")  # a worker's row then holds its key's pieces
    out["again"] = compile_spec(specs[-1])  # in the cache already: found, not compiled
    del os.environ["FLASHRT_JIT_LOG"]

    # the launches themselves, through Triton's own JIT path: every compile must be a cache hit
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.driver import driver

    def refuse(*a, **k):
        raise RuntimeError("compiled in the launching process")
    real_stages, CUDABackend.add_stages = CUDABackend.add_stages, refuse
    driver.set_active(_StandInDriver(arch))
    from flashrt import jit_plans
    from flashrt.jit_log import JitLog, read
    recorder, jit_log = jit_plans.Recorder(), JitLog(str(root / "jit.log"))
    misses, made = [], 0
    with profiles.using(profile), targeting(arch):
        for family, cases in sources:
            for launch in launches(cases, profile, "cpu", models):
                made += 1
                try:
                    launch.fn(*launch.args)
                except RuntimeError as exc:
                    if "compiled in the launching process" in str(exc):
                        misses.append(launch.name)
                except Exception:
                    pass  # past the cache: the stand-in driver cannot load or launch a kernel
    out["launches"], out["misses"] = made, misses
    jit_log.close()
    out["log"] = read(str(root / "jit.log"))

    # what the launches loaded, kept as a plan and compiled from it into a third cache: same keys
    recorder.close()
    CUDABackend.add_stages = real_stages
    out["added"] = jit_plans.save(arch, profile.name, "tiny", recorder.entries())
    out["added_again"] = jit_plans.save(arch, profile.name, "tiny", recorder.entries())
    os.environ["FLASHRT_CACHE_DIR"] = str(root / "replayed")
    planned = jit_plans.load(arch, profile.name, "tiny")
    out["planned"] = len(planned)
    os.environ["FLASHRT_CACHE_DIR"] = str(root / "parallel")  # where the plan is kept
    from flashrt.jit_parallel import resolve
    for s in specs:
        resolve(s).device_caches.clear()  # the launches above left them in memory: record them again
    specs_with_plan, _ = plan(arch, profile, models, sources)
    out["with_plan"] = [list(s.families) for s in specs_with_plan]
    for s in specs:
        resolve(s).device_caches.clear()
    out["cases_again"] = len(plan(arch, profile, models, sources, plans=False)[0])
    import shutil
    shutil.copytree(root / "parallel" / "jit" / "plans", root / "replayed" / "jit" / "plans")
    os.environ["FLASHRT_CACHE_DIR"] = str(root / "replayed")
    planned = jit_plans.load(arch, profile.name, "tiny")
    report = Precompile(2).start(arch, profile, models, sources=[]).result(600)
    out["replayed"] = {"keys": keys(root / "replayed"), "report": report, "planned": len(planned)}
    print(json.dumps(out, default=str))
''')


@needs_ptxas
def test_the_pool_compiles_what_serial_compiles_under_the_same_keys_and_launches_hit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    r = subprocess.run([sys.executable, "-c", CHECK, "compress,kv_store", str(tmp_path)], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["serial"]["failed"] == [] and len(out["serial"]["keys"]) == len(out["specs"]) > 2
    assert out["specs"] == out["variants"]  # the plan is the cross-compile's recording
    report = out["parallel"]["report"]
    assert report["done"] and report["failed"] == [] and report["compiled"] == report["variants"] == len(out["specs"])
    assert out["parallel"]["keys"] == out["serial"]["keys"]  # same kernels, same Triton cache keys
    assert out["launches"] >= len(out["specs"]) and out["misses"] == []
    # the plan of what the launches loaded: every variant once, decoded to the same cache keys
    assert out["added"] == len(out["specs"]) and out["added_again"] == 0 and out["planned"] == 0
    assert out["cases_again"] == len(out["specs"])
    assert out["with_plan"] == [["plan"]] * len(out["specs"])  # the plan's first; the cases add nothing new
    replayed = out["replayed"]
    assert replayed["planned"] == len(out["specs"]) and replayed["report"]["failed"] == []
    assert replayed["keys"] == out["serial"]["keys"]
    bad = out["bad"]
    assert bad["status"] == "failed" and bad["kernel"].endswith(out["bad_name"]) and bad["error"]
    # the cache keys name the same variant in every process: the launches' log lines name the pool's
    # keys, found there; a worker's row names its key and whether it compiled it
    assert out["again"]["status"] == "compiled" and out["again"]["compiled"] is False
    assert out["again"]["cache_key"] in out["parallel"]["keys"]
    logged = out["log"]
    assert len(logged) == len(out["specs"])
    assert sorted(r["cache_key"] for r in logged) == out["parallel"]["keys"]
    assert all(r["compiled"] is False for r in logged)
    # the key's pieces as the log computes them make the key, for a launch, its plan round trip, a worker
    assert out["again"]["parts"]["cache_key"] == out["again"]["cache_key"]
    for r in logged:
        assert "parts_error" not in r, r["parts_error"]
        assert r["parts"]["cache_key"] == r["plan_parts"]["cache_key"] == r["cache_key"]


def _spec(name: str) -> jit_parallel.Spec:
    return jit_parallel.Spec("flashrt.kernels_cuda.fake", name, {}, {}, {}, {}, 90, ("fam",), ("l",))


def _fake_compile(spec, launcher=False):
    if spec.name == "_dies":
        os._exit(3)  # a worker killed mid-compile (a crash, the OOM killer)
    if spec.name == "_broken":
        return {"kernel": f"{spec.module}.{spec.name}", "status": "failed", "error": "ptxas: bad", "launcher": None}
    return {"kernel": f"{spec.module}.{spec.name}", "status": "compiled", "error": None, "launcher": launcher}


def test_a_compile_error_and_a_dead_worker_are_reported_by_kernel_never_a_hang(monkeypatch):
    names = ["_ok1", "_broken", "_ok2"]
    monkeypatch.setattr(jit_parallel, "plan", lambda *a, **k: ([_spec(n) for n in names], []))
    monkeypatch.setattr(jit_parallel, "compile_spec", _fake_compile)  # before the fork: the workers see it
    report = jit_parallel.Precompile(2).start(ARCHS["sm_90"], _Profile(), {}, launcher=True).result(120)
    assert report["done"] and report["variants"] == 3 and report["compiled"] == 2 and report["launchers"] == 2
    assert report["failed"] == [{"kernel": "flashrt.kernels_cuda.fake._broken", "family": "fam", "error": "ptxas: bad"}]

    names[:] = ["_dies", "_ok1"]
    report = jit_parallel.Precompile(1).start(ARCHS["sm_90"], _Profile(), {}).result(120)
    assert report["done"] and report["compiled"] == 0
    failed = {row["kernel"]: row["error"] for row in report["failed"]}
    assert set(failed) == {"flashrt.kernels_cuda.fake._dies", "flashrt.kernels_cuda.fake._ok1"}
    assert all("BrokenProcessPool" in e for e in failed.values())


def test_a_planning_error_is_reported(monkeypatch):
    def broken_plan(*a, **k):
        raise KeyError("dim")
    monkeypatch.setattr(jit_parallel, "plan", broken_plan)
    report = jit_parallel.Precompile(1).start(ARCHS["sm_90"], _Profile(), {}).result(120)
    assert report["done"] and report["variants"] == 0 and "KeyError" in report["failed"][0]["error"]


class _Profile:
    name = "fake"


def _timed_compile(spec, launcher=False):
    return {"kernel": f"{spec.module}.{spec.name}", "status": "compiled", "error": None, "launcher": launcher,
            "seconds": float(spec.name.rsplit("_", 1)[-1]) / 100}


def test_the_report_sums_the_compile_seconds_and_keeps_the_slowest(monkeypatch):
    """``compile_seconds``: every compiled row's seconds summed; ``slowest``: the SLOWEST longest,
    longest first, by kernel name."""
    import random

    cents = random.sample(range(1, 500), jit_parallel.SLOWEST + 5)
    monkeypatch.setattr(jit_parallel, "plan", lambda *a, **k: ([_spec(f"_k_{c}") for c in cents], []))
    monkeypatch.setattr(jit_parallel, "compile_spec", _timed_compile)  # before the fork: the workers see it
    report = jit_parallel.Precompile(2).start(ARCHS["sm_90"], _Profile(), {}).result(120)
    assert report["done"] and report["compiled"] == len(cents)
    assert abs(report["compile_seconds"] - sum(cents) / 100) < 1e-6
    want = sorted(cents, reverse=True)[:jit_parallel.SLOWEST]
    assert report["slowest"] == [[c / 100, f"_k_{c}"] for c in want]


def _keyed_compile(spec, launcher=False):
    """A compile row as a worker makes it: its start, pid, cache key and whether it compiled."""
    start = time.time()
    time.sleep(0.01)
    return {"kernel": f"{spec.module}.{spec.name}", "status": "compiled", "error": None, "launcher": launcher,
            "seconds": round(time.time() - start, 2), "start": start, "pid": os.getpid(),
            "cache_key": f"key{spec.name}", "compiled": spec.name.endswith("0")}


def test_the_pool_writes_each_finished_variant_to_the_jit_log(monkeypatch, tmp_path):
    """With ``FLASHRT_JIT_LOG`` set, the parent writes one line per variant a worker finished: marked
    ``pool``, its worker's pid, when it was queued and begun, its cache key and whether it compiled."""
    import random

    from flashrt import jit_log

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(jit_log, "_INSTALLED", {})
    monkeypatch.setenv(jit_log.ENV, str(tmp_path / "jit.log"))
    names = [f"_k{random.randrange(10 ** 6)}" for _ in range(random.randint(3, 9))]
    monkeypatch.setattr(jit_parallel, "plan", lambda *a, **k: ([_spec(n) for n in names], []))
    monkeypatch.setattr(jit_parallel, "compile_spec", _keyed_compile)  # before the fork: the workers see it
    before = time.time()
    report = jit_parallel.Precompile(2).start(ARCHS["sm_90"], _Profile(), {}).result(120)
    jit_log.active().close()
    assert report["done"] and report["compiled"] == len(set(names))
    rows = jit_log.read(str(tmp_path / "jit.log"))
    assert sorted(r["name"] for r in rows) == sorted(set(names)) and all(r["pool"] for r in rows)
    for r in rows:
        assert r["cache_key"] == f"key{r['name']}" and r["compiled"] == r["name"].endswith("0")
        # a pool row's end is its start plus the worker's seconds, which are rounded to 10 ms: up to 5 ms
        # (and the 1 ms of the log's rounding) past the real end, so it may lie that far past the check's now
        assert before - 0.01 <= r["submitted"] <= r["start"] + 0.01 <= r["t"] + 0.01 <= time.time() + 0.02
        assert r["pid"] != os.getpid() and r["status"] == "compiled"


def _marking_compile(spec, launcher=False):
    Path(os.environ["FLASHRT_TEST_MARK"]).write_text(spec.name)
    return {"kernel": f"{spec.module}.{spec.name}", "status": "compiled", "error": None, "launcher": launcher}


def _waiting_plan(*args, **kwargs):
    """The warm-up's planning, done only once a compile has begun (a failure row after 20 s)."""
    mark, deadline = Path(os.environ["FLASHRT_TEST_MARK"]), time.monotonic() + 20
    while not mark.exists():
        if time.monotonic() > deadline:
            return [], [{"family": "test", "error": "nothing compiled while the warm-up was planned"}]
        time.sleep(0.02)
    return [_spec("_case"), _spec("_planned")], []


def test_the_plans_variants_compile_while_the_warmup_is_planned(monkeypatch, tmp_path):
    """The plans' variants go to the workers before the warm-up's planning (a worker's task) starts:
    a plan that waits for a compile to have begun finishes; a variant both list compiles once."""
    monkeypatch.setenv("FLASHRT_TEST_MARK", str(tmp_path / "mark"))
    monkeypatch.setattr(jit_parallel, "planned_specs", lambda *a: [_spec("_planned")])
    monkeypatch.setattr(jit_parallel, "plan", _waiting_plan)
    monkeypatch.setattr(jit_parallel, "compile_spec", _marking_compile)  # before the fork: the workers see it
    report = jit_parallel.Precompile(2).start(ARCHS["sm_90"], _Profile(), {"m": {}}).result(120)
    assert report["done"] and report["failed"] == []
    assert report["variants"] == 2 and report["compiled"] == 2
    assert (tmp_path / "mark").read_text() in ("_planned", "_case")


def _slow_plan(*args, **kwargs):
    time.sleep(float(os.environ["FLASHRT_TEST_PLAN_SECONDS"]))
    return [], []


def test_the_plans_variants_are_counted_while_the_warmup_is_still_planned(monkeypatch):
    """A run that ends while a worker still plans the warm-up's variants reports the plans' variants
    the workers compiled meanwhile (and their log lines), not none."""
    import random

    names = [f"_p{i}" for i in range(random.randint(2, 5))]
    monkeypatch.setenv("FLASHRT_TEST_PLAN_SECONDS", "4")
    monkeypatch.setattr(jit_parallel, "planned_specs", lambda *a: [_spec(n) for n in names])
    monkeypatch.setattr(jit_parallel, "plan", _slow_plan)
    monkeypatch.setattr(jit_parallel, "compile_spec", _fake_compile)  # before the fork: the workers see it
    pool = jit_parallel.Precompile(2).start(ARCHS["sm_90"], _Profile(), {"m": {}})
    deadline = time.monotonic() + 3
    while pool._report["compiled"] < len(names) and time.monotonic() < deadline:
        time.sleep(0.05)
    report = pool.result(0)
    assert not report["done"] and report["compiled"] == report["variants"] == len(names)


def test_unreadable_plans_are_a_failure_row_and_the_cases_still_compile(monkeypatch):
    def unreadable(*args):
        raise OSError("plans: permission denied")

    monkeypatch.setattr(jit_parallel, "planned_specs", unreadable)
    monkeypatch.setattr(jit_parallel, "plan", lambda *a, **k: ([_spec("_case")], []))
    monkeypatch.setattr(jit_parallel, "compile_spec", _fake_compile)  # before the fork: the workers see it
    report = jit_parallel.Precompile(1).start(ARCHS["sm_90"], _Profile(), {"m": {}}).result(120)
    assert report["done"] and report["compiled"] == report["variants"] == 1
    assert report["failed"] == [{"kernel": None, "family": "plans", "error": "OSError: plans: permission denied"}]


def test_worker_count_reads_the_environment(monkeypatch):
    monkeypatch.setenv(jit_parallel.WORKERS_ENV, "3")
    assert jit_parallel.worker_count() == 3 and jit_parallel.worker_count(tasks=2) == 2
    monkeypatch.setenv(jit_parallel.WORKERS_ENV, "0")
    assert jit_parallel.worker_count() == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv(jit_parallel.WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=rf"FLASHRT_JIT_WORKERS: expected an int >= 0, got '{bad}'"):
            jit_parallel.worker_count()
    monkeypatch.delenv(jit_parallel.WORKERS_ENV)
    assert jit_parallel.worker_count() == len(os.sched_getaffinity(0))


def test_a_spec_naming_something_else_than_a_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match=r"flashrt.jit_parallel.plan: expected a triton.jit kernel, got function"):
        jit_parallel.resolve(jit_parallel.Spec("flashrt.jit_parallel", "plan", {}, {}, {}, {}, 90))


def _slow_compile(spec, launcher=False):
    import time

    time.sleep(0.3)
    return {"kernel": spec.name, "status": "compiled", "error": None, "launcher": None}


def test_closing_early_cancels_what_has_not_started_and_reports_no_failure(monkeypatch):
    monkeypatch.setattr(jit_parallel, "plan", lambda *a, **k: ([_spec(f"_k{i}") for i in range(6)], []))
    monkeypatch.setattr(jit_parallel, "compile_spec", _slow_compile)
    pool = jit_parallel.Precompile(1).start(ARCHS["sm_90"], _Profile(), {})
    early = pool.result(timeout=0.5)
    assert not early["done"] and early["failed"] == []
    pool._thread.join(30)
    final = pool._report
    assert final["done"] and final["failed"] == [] and final["cancelled"] >= 2
    assert final["compiled"] + final["cancelled"] == 6


LAUNCHERS = textwrap.dedent('''
    import os, sys
    from flashrt import profiles
    from flashrt.jit_compile import launch_sources
    from flashrt.jit_parallel import Precompile, plan, resolve
    from flashrt.jit_targets import ARCHS
    from flashrt.kernels_cuda.warmup import MODELS
    import triton
    import triton.runtime.build as build
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.compiler import ASTSource

    arch, profile, models = ARCHS["sm_90"], profiles.load_profile("h200"), {"tiny": MODELS["tiny"]}
    sources = [s for s in launch_sources() if s[0] == "kv_store"]
    report = Precompile(2).start(arch, profile, models, sources, launcher=True).result(600)
    built, real = [], build._build
    build._build = lambda *a, **k: built.append(a[0]) or real(*a, **k)
    specs, _ = plan(arch, profile, models, sources)
    for s in specs:  # what a launch does: compile (a cache hit), then make the launcher
        kernel = triton.compile(ASTSource(resolve(s), s.signature, s.constexprs, s.attrs),
                                target=GPUTarget("cuda", 90, 32), options=s.options)
        CudaLauncher(kernel.src, kernel.metadata)
    from flashrt.jit_triton import compiled_here
    print(report["variants"], report["launchers"], len(compiled_here()), len(built))
''')


def _builds_launcher_stubs() -> bool:
    import inspect

    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return False
    return "compile_module_from_src" in inspect.getsource(driver.CudaLauncher.__init__)


@needs_ptxas
@pytest.mark.skipif(not _builds_launcher_stubs(), reason="this Triton builds no per-kernel launcher stub")
def test_the_pool_builds_each_launcher_stub_so_the_launch_builds_none(tmp_path):
    """Triton versions that compile a C launcher per signature (gcc, at the first launch): the pool
    builds them into the cache. A stub ``libcuda`` stands in for the driver's (link and load)."""
    from triton.backends.nvidia import driver

    fake = tmp_path / "libcuda"
    fake.mkdir()
    text = Path(driver.__file__).read_text() + (Path(driver.__file__).with_name("driver.c").read_text()
                                                if Path(driver.__file__).with_name("driver.c").exists() else "")
    names = sorted(set(re.findall(r"\b(cu[A-Z]\w+)\b", text)) - {n for n in re.findall(r"\b(cu[A-Z]\w+_t)\b", text)})
    (fake / "s.c").write_text("".join(f"int {n}(void) {{ return 0; }}\n" for n in names))
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(fake / "libcuda.so.1"), str(fake / "s.c")], check=True)
    (fake / "libcuda.so").symlink_to("libcuda.so.1")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "TRITON_DEFAULT_FP_FUSION": "1", "FLASHRT_CACHE_DIR": str(tmp_path / "cache"),
        "TRITON_LIBCUDA_PATH": str(fake), "LD_LIBRARY_PATH": str(fake)}
    r = subprocess.run([sys.executable, "-c", LAUNCHERS], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    variants, launchers, compiled, built = map(int, r.stdout.split()[-4:])
    assert variants == launchers > 0 and compiled == 0 and built == 0


CTRL_C = textwrap.dedent('''
    import os, signal, sys, threading, time
    from pathlib import Path
    from flashrt import jit_parallel
    from flashrt.jit import atomic_write
    from flashrt.jit_targets import ARCHS

    out = Path(sys.argv[1])

    def slow_write(spec, launcher=False):
        time.sleep(0.6)
        atomic_write(out / spec.name, spec.name.encode() * 100000)
        return {"kernel": spec.name, "status": "compiled", "error": None, "launcher": None}

    class P:
        name = "fake"
    specs = [jit_parallel.Spec("m", f"k{i}", {}, {}, {}, {}, 90) for i in range(12)]
    jit_parallel.plan = lambda *a, **k: (specs, [])
    jit_parallel.compile_spec = slow_write
    pool = jit_parallel.Precompile(2).start(ARCHS["sm_90"], P(), {})
    threading.Timer(0.9, lambda: os.killpg(os.getpgrp(), signal.SIGINT)).start()  # Ctrl-C at a terminal
    try:
        time.sleep(30)
    finally:
        print(pool.result(timeout=0)["done"], flush=True)
''')


def test_ctrl_c_stops_the_pool_soon_and_leaves_only_whole_files(tmp_path):
    import time

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", CTRL_C, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                       timeout=60, start_new_session=True)  # its own process group: the signal stays there
    assert time.monotonic() - t0 < 20 and r.returncode != 0 and "KeyboardInterrupt" in r.stderr
    assert "ForkProcess" not in r.stderr  # the workers left Ctrl-C to the parent
    files = sorted(p.name for p in tmp_path.iterdir())
    assert 0 < len(files) < 12 and not [f for f in files if ".tmp." in f]  # the rest was cancelled
    for name in files:
        assert (tmp_path / name).read_bytes() == name.encode() * 100000  # each whole


def test_workers_run_below_the_parent_s_priority():
    """The workers' niceness is the parent's plus WORKER_NICENESS (the run's own work comes first
    for the CPUs); the parent's is unchanged."""
    before = os.nice(0)
    pool = jit_parallel.Precompile(2)
    try:
        seen = {pool._pool.submit(jit_parallel._niceness).result(60) for _ in range(4)}
    finally:
        pool.close()
    assert seen == {min(19, before + jit_parallel.WORKER_NICENESS)}
    assert os.nice(0) == before


def test_the_plan_reads_the_plans_of_the_profile_s_lineage(monkeypatch):
    """A profile that extends another (``h100`` extends ``h200``) plans the variants of both profiles'
    plans, its own first."""
    from flashrt import jit_compile, jit_plans, profiles

    asked = []
    monkeypatch.setattr(jit_compile, "collect", lambda *a, **k: 0)
    monkeypatch.setattr(jit_plans, "load", lambda arch, names, model: asked.append((tuple(names), model)) or [])
    jit_parallel.plan(ARCHS["sm_90"], profiles.load_profile("h100"), {"small": {}}, sources=())
    assert asked == [(("h100", "h200"), "small")]
