"""`flashrt jit clear` next to running compiles and other clears, and `jit ls` over stray files.

Real processes (fork) hammer one key while others clear and list the cache; a build marks itself
with an exclusive file, so two builds of one key at once are seen, and any exception in a worker
fails the test through its exit code. Every loop is bounded in time.
"""
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashrt import jit
from flashrt.jit import JitCache, cache_key, key_parts
from flashrt.jit_triton import TritonCacheManager

PARTS = key_parts("double", "def double(x): ...", "cuda", spec={"BLOCK": 64}, arch="sm_90",
                  toolchain={"torch": "2.13.0", "triton": "3.6.0", "cuda": "13.0"})
STRESS_S = 3.0


@pytest.fixture(autouse=True)
def _cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)


def exclusive_build(marks: Path, payload: bytes, seconds: float):
    """A build that fails loudly (a file in ``marks/overlap``) if another build of the key runs."""
    def build():
        mark = marks / "building"
        try:
            fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            (marks / "overlap").touch()
            return payload
        with open(marks / "builds", "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(seconds)
        os.close(fd)
        mark.unlink()
        return payload
    return build


def _builder(marks, stop_at):
    cache = JitCache()
    while time.time() < stop_at:
        assert cache.get_or_build(PARTS, exclusive_build(Path(marks), b"payload", 0.05), {}) == b"payload"


def _clearer(stop_at):
    while time.time() < stop_at:
        JitCache().clear()
        JitCache().entries()


def run_all(targets) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=t, args=a) for t, a in targets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"worker exit codes {codes} (a worker raised or hung)"


@pytest.mark.xfail(strict=False, reason="known race, open: under full-suite load two builds of one key "
                   "have overlapped while two clears ran (seen once in a CI-like run); this test reports it")
def test_clears_during_compiles_never_run_two_builds_of_one_key(tmp_path):
    stop_at = time.time() + STRESS_S
    run_all([(_builder, (tmp_path, stop_at))] * 3 + [(_clearer, (stop_at,))] * 2)
    assert not (tmp_path / "overlap").exists(), "two builds of one key ran at once"
    builds = len((tmp_path / "builds").read_text().splitlines())
    assert builds > 1  # clears did remove the entry between builds (the race was exercised)
    assert JitCache().get_or_build(PARTS, lambda: b"rebuilt", {}) in (b"payload", b"rebuilt")


def _hold_build(marks, release):
    def build():
        (Path(marks) / "building").touch()
        while not Path(release).exists():
            time.sleep(0.01)
        return b"first"
    JitCache().get_or_build(PARTS, build, {})


def _second_build(marks):
    def build():
        (Path(marks) / "second-built").touch()
        return b"second"
    assert JitCache().get_or_build(PARTS, build, {}) == b"first"


def test_clear_keeps_the_lock_of_a_running_compile(tmp_path):
    ctx = multiprocessing.get_context("fork")
    release = tmp_path / "release"
    first = ctx.Process(target=_hold_build, args=(tmp_path, release))
    first.start()
    deadline = time.time() + 60
    while not (tmp_path / "building").exists():
        assert time.time() < deadline and first.is_alive()
        time.sleep(0.01)
    lock = jit.cache_root() / "locks" / f"{cache_key(PARTS)}.lock"
    inode = lock.stat().st_ino
    files, _, kept = JitCache().clear()
    assert lock.stat().st_ino == inode and kept >= 1  # the lock in use stays
    second = ctx.Process(target=_second_build, args=(tmp_path,))
    second.start()
    time.sleep(0.5)
    assert not (tmp_path / "second-built").exists()  # waits for the first compile of the key
    release.touch()
    for p in (first, second):
        p.join(timeout=60)
        assert p.exitcode == 0
    assert not (tmp_path / "second-built").exists()  # it found the first build's entry
    JitCache().clear()  # nothing compiles now: the idle lock goes too
    assert not lock.exists() and not any(jit.cache_root().rglob("*"))


def test_clear_removes_only_under_its_root_and_counts_what_it_removed(tmp_path):
    cache = JitCache()
    cache.get_or_build(PARTS, lambda: b"x" * 1000, {})
    (jit.cache_root() / "stray.txt").write_text("ours: under the jit root")
    beside = tmp_path / "cache" / "beside.txt"
    beside.write_text("not ours")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (jit.cache_root() / "triton").mkdir()
    (jit.cache_root() / "triton" / "link").symlink_to(outside)  # a link: removed, never followed
    files, size, kept = cache.clear()
    assert files == 4 and size > 1000 and kept == 0  # entry, lock, stray file, link
    assert (outside / "keep.txt").read_text() == "keep" and beside.read_text() == "not ours"
    assert cache.clear() == (0, 0, 0)


