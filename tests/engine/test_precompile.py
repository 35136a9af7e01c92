"""``flashrt run`` starts its kernel compiles before loading: the dims it plans at are the model's
config as the warm-up launches read it, and the pool is made only where CUDA kernels run."""
from __future__ import annotations

import json

import pytest
import torch

from flashrt import jit_warmup
from flashrt.engine import precompile
from flashrt.engine import run as run_mod
from flashrt.graphs.config import shipped_config
from flashrt.kernels_cuda.warmup import MODELS


@pytest.mark.parametrize("name", ["tiny", "tiny-vl", "small", "v4.1-flash"])
def test_kernel_dims_are_the_warmup_dims_of_the_shipped_model(name):
    dims = precompile.kernel_dims(shipped_config(name))
    want = MODELS[name]
    assert {k: dims[k] for k in want} == {**want, "compress_ratios": tuple(sorted(set(want["compress_ratios"])))}
    assert any(k.startswith("vision_") for k in dims) == shipped_config(name).vision_enabled


def test_the_pool_is_made_only_for_cuda_kernels(monkeypatch):
    """A run on a CUDA device with the CUDA kernels forks the pool by default (``FLASHRT_JIT_WORKERS``
    unset: as many workers as CPUs; 0 turns it off, ``jit_warmup.precompile_pool``); nowhere else."""
    asked = []
    monkeypatch.setattr(jit_warmup, "precompile_pool", lambda models: asked.append(models) or "pool")
    cfg = shipped_config("small")
    monkeypatch.delenv("FLASHRT_JIT_WORKERS", raising=False)
    assert precompile.start_precompile(cfg, torch.device("cuda"), "cuda")[0] == "pool"
    asked.clear()
    monkeypatch.setenv("FLASHRT_JIT_WORKERS", "4")
    assert precompile.start_precompile(cfg, torch.device("cpu"), None) == (None, None)
    assert precompile.start_precompile(cfg, torch.device("cuda"), "reference") == (None, None)
    assert precompile.start_precompile(None, torch.device("cuda"), None) == (None, None)
    pool, models = precompile.start_precompile(cfg, torch.device("cuda"), "cuda")
    assert pool == "pool" and models == {"small": precompile.kernel_dims(cfg)}
    assert asked == [models]


