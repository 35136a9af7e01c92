"""Triton's compile cache inside flashrt's: the CacheManager API, install(), and real compiles on CPU.

Triton compiles for an sm_90 target without a GPU (``triton.compile(..., target=GPUTarget(...))``
runs the whole pipeline to a cubin with the bundled ptxas), so the manager is exercised end to end
here; launching the result needs the GPU.
"""
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from flashrt import jit  # noqa: E402
from flashrt.jit_triton import MANAGER_SPEC, TritonCacheManager  # noqa: E402
from jit_helpers import _jit_cache_dir, fake_group  # noqa: E402, F401 (autouse fixture)


CUBIN = b"\x7fELF" + bytes(range(256))


def test_manager_round_trips_files_and_groups():
    m = TritonCacheManager("KEY1")
    assert m.get_file("k.cubin") is None and m.get_group("k.json") is None  # a miss takes the compile lock
    group = fake_group(m, cubin=CUBIN)
    assert m._lock_fd is not None  # ... held until the compile drops its manager
    assert Path(group["k.cubin"]).read_bytes() == CUBIN
    assert Path(m.get_file("k.ptx")).read_text() == "// ptx text"
    del m
    again = TritonCacheManager("KEY1")
    assert again.get_group("k.json") == group and again._lock_fd is None and again._read_fd is not None
    assert Path(group["k.cubin"]).parent == jit.cache_root() / "triton" / "KEY1"
    [entry] = jit.JitCache().entries()
    assert (entry.kind, entry.kernel, entry.arch) == ("triton", "k", "sm_90")


def _rewrite(path: Path, data: bytes) -> None:
    """Replace a file and its checksum sidecar: a well-formed file with other content."""
    path.write_bytes(data)
    (path.parent / f".{path.name}.sha256").write_text(hashlib.sha256(data).hexdigest())


DAMAGE = {
    "flip": lambda g: g["cubin"].write_bytes(bytes([g["cubin"].read_bytes()[0] ^ 1]) + g["cubin"].read_bytes()[1:]),
    "truncate": lambda g: g["cubin"].write_bytes(g["cubin"].read_bytes()[:-3]),
    "empty": lambda g: g["cubin"].write_bytes(b""),
    "appended": lambda g: g["cubin"].write_bytes(g["cubin"].read_bytes() + b"x"),
    "no-sidecar": lambda g: (g["cubin"].parent / ".k.cubin.sha256").unlink(),  # a writer died between the two
    "bad-sidecar": lambda g: (g["cubin"].parent / ".k.cubin.sha256").write_text("0" * 64),
    "group-not-json": lambda g: _rewrite(g["grp"], b"{not json"),
    "group-wrong-key": lambda g: _rewrite(g["grp"], b'{"children": {}}'),
    "group-wrong-layout": lambda g: _rewrite(g["grp"], b'{"child_paths": ["k.cubin"]}'),
    "group-wrong-path": lambda g: _rewrite(g["grp"], b'{"child_paths": {"k.cubin": 7}}'),
    "group-file-missing": lambda g: (g["cubin"].unlink(), (g["cubin"].parent / ".k.cubin.sha256").unlink()),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_artifact_or_group_makes_the_group_a_miss(damage):
    group = fake_group(TritonCacheManager("KEY2"), cubin=CUBIN)
    cubin = Path(group["k.cubin"])
    DAMAGE[damage]({"cubin": cubin, "grp": cubin.parent / "__grp__k.json"})
    m = TritonCacheManager("KEY2")
    assert m.get_group("k.json") is None and m._lock_fd is not None  # a miss: this process compiles
    if damage in ("flip", "truncate", "empty", "appended", "bad-sidecar"):
        assert m.get_file("k.cubin") is None and not cubin.exists()  # dropped
    assert fake_group(m) and TritonCacheManager("KEY2").get_group("k.json") is not None  # rebuilt


def test_install_selects_the_manager_through_triton(monkeypatch):
    from triton.runtime.cache import get_cache_manager

    assert jit.install() and os.environ["TRITON_CACHE_MANAGER"] == MANAGER_SPEC
    manager = get_cache_manager("ab" * 32)  # how compile() gets its manager (Triton reads the variable)
    assert isinstance(manager, TritonCacheManager)
    assert Path(manager.cache_dir).parent == jit.cache_root() / "triton"
    jit.uninstall()
    assert "TRITON_CACHE_MANAGER" not in os.environ
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "mypkg:MyManager")
    assert not jit.install() and os.environ["TRITON_CACHE_MANAGER"] == "mypkg:MyManager"
    assert jit.install(force=True) and os.environ["TRITON_CACHE_MANAGER"] == MANAGER_SPEC


