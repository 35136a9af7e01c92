"""The preload of a model's planned variants (:mod:`flashrt.jit_preload`): every cached variant of
the plan is filed in its kernel's in-memory cache under the key its launch computes (so the launch
compiles and reads nothing), a variant missing from the cache is skipped without compiling, and
the run asks for it only when ``FLASHRT_JIT_PRELOAD`` is 1.

The end-to-end case cross-compiles for sm_90 (Triton's bundled ptxas, no GPU) in a process
without Triton's interpreter, as tests/core/test_jit_parallel.py does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flashrt import jit_preload, profiles
from flashrt.engine import precompile
from flashrt.graphs.config import shipped_config

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
needs_ptxas = pytest.mark.skipif(not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
                                 reason="Triton without its bundled ptxas (no NVIDIA backend)")

CHECK = textwrap.dedent('''
    import json, os, shutil, sys
    from pathlib import Path
    os.environ["FLASHRT_CACHE_DIR"] = sys.argv[1]
    from flashrt.jit import cache_root, install
    install()
    from flashrt import jit_plans, profiles
    from flashrt.jit_compile import _StandInDriver, launch_sources
    from flashrt.jit_parallel import compile_spec, plan, resolve
    from flashrt.jit_preload import Preload
    from flashrt.jit_targets import ARCHS, targeting
    from flashrt.kernels_cuda.warmup import MODELS, plan as launches
    from triton.runtime.driver import driver

    arch, profile, models = ARCHS["sm_90"], profiles.load_profile("h200"), {"tiny": MODELS["tiny"]}
    sources = [s for s in launch_sources() if s[0] == "kv_store"]
    specs, _ = plan(arch, profile, models, sources)
    assert all(compile_spec(s)["status"] == "compiled" for s in specs)
    driver.set_active(_StandInDriver(arch))
    recorder = jit_plans.Recorder()
    with profiles.using(profile), targeting(arch):  # the launches record what they load (cache hits)
        for family, cases in sources:
            for launch in launches(cases, profile, "cpu", models):
                try:
                    launch.fn(*launch.args)
                except Exception:
                    pass  # past the cache: the stand-in driver cannot load or launch a kernel
    recorder.close()
    entries = recorder.entries()
    fns = {(e["module"], e["name"]): resolve(type("S", (), {"module": e["module"], "name": e["name"]}))
           for e in entries}
    for fn in fns.values():
        fn.device_caches.clear()  # a fresh process: nothing in memory
    # one variant's binary gone from the cache: the preload must skip it, never compile it
    groups = sorted((cache_root() / "triton").glob(f"*/__grp__{entries[0]['name']}.json"))
    victim = groups[0].parent
    shutil.rmtree(victim)
    from flashrt import jit_triton
    before = len(jit_triton.compiled_here())
    report = Preload(entries, None, handles=False).join(600)
    device = driver.active.get_current_device()
    found = []
    for e in entries:
        data = json.loads(e["data"])
        cache = fns[(e["module"], e["name"])].device_caches[device][0]
        found.append(data["key"] in cache)
    print(json.dumps({"entries": len(entries), "report": report, "found": found, "victim_back": victim.exists(),
                      "compiled": len(jit_triton.compiled_here()) - before, "kernels": len(set(fns))}))
''')


@needs_ptxas
def test_the_preload_files_every_cached_planned_variant_and_skips_a_missing_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    r = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    report, found = out["report"], out["found"]
    assert out["entries"] >= 2 and report["done"] and report["entries"] == out["entries"]
    missing = found.count(False)
    assert report["not_cached"] == missing >= 1 and report["failed"] == 0  # the removed binary's variants
    assert report["loaded"] == found.count(True) == out["entries"] - missing >= 1
    assert out["compiled"] == 0 and not out["victim_back"]  # skipped, never compiled again


def test_the_run_preloads_only_when_asked_and_only_for_compiled_cuda_kernels(monkeypatch):
    cfg, profile = shipped_config("small"), profiles.load_profile("h100")  # extends h200: both plans
    started = []
    monkeypatch.setattr(jit_preload, "start", lambda *a, **k: started.append(a) or "preload")
    monkeypatch.delenv(jit_preload.PRELOAD_ENV, raising=False)
    from flashrt import jit_triton

    monkeypatch.setattr(jit_triton, "interpreted", lambda: False)
    assert precompile.start_preload(torch.device("cuda", 0), None, profile, cfg) is None  # opt-in
    monkeypatch.setenv(jit_preload.PRELOAD_ENV, "1")
    assert precompile.start_preload(torch.device("cpu"), None, profile, cfg) is None
    assert precompile.start_preload(torch.device("cuda", 0), "reference", profile, cfg) is None
    assert precompile.start_preload(torch.device("cuda", 0), None, profile, None) is None
    assert started == []
    monkeypatch.setattr("flashrt.jit_targets.device_arch", lambda index=None: "sm_90-arch")
    assert precompile.start_preload(torch.device("cuda", 0), "cuda", profile, cfg) == "preload"
    assert started == [("sm_90-arch", ("h100", "h200"), "small", 0)]


def test_the_preload_stops_when_the_run_stops_waiting(monkeypatch):
    """A preload still going when the model has loaded is stopped after its current entry."""
    import threading

    gate, seen = threading.Event(), []

    def slow(entry):
        seen.append(entry["name"])
        gate.wait(5)
        return None  # not a kernel: counted as failed

    monkeypatch.setattr(jit_preload, "_function", slow)
    pre = jit_preload.Preload([{"module": "m", "name": f"k{i}", "data": "{}"} for i in range(50)], None)
    report = pre.join(timeout=0.05)
    gate.set()
    assert report["done"] and report["entries"] == 50 and len(seen) < 50
    assert report["failed"] == len(seen) and report["loaded"] == 0
