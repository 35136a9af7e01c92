"""Shared by the JIT cache tests: a fresh cache directory, Triton groups written through flashrt's
cache manager the way ``triton.compile`` writes them, and compiles that detect an overlap.

A "compile" here is what ``triton.compile`` does with a cache manager: ``get_group`` (a miss takes
the key's lock), ``put`` of each artifact, ``put_group`` (releases the lock). The compile itself is
replaced by :func:`exclusive_build`, which leaves a file ``overlap`` when two builds of one key run
at once, and counts builds in ``builds``.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from flashrt.jit_triton import TritonCacheManager


@pytest.fixture(autouse=True)
def _jit_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "x")  # so that monkeypatch undoes what install() sets
    monkeypatch.delenv("TRITON_CACHE_MANAGER")


def fake_group(manager: TritonCacheManager, kernel: str = "k", arch: int = 90, cubin: bytes | None = None) -> dict:
    """Write a compiled kernel's files and its group, as ``triton.compile`` does after a miss (the
    key's lock, if ``manager`` holds it, stays held until the manager is dropped)."""
    cubin = b"\x7fELF" + os.urandom(64) if cubin is None else cubin
    group = {f"{kernel}.cubin": manager.put(cubin, f"{kernel}.cubin"),
             f"{kernel}.ptx": manager.put("// ptx text", f"{kernel}.ptx", binary=False),
             f"{kernel}.json": manager.put(json.dumps({"name": kernel, "target": {"backend": "cuda", "arch": arch}}),
                                           f"{kernel}.json")}
    manager.put_group(f"{kernel}.json", group)
    return group


def compiled(key: str, kernel: str = "k", arch: int = 90, cubin: bytes | None = None) -> dict:
    """One finished compile of ``key``: a miss, the files written, the manager dropped (which
    releases the key's lock, as at the end of ``triton.compile``). The group."""
    m = TritonCacheManager(key)
    assert m.get_group(f"{kernel}.json") is None
    return fake_group(m, kernel, arch, cubin)


def exclusive_build(marks: Path, seconds: float) -> None:
    """A build that leaves ``marks/overlap`` if another build of the key runs at the same time."""
    mark = marks / "building"
    try:
        fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        (marks / "overlap").touch()
        return
    with open(marks / "builds", "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(seconds)
    os.close(fd)
    mark.unlink()


def builds(marks: Path) -> int:
    counter = Path(marks) / "builds"
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def compile_or_load(key: str, marks: Path, seconds: float = 0.05) -> dict:
    """One ``triton.compile`` of ``key``: load its group (reading every file, as Triton does), or
    build and store it on a miss. The group's file contents."""
    m = TritonCacheManager(key)
    group = m.get_group("k.json")
    if group is None:
        exclusive_build(Path(marks), seconds)
        group = fake_group(m)
    contents = {name: Path(path).read_bytes() for name, path in group.items()}  # as CompiledKernel does
    del m  # releases the key's lock (exclusive after a build, shared after a load)
    return contents


def run_all(targets, timeout: float = 120) -> None:
    """Run (function, args) pairs in forked processes; each must exit 0 within ``timeout``."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=t, args=a) for t, a in targets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * len(procs), f"worker exit codes {codes} (a worker raised or hung)"
