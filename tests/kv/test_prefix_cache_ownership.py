"""The prefix cache touches only files it wrote: user files survive every operation, an empty path
and a foreign non-empty directory are refused."""
import os
import subprocess
import sys
import time

import pytest

from flashrt.kv.prefix_cache import PrefixCache

OLD = time.time() - 30 * 24 * 3600  # far beyond any TTL and the stale-temporary age


def user_files(root):
    """Files a user could keep in (or next to) a cache folder, some named like cache files, all
    with old mtimes; returns {path: bytes}."""
    files = {
        root / "notes.txt": b"my notes",
        root / "ab" / "thesis.kv": b"not a cache entry",
        root / "ab" / ".tmp-draft": b"editor temp",
        root / "cd" / ("cd" * 32 + ".kv"): b"a user file with an entry's name",
        root / "ef" / ".frtkv-tmp-00000000-1-00000000": b"user bytes with a temp file's name",
        root / "deep" / "x" / "y.kv": b"nested",
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (OLD, OLD))
    return files


def assert_intact(files):
    for path, data in files.items():
        assert path.read_bytes() == data, f"{path} was changed or deleted"


def test_user_files_in_the_cache_folder_survive_every_operation(tmp_path, monkeypatch):
    root = tmp_path / "pc"
    cache = PrefixCache(root, ttl_hours=1, max_bytes=3000)
    files = user_files(root)  # added after the cache claimed the folder
    keys = [f"{i:02x}" * 32 for i in range(1, 6)]
    for k in keys:  # over the size cap: LRU eviction runs on every put
        cache.put(k, os.urandom(1000))
    assert cache.get(keys[-1]) is not None
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 10 * 3600)  # every entry expired
    cache.put("ff" * 32, b"y" * 10)
    PrefixCache(root, ttl_hours=1)  # a restart sweeps too
    assert_intact(files)
    assert cache.get("cd" * 32) is None  # a user file under an entry's name is not served...
    assert cache.put("cd" * 32, b"x" * 10) is None  # ...nor replaced
    cache.discard("cd" * 32, "unusable")  # ...nor dropped
    assert_intact(files)
    assert cache.entries() == []  # the cache's own expired entries were swept


def test_a_foreign_non_empty_folder_is_refused_and_left_alone(tmp_path):
    files = user_files(tmp_path)
    with pytest.raises(ValueError, match="not empty and is not a flashrt prefix cache"):
        PrefixCache(tmp_path)
    assert_intact(files)
    assert not (tmp_path / "FLASHRT-PREFIX-CACHE").exists()
    (tmp_path / "FLASHRT-PREFIX-CACHE").write_text("mine\n")  # a marker the cache did not write
    for path in list(files):
        path.unlink()
    with pytest.raises(ValueError, match="not a flashrt prefix cache"):
        PrefixCache(tmp_path)


def test_a_new_or_empty_folder_is_claimed_and_reopened(tmp_path):
    cache = PrefixCache(tmp_path / "new" / "pc")
    assert cache.owned and (tmp_path / "new" / "pc" / "FLASHRT-PREFIX-CACHE").exists()
    cache.put("ab" * 32, b"payload")
    again = PrefixCache(tmp_path / "new" / "pc")  # an existing cache is adopted, entries kept
    assert again.get("ab" * 32) == (b"payload", {})
    empty = tmp_path / "empty"
    empty.mkdir()
    assert PrefixCache(empty).owned


@pytest.mark.parametrize("root", ["", "  "])
def test_an_empty_path_is_rejected(root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path / "models"))
    files = user_files(tmp_path)
    with pytest.raises(ValueError, match="prefix_cache root"):
        PrefixCache(root)
    from flashrt.engine.run import run

    with pytest.raises(ValueError, match="prefix_cache root"):
        run("tiny", prompt="x" * 70, max_new_tokens=1, prefix_cache=root, quiet=True)
    assert_intact(files)
    assert not (tmp_path / "FLASHRT-PREFIX-CACHE").exists()


def test_cli_empty_prefix_cache_is_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flashrt.cli", "run", "--prefix-cache", "", "--max-new-tokens", "1"],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "FLASHRT_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 2 and "--prefix-cache" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "FLASHRT-PREFIX-CACHE").exists()
