"""``FLASHRT_JIT_LOG``: a line per variant built, timed between Triton's two compile hooks."""
import json
import math
import random
import time
from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")

from flashrt import jit_log  # noqa: E402


def _build(key, name, seconds=0.0):
    """What Triton does around one compile: the cache hook, the compile, the post-compile hook."""
    runtime = triton.knobs.runtime  # Triton makes a new ``fn`` record for each hook call
    fn = SimpleNamespace(module="flashrt.kernels_cuda.quant", name=name)
    skipped = runtime.jit_cache_hook(key=key, repr=f"{name}[num_warps=4]()", fn=fn, compile={"key": key})
    if skipped:
        return False
    time.sleep(seconds)
    fn = SimpleNamespace(module="flashrt.kernels_cuda.quant", name=name)
    runtime.jit_post_compile_hook(key=key, repr=f"{name}[num_warps=4]()", fn=fn, compile={"key": key})
    return True


def test_each_variant_built_is_one_line_with_its_seconds(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(("cache", kw["key"])))
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(("post", kw["key"])))
    path = tmp_path / "jit.log"
    path.write_text('{"t": 1.0, "s": 0.5, "name": "older"}\n')  # a line another run wrote: kept
    log = jit_log.JitLog(str(path))
    rng = random.Random()
    builds = [(f"k{i}", rng.choice(["_quant", "_gemm", "_topk"]), rng.choice([0.0, 0.03])) for i in range(6)]
    start = math.floor(time.time() * 1e3) / 1e3  # lines hold the time to the millisecond, rounded
    for key, name, seconds in builds:
        assert _build(key, name, seconds)
    log.close()
    rows = jit_log.read(str(path))
    assert rows[0]["name"] == "older"
    rows = rows[1:]
    assert [(r["key"], r["name"]) for r in rows] == [(k, n) for k, n, _ in builds]
    for r, (_, _, seconds) in zip(rows, builds):
        assert seconds <= r["s"] < seconds + 1.0  # the time between the two hooks
        assert r["repr"].startswith(r["name"])
    assert calls == [(h, k) for k, _, _ in builds for h in ("cache", "post")]  # hooks already set still run
    assert jit_log.between(jit_log.read(str(path)), start, time.time() + 1) == rows


def test_a_cache_hook_that_skips_the_compile_is_honoured_and_close_unhooks(tmp_path, monkeypatch):
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kw: kw["key"] == "skip")
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    previous = triton.knobs.runtime.jit_cache_hook
    log = jit_log.JitLog(str(tmp_path / "jit.log"))
    assert not _build("skip", "_quant")
    assert _build("run", "_quant")
    log.close()
    assert [r["key"] for r in jit_log.read(str(tmp_path / "jit.log"))] == ["run"]
    assert triton.knobs.runtime.jit_cache_hook is previous and triton.knobs.runtime.jit_post_compile_hook is None


def test_between_selects_a_window_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "jit.log"
    times = sorted(random.uniform(0, 100) for _ in range(20))
    path.write_text("".join(json.dumps({"t": t, "s": 0.1, "name": "k"}) + "\n" for t in times) + '{"t": 5')
    rows = jit_log.read(str(path))
    assert len(rows) == 20
    lo, hi = sorted(random.sample(times, 2))
    assert [r["t"] for r in jit_log.between(rows, lo, hi)] == [t for t in times if lo <= t < hi]


def test_install_from_env_once_per_process_and_a_bad_folder_named(tmp_path, monkeypatch):
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(jit_log, "_INSTALLED", {})
    monkeypatch.delenv(jit_log.ENV, raising=False)
    assert jit_log.install_from_env() is None
    monkeypatch.setenv(jit_log.ENV, str(tmp_path / "jit.log"))
    first = jit_log.install_from_env()
    assert jit_log.install_from_env() is first
    first.close()
    monkeypatch.setenv(jit_log.ENV, str(tmp_path / "missing" / "jit.log"))
    with pytest.raises(ValueError, match="FLASHRT_JIT_LOG.*existing folder"):
        jit_log.install_from_env()
