"""`flashrt jit clear` next to running compiles and other clears, and `jit ls` over stray files.

Real processes (fork) compile and load one key through the Triton cache manager while others clear
and list the cache; a build marks itself with an exclusive file, so two builds of one key at once
are seen, and any exception in a worker (a file removed while Triton reads it, a crash in a clear)
fails the test through its exit code. Every loop is bounded in time.
"""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flashrt import jit, jit_locks
from flashrt.jit import JitCache
from flashrt.jit_triton import TritonCacheManager
from jit_helpers import _jit_cache_dir, builds, compile_or_load, compiled, fake_group, run_all  # noqa: F401 (autouse fixture)

STRESS_S = 3.0


def _compiler(marks, stop_at):
    while time.time() < stop_at:
        compile_or_load("KEYT", Path(marks))
        time.sleep(0.03)  # idle between compiles: a clear finds the key unused now and then


def _clearer(stop_at):
    while time.time() < stop_at:
        JitCache().clear()
        JitCache().entries()


def test_clears_during_compiles_never_run_two_builds_of_one_key(tmp_path):
    stop_at = time.time() + STRESS_S
    run_all([(_compiler, (tmp_path, stop_at))] * 3 + [(_clearer, (stop_at,))] * 2)
    assert not (tmp_path / "overlap").exists(), "two builds of one key ran at once"
    assert builds(tmp_path) > 1  # clears did remove the group between compiles (the race was exercised)
    assert compile_or_load("KEYT", tmp_path)["k.cubin"].startswith(b"\x7fELF")


def _lock(name: str) -> Path:
    return jit.cache_root() / "locks" / name


@pytest.mark.parametrize("vanishes", ["locks-dir", "lock-file"])
def test_a_lock_that_vanished_and_came_back_during_a_clear_is_kept(monkeypatch, vanishes):
    """The interleaving that ran two builds of one key at once: a clear lists ``locks/`` (or the
    root), another clear then removes the idle lock file (or the empty ``locks/``), and a compile
    makes it again and takes the lock before the first clear looks at the path. The first clear
    must see a lock in use there, never a stray file to remove."""
    lock = _lock("triton-KEYR.lock")
    lock.parent.mkdir(parents=True)
    if vanishes == "lock-file":
        lock.touch()
    listed = jit.cache_root() if vanishes == "locks-dir" else lock.parent
    state = {}
    real_children, real_remove_tree = jit_locks.children, jit_locks.remove_tree

    def compile_starts():  # at the clear's next step once the path has vanished
        if state.get("vanished") and "compiler" not in state:
            state["compiler"] = TritonCacheManager("KEYR")
            assert state["compiler"].get_group("k.json") is None  # a miss: holds the key's lock
            state["inode"] = os.fstat(state["compiler"]._lock_fd).st_ino

    def children(path):
        out = real_children(path)
        compile_starts()
        if path == listed and not state:  # right after the listing, another clear removes it
            (lock.parent.rmdir if vanishes == "locks-dir" else lock.unlink)()
            state["vanished"] = True
        return out

    def remove_tree(*args, **kwargs):
        compile_starts()
        return real_remove_tree(*args, **kwargs)

    monkeypatch.setattr(jit_locks, "children", children)
    monkeypatch.setattr(jit_locks, "remove_tree", remove_tree)
    try:
        jit_locks.clear_cache(jit.cache_root())
        compile_starts()
        assert lock.exists() and lock.stat().st_ino == state["inode"], "a lock in use was removed"
        assert jit_locks.lock_file(lock, deadline=0.0) is None  # still held: another compile waits
    finally:
        state.pop("compiler", None)  # the compile ends: its lock is released


def test_clears_run_one_at_a_time():
    fake_group(TritonCacheManager("KEYO"))
    fd = os.open(jit.cache_root(), os.O_RDONLY | os.O_DIRECTORY)
    jit_locks.fcntl.flock(fd, jit_locks.fcntl.LOCK_EX)  # as a running clear holds it
    done = []
    clear = threading.Thread(target=lambda: done.append(JitCache().clear()))
    clear.start()
    time.sleep(0.5)
    assert not done and (jit.cache_root() / "triton" / "KEYO").exists()  # waits for the other clear
    os.close(fd)
    clear.join(timeout=60)
    assert done and done[0][0] == 8 and not (jit.cache_root() / "triton").exists()


def _hold_compile(marks, release):
    m = TritonCacheManager("KEYH")
    assert m.get_group("k.json") is None
    (Path(marks) / "building").touch()
    while not Path(release).exists():
        time.sleep(0.01)
    fake_group(m, cubin=b"first")


def _second_compile(marks):
    m = TritonCacheManager("KEYH")
    group = m.get_group("k.json")
    if group is None:
        (Path(marks) / "second-built").touch()
        fake_group(m, cubin=b"second")
    else:
        assert Path(group["k.cubin"]).read_bytes() == b"first"


