"""The JIT compile cache across processes: one compile per key, killed writers and compilers, forked
children, the CLI, warmup.

Compiles go through flashrt's Triton cache manager the way ``triton.compile`` drives it
(``get_group``, ``put`` ..., ``put_group``; see tests/jit_helpers.py), in real processes.
"""
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashrt import jit, profiles
from flashrt.jit import JitCache
from flashrt.jit_triton import TritonCacheManager
from jit_helpers import _jit_cache_dir, builds, compile_or_load, fake_group  # noqa: F401 (autouse fixture)


@pytest.fixture(autouse=True)
def _default_profile():
    profiles.use_profile(None)
    yield
    profiles.use_profile(None)


def test_cache_root_defaults(monkeypatch, tmp_path):
    assert jit.cache_root() == tmp_path / "cache" / "jit"
    monkeypatch.delenv("FLASHRT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit.cache_root() == tmp_path / "xdg" / "flashrt" / "jit"
    monkeypatch.setenv("FLASHRT_CACHE_DIR", "~/somewhere")
    assert jit.cache_root() == Path.home() / "somewhere" / "jit"


def _concurrent_worker(marks, barrier, results):
    barrier.wait()
    results.put(compile_or_load("KEYC", Path(marks), 0.5))


def test_concurrent_processes_compile_one_key_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_concurrent_worker, args=(tmp_path, barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert builds(tmp_path) == 1 and not (tmp_path / "overlap").exists()
    assert all(g == got[0] for g in got) and got[0]["k.cubin"].startswith(b"\x7fELF")  # the one build's bytes


def _run_killed(script: str, *args) -> subprocess.Popen:
    code = ("import os, signal, sys, time\nfrom flashrt.jit_triton import TritonCacheManager\n"
            "from jit_helpers import fake_group\n" + textwrap.dedent(script))
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env)


@pytest.mark.parametrize("dies_at", [1, 2, 7])  # the cubin, its checksum sidecar, the group file
def test_a_compiler_killed_mid_write_leaves_nothing_that_is_served(dies_at):
    proc = _run_killed("""
        calls, real_fsync = [0], os.fsync
        def fsync(fd):  # die at the n-th file written: its temp file written, not renamed
            calls[0] += 1
            if calls[0] == int(sys.argv[1]):
                os.kill(os.getpid(), signal.SIGKILL)
            real_fsync(fd)
        os.fsync = fsync
        m = TritonCacheManager("KEYW")
        assert m.get_group("k.json") is None
        fake_group(m)
    """, 2 * dies_at - 1)  # each atomic write fsyncs its temp file, then the directory
    assert proc.wait(timeout=120) == -signal.SIGKILL
    key_dir = jit.cache_root() / "triton" / "KEYW"
    assert list(key_dir.glob("*.tmp.*"))  # the dead writer's temp file
    m = TritonCacheManager("KEYW")
    assert m.get_group("k.json") is None  # nothing half-written is served: a miss, compiled again
    assert dies_at > 2 or m.get_file("k.cubin") is None  # a file without its checksum is not served
    assert not list(key_dir.glob("*.tmp.*"))  # swept by the next compiler, under the key's lock
    group = fake_group(m)
    assert TritonCacheManager("KEYW").get_group("k.json") == group


def test_a_compiler_killed_while_holding_the_lock_does_not_block_others(tmp_path):
    marker = tmp_path / "building"
    proc = _run_killed("""
        m = TritonCacheManager("KEYK")
        assert m.get_group("k.json") is None  # a miss: this process holds the key's lock
        open(sys.argv[1], "w").close()
        time.sleep(600)
    """, marker)
    deadline = time.time() + 120
    while not marker.exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    t0 = time.perf_counter()
    m = TritonCacheManager("KEYK")
    assert m.get_group("k.json") is None and m._lock_fd is not None  # the dead process's lock is free
    assert time.perf_counter() - t0 < 10
    fake_group(m)


def _forked_compile(result):
    Path(f"{result}.started").touch()
    got = TritonCacheManager("KEYF").get_group("k.json")
    Path(result).write_text("loaded" if got else "miss")


def test_a_forked_child_does_not_share_its_parents_compile_lock(tmp_path):
    """The parent compiles a key (holds its lock) and forks: the child's compile of the same key
    waits for the parent's, then loads it, instead of compiling beside it under the parent's lock."""
    parent = TritonCacheManager("KEYF")
    assert parent.get_group("k.json") is None
    result = tmp_path / "child"
    child = multiprocessing.get_context("fork").Process(target=_forked_compile, args=(result,))
    child.start()
    deadline = time.time() + 60
    while not Path(f"{result}.started").exists():
        assert time.time() < deadline and child.is_alive()
        time.sleep(0.01)
    time.sleep(0.5)
    assert not result.exists(), f"the child did not wait for the parent's compile: {result.read_text()}"
    fake_group(parent)
    del parent  # the compile is over: its lock is released
    child.join(timeout=60)
    assert child.exitcode == 0 and result.read_text() == "loaded"


def test_a_link_at_a_lock_path_is_not_followed(tmp_path, caplog):
    locks = jit.cache_root() / "locks"
    locks.mkdir(parents=True)
    (locks / "triton-KEYS.lock").symlink_to(tmp_path / "elsewhere.lock")  # dangling: open would create it
    m = TritonCacheManager("KEYS")
    assert m.get_group("k.json") is None and "cannot lock" in caplog.text  # compiles, unlocked, with a warning
    fake_group(m)
    assert not (tmp_path / "elsewhere.lock").exists()  # nothing made outside the cache
    JitCache().clear()
    assert not os.path.lexists(locks / "triton-KEYS.lock")


def test_a_file_where_the_locks_directory_goes_does_not_hang_a_compile(caplog):
    (jit.cache_root()).mkdir(parents=True)
    (jit.cache_root() / "locks").write_text("not a directory")
    t0 = time.perf_counter()
    m = TritonCacheManager("KEYN")
    assert m.get_group("k.json") is None and "cannot lock" in caplog.text  # compiles, unlocked, with a warning
    assert time.perf_counter() - t0 < 30
    fake_group(m)
    del m
    JitCache().clear()
    assert not any(jit.cache_root().iterdir())


def flashrt_cli(*args, check=True, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashrt.cli", *args], capture_output=True, text=True,
                          env=os.environ | env, cwd="/", check=check, stdin=subprocess.DEVNULL)


def test_ls_and_clear_cli(tmp_path, capsys):
    from flashrt.cli import commands as cli

    fake_group(TritonCacheManager("KEYA" * 8), "double", 90, b"a" * 3000)
    fake_group(TritonCacheManager("KEYB" * 8), "norm", 80, b"b" * 10)
    keep = tmp_path / "cache" / "not-ours.txt"  # beside jit/ in FLASHRT_CACHE_DIR: clear leaves it
    keep.write_text("keep")
    out = flashrt_cli("jit", "ls").stdout
    assert "2 entries" in out and "KEYA" * 3 in out
    assert "double" in out and "sm_90" in out and "norm" in out and "sm_80" in out and " KiB " in out
    assert cli.main(["jit", "ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {(e["kernel"], e["arch"], e["kind"]) for e in listed} == {("double", "sm_90", "triton"),
                                                                     ("norm", "sm_80", "triton")}
    assert cli.main(["jit", "clear"]) == 2  # stdin is not a terminal and no --yes: nothing removed
    assert "without --yes" in capsys.readouterr().err and len(JitCache().entries()) == 2
    out = flashrt_cli("jit", "clear", "--yes").stdout
    assert "removed 16 files" in out  # 2 x (4 artifacts + their checksum sidecars)
    assert JitCache().entries() == [] and keep.read_text() == "keep"
    assert jit.cache_root().is_dir() and not any(jit.cache_root().iterdir())


def test_warmup_calls_each_hook_with_the_profile_active():
    seen = []

    def hook(profile):
        seen.append((profile.name, profiles.active_profile().name, profiles.tiles("linear")))

    def broken(profile):
        raise RuntimeError("ptxas died")

    targets = [("good", hook), ("plain", None), ("broken", broken), ("missing", ImportError("no module")),
               ("idle", lambda p: "no CUDA device")]
    calls = []
    with profiles.using("cpu"):
        report = jit.warmup("h200", targets, progress=lambda done, total: calls.append((done, total)))
        assert profiles.active_profile().name == "cpu"  # restored
    assert seen == [("h200", "h200", profiles.load_profile("h200").tiles["linear"])]
    assert report["warmed"] == ["good"] and report["skipped"] == ["plain", "idle"]
    assert report["notes"] == {"idle": "no CUDA device", "good": report["notes"]["good"]}
    assert report["failed"] == {"broken": "RuntimeError: ptxas died", "missing": "import: ImportError: no module"}
    assert calls == [(i, 5) for i in range(1, 6)]
    assert os.environ["TRITON_CACHE_MANAGER"] == "flashrt.jit_triton:TritonCacheManager"


def test_warmup_cli_goes_through_the_declared_families(capsys):
    from flashrt import dispatch
    from flashrt.cli import commands as cli

    names = {fam.name for fams in dispatch.families().values() for fam in fams if any(f.warmup for f in fams)}
    assert "attention" in names and "kv_gather" in names  # families without a hook are listed too
    rc = cli.main(["jit", "warmup", "--profile", "cpu", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["profile"] == "cpu" and rc == (1 if report["failed"] else 0)
    assert set(report["warmed"]) | set(report["skipped"]) | set(report["failed"]) == names


def test_warmup_with_a_model_loads_its_checkpoint_once(monkeypatch):
    import torch

    from flashrt.cli.jit import warm_model
    from flashrt.engine import run as run_mod

    loaded = []

    def counting_load(path, *args, **kwargs):
        loaded.append(str(path))
        return real_load(path, *args, **kwargs)
    real_load = run_mod.load
    monkeypatch.setattr(run_mod, "load", counting_load)
    report = {"warmed": [], "failed": {}, "notes": {}, "seconds": 0.0}
    threads = torch.get_num_threads()
    try:
        warm_model("tiny", report)
    finally:
        torch.set_num_threads(threads)  # the tiny run pins one thread
    assert report["failed"] == {} and report["warmed"] == ["model:tiny"]
    assert len(loaded) == 1 and loaded[0].endswith("tiny-seed0"), loaded


def test_warmup_with_a_model_runs_it_once(tmp_path):
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "flashrt.cli", "jit", "warmup", "--model", "tiny", "--json"],
                       capture_output=True, text=True, env=env, cwd="/")
    report = json.loads(r.stdout)
    assert "model:tiny" in report["warmed"] and (tmp_path / "models" / "tiny-seed0" / "config.json").exists()
    r = subprocess.run([sys.executable, "-m", "flashrt.cli", "jit", "warmup", "--model", str(tmp_path / "none"),
                        "--json"], capture_output=True, text=True, env=env, cwd="/")
    assert r.returncode == 1 and "model:" in json.loads(r.stdout)["failed"].__repr__()
