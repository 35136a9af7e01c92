"""Every prefix-cache I/O error is logged once and becomes a miss or a skipped store: generation
goes on with the answer it gives without a cache."""
import builtins
import errno
import json
import logging
import os
import re

import pytest
import torch

import flashrt.kv.prefix_cache as pc
from flashrt.engine import generate, prefix
from flashrt.kv.prefix_cache import PrefixCache


@pytest.fixture
def ids(model, rng):
    return torch.randint(0, model.cfg.vocab_size, (1, 100), generator=rng).tolist()


@pytest.fixture
def want(model, ids):
    return generate(model, ids, 3)


def same(got, want):
    return got.tokens == want.tokens and torch.equal(got.first_logits, want.first_logits)


def warnings(caplog):
    return [r for r in caplog.records if r.name == "flashrt" and r.levelno >= logging.WARNING]


def key_of(model, ids):
    return prefix.entry_key(model, ids[0][:64])


def test_root_is_a_file(model, ids, want, tmp_path, caplog):
    path = tmp_path / "cache"
    path.write_bytes(b"user data")
    cache = PrefixCache(path)
    assert not cache.owned and len(warnings(caplog)) == 1
    for _ in range(2):
        assert same(generate(model, ids, 3, prefix_cache=cache), want)
    assert cache.hits == 0 and path.read_bytes() == b"user data"
    assert len(warnings(caplog)) == 1  # once


def test_read_only_file_system(model, ids, want, tmp_path, caplog, monkeypatch):
    cache = PrefixCache(tmp_path / "pc")
    generate(model, ids, 3, prefix_cache=cache)  # stores the 64-token prefix

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    real_open = builtins.open
    monkeypatch.setattr(pc, "open", lambda f, mode="r", *a, **k: (
        read_only() if any(c in mode for c in "wxa+") else real_open(f, mode, *a, **k)), raising=False)
    for name in ("mkdir", "utime", "replace", "unlink"):
        monkeypatch.setattr(os, name, read_only)
    assert same(generate(model, ids, 3, prefix_cache=cache), want)  # a hit: reads still work
    assert cache.hits == 1
    longer = [ids[0] + ids[0][:40]]  # its 128-token prefix cannot be stored
    assert generate(model, longer, 2, prefix_cache=cache).tokens == generate(model, longer, 2).tokens
    assert len(cache.entries()) == 1
    fresh = PrefixCache(tmp_path / "new")  # cannot even be created
    assert not fresh.owned and same(generate(model, ids, 3, prefix_cache=fresh), want)
    assert generate(model, longer, 2, prefix_cache=cache).tokens == generate(model, longer, 2).tokens
    kinds = [(r.getMessage().split(": ")[1], re.search(r": (\w+) failed", r.getMessage())[1]) for r in warnings(caplog)]
    assert len(kinds) == len(set(kinds))
    assert {k for _, k in kinds} == {"touch", "store", "open"}  # each failing operation logged once


def test_a_store_refused_in_an_existing_shard_deletes_nothing(tmp_path, caplog, monkeypatch, rng):
    """A store whose temporary file cannot be created (a read-only file system) where its shard folder
    already exists: one store failure and no removal tried (no temporary was made)."""
    cache = PrefixCache(tmp_path / "pc")
    digits = "0123456789abcdef"
    key = lambda: "".join(digits[i] for i in torch.randint(0, 16, (64,), generator=rng).tolist())
    first, second = key(), key()
    second = first[:2] + second[2:]  # the same shard folder
    assert cache.put(first, b"x" * 100) is not None

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    real_open = builtins.open
    monkeypatch.setattr(pc, "open", lambda f, mode="r", *a, **k: (
        read_only() if any(c in mode for c in "wxa+") else real_open(f, mode, *a, **k)), raising=False)
    for name in ("utime", "replace", "unlink"):
        monkeypatch.setattr(os, name, read_only)
    assert cache.put(second, b"y" * 100) is None
    kinds = [re.search(r": (\w+) failed", r.getMessage())[1] for r in warnings(caplog)]
    assert kinds == ["store"] and cache.get(first)[0] == b"x" * 100