def test_no_pool_where_triton_is_interpreted_or_workers_are_off(monkeypatch):
    """Where Triton is interpreted there is nothing to compile (set here, so the test means the same on a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(jit_warmup, "interpreted", lambda: True)
    assert jit_warmup.precompile_pool({"small": {}}) is None
    monkeypatch.setattr(jit_warmup, "interpreted", lambda: False)
    monkeypatch.setenv("FLASHRT_JIT_WORKERS", "0")
    assert jit_warmup.precompile_pool({"small": {}}) is None
    assert jit_warmup.precompile_pool(None) is None


def test_model_config_reads_without_loading(tmp_path):
    assert run_mod.model_config("small") == shipped_config("small")
    assert run_mod.model_config("v4.1-flash") is None  # no built-in weights: load_model says so
    assert run_mod.model_config(str(tmp_path)) is None  # no config.json: load_model says so
    (tmp_path / "config.json").write_text(json.dumps(shipped_config("tiny").to_dict()))
    assert run_mod.model_config(str(tmp_path)) == shipped_config("tiny")


def test_a_run_keeps_its_plan_under_the_name_the_next_pool_reads(tmp_path, monkeypatch):
    """A built-in model's checkpoint names itself ``tiny-seed0``; the compile pool reads the plan of
    the config it planned from before loading (``tiny``): the run must add to that one."""
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path))
    loaded = run_mod.load_model("tiny", torch.device("cpu"), quiet=True).cfg
    assert loaded.name != "tiny"  # the premise: the checkpoint's own name differs
    planned = run_mod.model_config("tiny")
    monkeypatch.setenv("FLASHRT_JIT_WORKERS", "2")
    monkeypatch.setattr(jit_warmup, "precompile_pool", lambda models: "pool")
    _, models = precompile.start_precompile(planned, torch.device("cuda"), "cuda")
    assert list(models) == [precompile.plan_model(planned, loaded)] == ["tiny"]
    assert precompile.plan_model(None, loaded) == loaded.name  # no pool config (a CPU run): its own


def test_a_cpu_run_reports_no_pool_and_no_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path))
    report = run_mod.run("tiny", max_new_tokens=2, device="cpu", quiet=True)
    assert report["jit"]["precompile"] is None and report["jit"]["compiled_in_process"] == []


def test_the_report_lists_the_kernels_compiled_since_the_run_began(monkeypatch):
    from flashrt import jit_triton

    monkeypatch.setattr(jit_triton, "COMPILED", ["_hook_kernel"])  # compiled before (e.g. by warm-up hooks)
    since = precompile.compiled_count()
    jit_triton.COMPILED += ["_rms_norm_kernel", "_rope_kernel"]
    report = precompile.jit_report({"variants": 3}, 2, since, {"loaded": 5})
    assert report == {"precompile": {"variants": 3}, "plan_added": 2, "preload": {"loaded": 5},
                      "compiled_in_process": ["_rms_norm_kernel", "_rope_kernel"]}


def test_a_pool_that_cannot_start_is_closed_and_the_run_goes_on(monkeypatch, caplog):
    from flashrt import jit_targets

    class Pool:
        closed = False

        def start(self, *a, **k):
            raise RuntimeError("no planning worker")

        def close(self):
            Pool.closed = True

    monkeypatch.setattr(jit_targets, "device_arch", lambda index=None: jit_targets.ARCHS["sm_90"])
    assert precompile.begin(Pool(), torch.device("cuda"), None, {}) is None and Pool.closed
    assert "the compile pool did not start (RuntimeError: no planning worker)" in caplog.text
    assert precompile.begin(None, torch.device("cuda"), None, {}) is None


def test_a_plan_that_cannot_be_written_is_logged_not_raised(monkeypatch, caplog, tmp_path):
    from flashrt import jit_plans, jit_targets

    monkeypatch.setattr(jit_targets, "device_arch", lambda index=None: jit_targets.ARCHS["sm_90"])
    monkeypatch.setattr(jit_plans, "save", lambda *a: (_ for _ in ()).throw(PermissionError("read-only")))
    recorder = type("R", (), {"entries": lambda self: [{"module": "m", "name": "k", "data": "{}"}]})()
    profile = type("P", (), {"name": "h200"})()
    assert precompile.save_plan(recorder, torch.device("cuda"), profile, "small") == 0
    assert "the plan of small is not updated (read-only)" in caplog.text
    assert precompile.save_plan(None, torch.device("cuda"), profile, "small") == 0


def test_no_processes_to_fork_means_no_pool_and_a_warning(monkeypatch, caplog):
    from flashrt import jit_parallel

    def refuse(*a, **k):
        raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(jit_warmup, "interpreted", lambda: False)
    monkeypatch.setattr(jit_parallel, "Precompile", refuse)
    assert jit_warmup.precompile_pool({"small": {}}) is None
    assert "no compile pool" in caplog.text and "Resource temporarily unavailable" in caplog.text


def test_triton_key_is_hashed_on_a_thread_only_for_compiled_cuda_kernels(monkeypatch):
    """Where the run loads compiled Triton kernels on a CUDA device, a thread fills Triton's cached
    ``triton_key`` (its first kernel load then finds it); elsewhere no thread."""
    triton_cache = pytest.importorskip("triton.runtime.cache")
    from flashrt import jit_triton

    assert precompile.start_triton_key(torch.device("cpu"), None) is None
    assert precompile.start_triton_key(torch.device("cuda"), "reference") is None
    monkeypatch.setattr(jit_triton, "interpreted", lambda: True)
    assert precompile.start_triton_key(torch.device("cuda"), "cuda") is None  # Triton interpreted
    monkeypatch.setattr(jit_triton, "interpreted", lambda: False)
    triton_cache.triton_key.cache_clear()
    thread = precompile.start_triton_key(torch.device("cuda"), None)
    thread.join(120)
    assert not thread.is_alive() and triton_cache.triton_key.cache_info().currsize == 1
    assert triton_cache.triton_key.cache_info().misses == 1


class _FakePool:
    def __init__(self):
        self.calls = []

    def start(self, arch, profile, models, launcher=False):
        self.calls.append(("start", profile.name, tuple(models)))
        return self

    def result(self, timeout=None):
        self.calls.append(("result", timeout))
        return {"variants": 3, "compiled": 2}


class _FakeRecorder:
    def __init__(self):
        self.closed = False

    def entries(self):
        return []

    def close(self):
        self.closed = True


def test_serve_compiles_on_the_pool_while_it_loads_and_warms_up(monkeypatch):
    """``flashrt serve`` (``precompile.compiles_beside``): on a CUDA device the pool is forked before
    the load under the profile the load is given, closed (what is not started cancelled) when the
    warm-up ends, and the plan kept under the planned model's name; on an error nothing is kept."""
    pool, recorder, saved = _FakePool(), _FakeRecorder(), []
    monkeypatch.setattr(jit_warmup, "precompile_pool", lambda models: pool)
    monkeypatch.setattr(precompile, "start_triton_key", lambda dev, backend: None)
    monkeypatch.setattr(precompile, "start_recording", lambda dev, backend: recorder)
    monkeypatch.setattr(precompile, "save_plan",
                        lambda rec, dev, profile, model, last=False: saved.append((model, last)) or 7)
    monkeypatch.setattr("flashrt.jit_targets.device_arch", lambda index: "arch")
    monkeypatch.setattr("flashrt.graphs.loader.resolve_profile", lambda name, dev: type("P", (), {"name": "h200"})())
    with precompile.compiles_beside("small", torch.device("cuda")) as compiles:
        assert compiles.profile.name == "h200" and pool.calls == [("start", "h200", ("small",))]
        compiles.cfg = shipped_config("small").replace(name="small-seed0")
    assert pool.calls[-1] == ("result", 0) and recorder.closed and saved == [("small", True)]
    assert compiles.report["precompile"] == {"variants": 3, "compiled": 2} and compiles.report["plan_added"] == 7
    with pytest.raises(RuntimeError, match="load failed"):
        with precompile.compiles_beside("small", torch.device("cuda")) as compiles:
            raise RuntimeError("load failed")
    assert pool.calls[-1] == ("result", 0) and saved == [("small", True)] and compiles.report is None


def test_serve_on_a_cpu_forks_no_pool_and_reports_nothing():
    with precompile.compiles_beside("tiny", torch.device("cpu")) as compiles:
        compiles.cfg = shipped_config("tiny")
    assert compiles.report is None