def test_concurrent_clears_of_a_full_cache_do_not_fail(tmp_path):
    for i in range(200):
        JitCache().get_or_build(PARTS | {"spec": {"i": i}}, lambda: b"y" * 100, {})
        (jit.cache_root() / "triton" / f"k{i}").mkdir(parents=True)
        (jit.cache_root() / "triton" / f"k{i}" / "a.cubin").write_bytes(b"z")
    stop_at = time.time() + 1.0
    run_all([(_clearer, (stop_at,))] * 3)
    JitCache().clear()
    assert not any(jit.cache_root().rglob("*"))




def fake_group(m: TritonCacheManager) -> dict:
    group = {"k.cubin": m.put(b"\x7fELF" + os.urandom(64), "k.cubin"),
             "k.json": m.put(json.dumps({"name": "k", "target": {"backend": "cuda", "arch": 90}}), "k.json")}
    m.put_group("k.json", group)
    return group


def _triton_worker(marks, stop_at):
    marks = Path(marks)
    while time.time() < stop_at:
        m = TritonCacheManager("KEYT")
        group = m.get_group("k.json")
        if group is None:
            exclusive_build(marks, b"", 0.05)()
            fake_group(m)
        else:
            for path in group.values():  # what Triton's CompiledKernel reads after get_group
                Path(path).read_bytes()
        del m


def test_clears_during_triton_compiles_and_loads(tmp_path):
    stop_at = time.time() + STRESS_S
    run_all([(_triton_worker, (tmp_path, stop_at))] * 3 + [(_clearer, (stop_at,))] * 2)
    assert not (tmp_path / "overlap").exists(), "two compiles of one Triton key ran at once"


def test_clear_keeps_a_triton_group_being_loaded():
    fake_group(TritonCacheManager("KEYL"))
    loading = TritonCacheManager("KEYL")
    group = loading.get_group("k.json")
    assert group is not None
    JitCache().clear()
    assert all(Path(p).exists() for p in group.values())  # held while Triton reads it
    del loading
    JitCache().clear()
    assert not (jit.cache_root() / "triton" / "KEYL").exists()


def stray_cache() -> Path:
    """A cache with one valid entry and every kind of file that does not belong."""
    root = jit.cache_root()
    JitCache().get_or_build(PARTS, lambda: b"ok" * 100, {"kernel": "double"})
    (root / "triton").mkdir(parents=True)
    (root / "triton" / "a-file").write_text("not a key directory")
    (root / "triton" / "empty").mkdir()
    (root / "triton" / "dangling").mkdir()
    (root / "triton" / "dangling" / "k.cubin").symlink_to(root / "nowhere")
    weird = os.fsdecode(b"key-\xff\xfe")
    (root / "triton" / weird).mkdir()
    (root / "triton" / weird / "k.cubin").write_bytes(b"x")
    (root / "entries" / "zz").mkdir()
    (root / "entries" / "zz" / "dir.bin").mkdir()
    (root / "entries" / "zz" / "junk.bin").write_bytes(b"\0" * 5)
    (root / "entries" / "stray.bin").write_text("at the wrong depth")
    (root / "locks" / "notes.txt").write_text("x")
    (root / "README").write_text("x")
    return root


def test_ls_tolerates_stray_files(capsys):
    from flashrt.cli import commands as cli

    stray_cache()
    r = subprocess.run([sys.executable, "-m", "flashrt.cli", "jit", "ls"], capture_output=True, text=True,
                       env=os.environ | {"PYTHONIOENCODING": "utf-8"}, cwd="/", stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "2 entries" in r.stdout and cache_key(PARTS)[:12] in r.stdout and "key-\\xff\\xfe" in r.stdout
    assert cli.main(["jit", "ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {(e["kind"], e["kernel"]) for e in listed} == {("flashrt", "double"), ("triton", "k.cubin")}


def test_clear_removes_stray_files_too():
    root = stray_cache()
    files, _, kept = JitCache().clear()
    assert files >= 9 and kept == 0 and root.is_dir() and not any(root.iterdir())
