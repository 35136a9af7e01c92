"""JIT compile-and-cache: keys, concurrent builders, killed writers, corruption, the CLI, warmup."""
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
from flashrt.jit import JitCache, cache_key, key_parts

PARTS = key_parts("double", "def double(x): ...", "cuda", spec={"BLOCK": 128, "num_warps": 4}, arch="sm_90",
                  toolchain={"torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0"})


@pytest.fixture(autouse=True)
def _cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "x")  # so that monkeypatch undoes what install() sets
    monkeypatch.delenv("TRITON_CACHE_MANAGER")
    profiles.use_profile(None)
    yield
    profiles.use_profile(None)


def counting_build(counter: Path, payload: bytes, delay: float = 0.0):
    def build():
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(delay)
        return payload
    return build


def builds(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def test_cache_root_and_arch_defaults(monkeypatch, tmp_path):
    assert jit.cache_root() == tmp_path / "cache" / "jit"
    monkeypatch.delenv("FLASHRT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit.cache_root() == tmp_path / "xdg" / "flashrt" / "jit"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert jit.device_arch("cpu") == "cpu-interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert jit.device_arch("cpu") == "cpu"
    versions = jit.toolchain_versions()
    assert {"torch", "triton", "cuda", "torch_npu", "cann"} <= set(versions) and versions["torch"]


def test_key_changes_with_source_constexpr_arch_toolchain_and_backend():
    base = cache_key(PARTS)
    assert base == cache_key(dict(reversed(list(PARTS.items()))))  # canonical: order does not matter
    changed = [
        key_parts("double", "def double(x): return 2 * x", "cuda", PARTS["spec"], "sm_90", PARTS["toolchain"]),
        key_parts("double", "def double(x): ...", "cuda", {"BLOCK": 256, "num_warps": 4}, "sm_90", PARTS["toolchain"]),
        key_parts("double", "def double(x): ...", "cuda", {"BLOCK": 128, "num_warps": 8}, "sm_90", PARTS["toolchain"]),
        key_parts("double", "def double(x): ...", "cuda", PARTS["spec"], "sm_80", PARTS["toolchain"]),
        key_parts("double", "def double(x): ...", "cuda", PARTS["spec"], "sm_90", PARTS["toolchain"] | {"triton": "3.5.1"}),
        key_parts("double", "def double(x): ...", "cuda", PARTS["spec"], "sm_90", PARTS["toolchain"] | {"cuda": "12.8"}),
        key_parts("double", "def double(x): ...", "ascend", PARTS["spec"], "ascend910b", PARTS["toolchain"]),
    ]
    keys = {cache_key(p) for p in changed}
    assert len(keys) == len(changed) and base not in keys
    assert jit.source_hash(jit) == jit.source_hash(Path(jit.__file__).read_bytes())  # a module: its file
    assert jit.source_hash(jit.cache_key) == jit.source_hash(jit)  # a function: its module's file


def test_build_once_then_hit_from_disk(tmp_path):
    counter = tmp_path / "builds"
    first = JitCache().get_or_build(PARTS, counting_build(counter, b"cubin" * 100), {"kernel": "double"})
    again = JitCache()  # another process's view: nothing in memory
    assert again.get_or_build(PARTS, counting_build(counter, b"other"), {}) == first == b"cubin" * 100
    assert builds(counter) == 1 and again.hits == 1 and again.builds == 0
    with pytest.raises(TypeError, match="must return bytes"):
        JitCache().get_or_build(PARTS | {"spec": {}}, lambda: "text", {})


def _concurrent_worker(root, counter, barrier, results):
    barrier.wait()
    payload = f"built by {os.getpid()}".encode() + os.urandom(32)  # differs per builder
    results.put(JitCache(root).get_or_build(PARTS, counting_build(Path(counter), payload, 0.5), {}))


def test_concurrent_processes_build_one_key_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    counter = tmp_path / "builds"
    procs = [ctx.Process(target=_concurrent_worker, args=(jit.cache_root(), str(counter), barrier, results))
             for _ in range(4)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert builds(counter) == 1 and len(set(got)) == 1 and got[0].startswith(b"built by ")


def _run_killed(script: str, *args) -> subprocess.Popen:
    code = "import os, signal, sys, time\nfrom flashrt import jit\n" + textwrap.dedent(script)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env)


def test_a_writer_killed_mid_write_leaves_nothing_that_is_served(tmp_path):
    parts = json.dumps(PARTS)
    proc = _run_killed("""
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # die with the temp file written, not renamed
        jit.JitCache().get_or_build(__import__("json").loads(sys.argv[1]), lambda: b"partial" * 100000, {})
    """, parts)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    cache, key = JitCache(), cache_key(PARTS)
    assert not cache.entry_path(key).exists() and cache.read(key) is None
    assert list(cache.entry_path(key).parent.glob("*.tmp.*"))  # the dead writer's temp file
    counter = tmp_path / "builds"
    assert cache.get_or_build(PARTS, counting_build(counter, b"whole"), {}) == b"whole" and builds(counter) == 1
    assert not list(cache.entry_path(key).parent.glob("*.tmp.*"))  # cleaned under the lock


def test_a_builder_killed_while_holding_the_lock_does_not_block_others(tmp_path):
    marker = tmp_path / "building"
    proc = _run_killed("""
        parts = __import__("json").loads(sys.argv[1])
        def build():
            open(sys.argv[2], "w").close()
            time.sleep(600)
        jit.JitCache().get_or_build(parts, build, {})
    """, json.dumps(PARTS), marker)
    deadline = time.time() + 120
    while not marker.exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    t0 = time.perf_counter()
    assert JitCache().get_or_build(PARTS, lambda: b"rebuilt", {}) == b"rebuilt"
    assert time.perf_counter() - t0 < 10


def _entry_after(damage) -> tuple[JitCache, bytes]:
    JitCache().get_or_build(PARTS, lambda: b"payload-bytes" * 50, {"kernel": "double"})
    path = JitCache().entry_path(cache_key(PARTS))
    blob = bytearray(path.read_bytes())
    path.write_bytes(bytes(damage(blob)))
    cache = JitCache()
    return cache, cache.get_or_build(PARTS, lambda: b"payload-bytes" * 50, {"kernel": "double"})


def flip(offset):
    def damage(blob):
        blob[offset] ^= 0x40
        return blob
    return damage


HEADER = jit._PREFIX.size + 3


@pytest.mark.parametrize("damage", [flip(0), flip(12), flip(jit._PREFIX.size - 1), flip(HEADER), flip(-200),
                                    flip(-1), lambda b: b[:0], lambda b: b[:20], lambda b: b[:HEADER],
                                    lambda b: b[:-1], lambda b: b + b"x"],
                         ids=["magic", "digest", "header-length", "header", "payload", "last-byte", "empty",
                              "truncated-prefix", "truncated-header", "truncated-payload", "appended"])
def test_a_corrupt_entry_is_detected_dropped_and_rebuilt(damage):
    cache, payload = _entry_after(damage)
    assert payload == b"payload-bytes" * 50 and cache.builds == 1 and cache.dropped == 1
    assert JitCache().read(cache_key(PARTS)) == payload  # whole again on disk


def test_an_entry_under_the_wrong_key_is_not_served():
    cache = JitCache()
    other = PARTS | {"arch": "sm_80"}
    cache.get_or_build(other, lambda: b"for sm_80", {})
    src, dst = cache.entry_path(cache_key(other)), cache.entry_path(cache_key(PARTS))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())
    assert cache.get_or_build(PARTS, lambda: b"for sm_90", {}) == b"for sm_90" and cache.dropped == 1


def flashrt_cli(*args, check=True, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashrt.cli", *args], capture_output=True, text=True,
                          env=os.environ | env, cwd="/", check=check, stdin=subprocess.DEVNULL)


def test_ls_and_clear_cli(tmp_path, capsys):
    from flashrt.cli import commands as cli

    cache = JitCache()
    cache.get_or_build(PARTS, lambda: b"a" * 3000, {"kernel": "double"})
    cache.get_or_build(PARTS | {"kernel": "norm", "arch": "sm_80"}, lambda: b"b" * 10, {})
    keep = tmp_path / "cache" / "not-ours.txt"  # beside jit/ in FLASHRT_CACHE_DIR: clear leaves it
    keep.write_text("keep")
    out = flashrt_cli("jit", "ls").stdout
    assert "2 entries" in out and cache_key(PARTS)[:12] in out
    assert "double" in out and "sm_90" in out and "norm" in out and "sm_80" in out and " KiB " in out
    assert cli.main(["jit", "ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {(e["kernel"], e["arch"], e["kind"]) for e in listed} == {("double", "sm_90", "flashrt"),
                                                                     ("norm", "sm_80", "flashrt")}
    assert cli.main(["jit", "clear"]) == 2  # stdin is not a terminal and no --yes: nothing removed
    assert "without --yes" in capsys.readouterr().err and len(JitCache().entries()) == 2
    out = flashrt_cli("jit", "clear", "--yes").stdout
    assert "removed" in out and JitCache().entries() == [] and keep.read_text() == "keep"
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


def test_warmup_with_a_model_runs_it_once(tmp_path):
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "flashrt.cli", "jit", "warmup", "--model", "tiny", "--json"],
                       capture_output=True, text=True, env=env, cwd="/")
    report = json.loads(r.stdout)
    assert "model:tiny" in report["warmed"] and (tmp_path / "models" / "tiny-seed0" / "config.json").exists()
    r = subprocess.run([sys.executable, "-m", "flashrt.cli", "jit", "warmup", "--model", str(tmp_path / "none"),
                        "--json"], capture_output=True, text=True, env=env, cwd="/")
    assert r.returncode == 1 and "model:" in json.loads(r.stdout)["failed"].__repr__()