def test_disk_full_removes_the_partial_write(model, ids, want, tmp_path, caplog, monkeypatch):
    def full(f, header, payload):
        f.write(header + payload[: len(payload) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PrefixCache, "_write", staticmethod(full))
    cache = PrefixCache(tmp_path)
    for _ in range(2):
        assert same(generate(model, ids, 3, prefix_cache=cache), want)
    assert cache.entries() == [] and cache.errors == 2
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["FLASHRT-PREFIX-CACHE"]
    assert len(warnings(caplog)) == 1


def test_entry_evicted_by_another_process(model, ids, want, tmp_path, monkeypatch):
    cache = PrefixCache(tmp_path)
    generate(model, ids, 3, prefix_cache=cache)
    entry = cache.path(key_of(model, ids))
    real_open, raced = builtins.open, []

    def evict_first(f, mode="r", *a, **k):  # the other process wins the race: gone before the read
        if str(f) == str(entry) and not raced:
            raced.append(entry.unlink())
        return real_open(f, mode, *a, **k)

    monkeypatch.setattr(pc, "open", evict_first, raising=False)
    assert same(generate(model, ids, 3, prefix_cache=cache), want) and cache.hits == 0
    monkeypatch.undo()
    monkeypatch.setattr(pc, "open", builtins.open, raising=False)
    real_utime = os.utime

    def evict_after_read(path, *a, **k):  # gone after the read: the bytes read are still whole
        if str(path) == str(entry):
            os.unlink(path)
        return real_utime(path, *a, **k)

    monkeypatch.setattr(os, "utime", evict_after_read)
    assert same(generate(model, ids, 3, prefix_cache=cache), want) and cache.hits == 1


def test_entry_of_an_unexpected_layout_or_version_is_dropped(model, ids, want, tmp_path, caplog):
    cache = PrefixCache(tmp_path)
    key = key_of(model, ids)
    state = model.new_state(1, 64)
    out = model.forward(torch.tensor([ids[0][:64]]), state=state)
    cases = {  # well formed (header, checksum) but not what the model reads
        "global entry under a full key": prefix.export_row(state, 0, 64),
        "shorter entry": prefix.export_row(model.new_state(1, 32), 0, 0),
        "not safetensors": os.urandom(512),
    }
    for name, payload in cases.items():
        cache.put(key, payload, {"tokens": 64, "kind": "full"})
        assert same(generate(model, ids, 3, prefix_cache=cache), want), name
        assert cache.hits == 0, name
    good = prefix.export_row(state, 0, 64, out[0])
    cache.put(key, good, {"tokens": 32, "kind": "full"})  # meta does not match the key
    assert same(generate(model, ids, 3, prefix_cache=cache), want) and cache.hits == 0
    path = cache.path(key)
    header = json.loads(path.read_bytes().split(b"\n", 1)[0][len(pc.HEADER):])
    header["version"] = 1  # an older format
    path.write_bytes(b"FRTKV1 " + json.dumps(header).encode() + b"\n" + path.read_bytes().split(b"\n", 1)[1])
    assert same(generate(model, ids, 3, prefix_cache=cache), want) and cache.hits == 0
    assert same(generate(model, ids, 3, prefix_cache=cache), want) and cache.hits == 1  # stored again, served
    assert len([r for r in warnings(caplog) if "load failed" in r.getMessage()]) == 1


def test_leftovers_of_killed_saves_are_swept_at_start(tmp_path):
    import time

    PrefixCache(tmp_path)
    (tmp_path / "ab").mkdir()
    dead = subprocess_pid()
    names = {"dead": f".frtkv-tmp-{pc.HOST}-{dead}-00000001", "live": f".frtkv-tmp-{pc.HOST}-{os.getppid()}-00000002",
             "other host": f".frtkv-tmp-ffffffff-{dead}-00000003", "old": f".frtkv-tmp-ffffffff-{dead}-00000004"}
    for name in names.values():
        (tmp_path / "ab" / name).write_bytes(pc.HEADER + b"{}\n partial")
    old = time.time() - 2 * pc.STALE_TMP_S
    os.utime(tmp_path / "ab" / names["old"], (old, old))
    PrefixCache(tmp_path)
    left = {p.name for p in (tmp_path / "ab").iterdir()}
    assert left == {names["live"], names["other host"]}


def subprocess_pid() -> int:
    """The pid of a process that has exited."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_session_resume_after_its_entry_was_evicted_is_a_miss(model, ids, tmp_path):
    from flashrt.engine import session
    from flashrt.kv.window_pool import WindowPool

    state = model.new_state(1, 120)
    model.forward(torch.tensor(ids), state=state)
    cache, pool = PrefixCache(tmp_path), WindowPool(ttl_minutes=5)
    session.pause(model, state, 0, ids[0], cache, pool, "s")
    (path,) = [p for p, _, _ in cache.entries()]
    path.unlink()  # another process evicted it
    assert session.resume(model, ids[0], cache, pool, "s", 120) is None  # prefill again


def test_each_chunk_of_a_payload_is_checked(tmp_path, monkeypatch, rng):
    """Entries carry one sha256 per ``CHUNK`` bytes (hashed on threads): the digests are those of
    the pieces, and a byte changed in any piece makes the entry a miss that is deleted."""
    import hashlib

    monkeypatch.setattr(pc, "CHUNK", int(torch.randint(1, 64, (), generator=rng)))
    cache = PrefixCache(tmp_path / "c")
    for n in (0, pc.CHUNK, 3 * pc.CHUNK, int(torch.randint(1, 8 * pc.CHUNK, (), generator=rng))):
        payload = os.urandom(n)
        want = [hashlib.sha256(payload[i:i + pc.CHUNK]).hexdigest() for i in range(0, n, pc.CHUNK)]
        assert pc.digests(payload, pc.CHUNK) == (want or [hashlib.sha256(b"").hexdigest()])
        key = hashlib.sha256(payload + b"k").hexdigest()
        path = cache.put(key, payload, {"n": n})
        assert cache.get(key) == (payload, {"n": n})
        if n:
            raw = bytearray(path.read_bytes())
            raw[-1 - int(torch.randint(0, n, (), generator=rng))] ^= 0x40
            path.write_bytes(bytes(raw))
            corrupt = cache.corrupt
            assert cache.get(key) is None and cache.corrupt == corrupt + 1 and not path.exists()