def test_clear_keeps_the_lock_of_a_running_compile(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    release = tmp_path / "release"
    first = ctx.Process(target=_hold_compile, args=(tmp_path, release))
    first.start()
    deadline = time.time() + 60
    while not (tmp_path / "building").exists():
        assert time.time() < deadline and first.is_alive()
        time.sleep(0.01)
    lock = _lock("triton-KEYH.lock")
    inode = lock.stat().st_ino
    files, _, kept = JitCache().clear()
    assert lock.stat().st_ino == inode and kept >= 1  # the lock in use stays
    second = ctx.Process(target=_second_compile, args=(tmp_path,))
    second.start()
    time.sleep(0.5)
    assert not (tmp_path / "second-built").exists()  # waits for the first compile of the key
    release.touch()
    for p in (first, second):
        p.join(timeout=60)
        assert p.exitcode == 0
    assert not (tmp_path / "second-built").exists()  # it loaded the first compile's group
    JitCache().clear()  # nothing compiles now: the idle lock goes too
    assert not lock.exists() and not any(jit.cache_root().rglob("*"))


def test_clear_removes_only_under_its_root_and_counts_what_it_removed(tmp_path):
    compiled("KEYU", cubin=b"x" * 1000)
    (jit.cache_root() / "stray.txt").write_text("ours: under the jit root")
    beside = tmp_path / "cache" / "beside.txt"
    beside.write_text("not ours")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (jit.cache_root() / "triton" / "link").symlink_to(outside)  # a link: removed, never followed
    files, size, kept = JitCache().clear()
    assert files == 11 and size > 1000 and kept == 0  # 4 artifacts + 4 sidecars, lock, stray file, link
    assert (outside / "keep.txt").read_text() == "keep" and beside.read_text() == "not ours"
    assert JitCache().clear() == (0, 0, 0)


def test_concurrent_clears_of_a_full_cache_do_not_fail():
    for i in range(150):
        if i % 3 == 0:
            compiled(f"KEY{i}")
        (jit.cache_root() / "triton" / f"bare{i}").mkdir(parents=True)
        (jit.cache_root() / "triton" / f"bare{i}" / "a.cubin").write_bytes(b"z")
    stop_at = time.time() + 1.0
    run_all([(_clearer, (stop_at,))] * 3)
    JitCache().clear()
    assert not any(jit.cache_root().rglob("*"))


def test_clear_keeps_the_files_a_finished_compile_reads_next():
    """After ``put_group``, ``triton.compile`` reads the files it wrote (``CompiledKernel``): until
    the compile drops its manager, a clear keeps them."""
    m = TritonCacheManager("KEYP")
    assert m.get_group("k.json") is None
    group = fake_group(m)
    files, _, kept = JitCache().clear()
    assert kept >= 1 and all(Path(p).read_bytes() for p in group.values())
    del m
    JitCache().clear()
    assert not (jit.cache_root() / "triton" / "KEYP").exists()


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
    """A cache with one valid group and every kind of file that does not belong."""
    root = jit.cache_root()
    fake_group(TritonCacheManager("KEYV"), "double")
    (root / "triton" / "a-file").write_text("not a key directory")
    (root / "triton" / "empty").mkdir()
    (root / "triton" / "dangling").mkdir()
    (root / "triton" / "dangling" / "k.cubin").symlink_to(root / "nowhere")
    weird = os.fsdecode(b"key-\xff\xfe")
    (root / "triton" / weird).mkdir()
    (root / "triton" / weird / "k.cubin").write_bytes(b"x")
    (root / "entries" / "zz").mkdir(parents=True)  # an older flashrt's entry store: nothing reads it
    (root / "entries" / "zz" / "dir.bin").mkdir()
    (root / "entries" / "zz" / "junk.bin").write_bytes(b"\0" * 5)
    (root / "locks").mkdir()
    (root / "locks" / "notes.txt").write_text("x")
    (root / "locks" / "a-dir.lock").mkdir()
    (root / "locks" / "link.lock").symlink_to(root / "README")
    (root / "README").write_text("x")
    return root


def test_ls_tolerates_stray_files(capsys):
    from flashrt.cli import commands as cli

    stray_cache()
    r = subprocess.run([sys.executable, "-m", "flashrt.cli", "jit", "ls"], capture_output=True, text=True,
                       env=os.environ | {"PYTHONIOENCODING": "utf-8"}, cwd="/", stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "2 entries" in r.stdout and "KEYV" in r.stdout and "key-\\xff\\xfe" in r.stdout
    assert cli.main(["jit", "ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {(e["kind"], e["kernel"]) for e in listed} == {("triton", "double"), ("triton", "k.cubin")}


def test_clear_removes_stray_files_too():
    root = stray_cache()
    files, _, kept = JitCache().clear()
    assert files == 15 and kept == 0 and root.is_dir() and not any(root.iterdir())