COMPILE = '''
import json, os, sys, time
from pathlib import Path
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashrt import jit

jit.install()
hits = []
triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])


@triton.jit
def double_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


ready, want = Path(sys.argv[1]), int(sys.argv[2])
(ready / str(os.getpid())).touch()
deadline = time.time() + 120
while len(list(ready.iterdir())) < want and time.time() < deadline:  # start together
    time.sleep(0.01)
src = ASTSource(fn=double_kernel, signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 128})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
print(json.dumps({"hits": hits, "cubin": kernel.asm["cubin"].hex()}))
'''


def compile_in_processes(tmp_path: Path, n: int) -> list[dict]:
    script, ready = tmp_path / "compile_double.py", tmp_path / f"ready-{time.monotonic_ns()}"
    script.write_text(COMPILE)
    ready.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "triton-default"), "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, str(script), str(ready), str(n)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(n)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode and "listener" in err:
            pytest.skip("this Triton has no compilation listener")
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.slow
def test_real_triton_compiles_go_through_our_cache_once(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    first = compile_in_processes(tmp_path, 4)  # four processes, one kernel: compiled once
    assert sorted(r["hits"][0] for r in first) == [False, True, True, True]
    assert len({r["cubin"] for r in first}) == 1
    assert not (tmp_path / "triton-default").exists() or not any((tmp_path / "triton-default").rglob("*.cubin"))
    [entry] = [e for e in jit.JitCache().entries() if e.kind == "triton" and e.kernel == "double_kernel"]
    assert entry.arch == "sm_90"
    [cubin] = Path(entry.path).glob("*.cubin")
    cubin.write_bytes(cubin.read_bytes()[:100])  # corrupt it: one of the next two recompiles, once
    after = compile_in_processes(tmp_path, 2)
    assert sorted(r["hits"][0] for r in after) == [False, True]
    assert len({r["cubin"] for r in after}) == 1  # (ptxas output need not be byte-identical across compiles)


def test_cached_only_reads_a_cached_group_and_refuses_a_miss_without_waiting():
    """Under cached_only (this thread): a cached group is read as usual (under the shared lock); a
    miss, or a key whose lock another compile holds, raises NotCached at once and holds nothing."""
    from flashrt import jit_triton
    from flashrt.jit_locks import lock_file

    maker = TritonCacheManager("CACHED")
    assert maker.get_group("k.json") is None
    group = fake_group(maker, cubin=CUBIN)
    del maker
    with jit_triton.cached_only():
        reader = TritonCacheManager("CACHED")
        assert reader.get_group("k.json") == group and reader._read_fd is not None and reader._lock_fd is None
        del reader
        missing = TritonCacheManager("MISSING")
        with pytest.raises(jit_triton.NotCached):
            missing.get_group("k.json")
        assert missing._read_fd is None and missing._lock_fd is None and "MISSING" not in jit_triton._HELD
        compiling = lock_file(jit.cache_root() / "locks" / "triton-CACHED.lock")  # another compile's lock
        try:
            t0 = time.monotonic()
            with pytest.raises(jit_triton.NotCached):
                TritonCacheManager("CACHED").get_group("k.json")
            assert time.monotonic() - t0 < 1.0
        finally:
            os.close(compiling)
    assert not getattr(jit_triton._CACHED_ONLY, "on", False)
    plain = TritonCacheManager("MISSING")  # outside the block: a miss takes the compile lock as before
    assert plain.get_group("k.json") is None and plain._lock_fd is not None
