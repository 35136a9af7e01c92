"""HKCP: paged main KV with a host cold tier, the persistent prefix cache, the window pool."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from flashrt.engine import prefix, session
from flashrt.engine.prefix_entry import FULL, export_row, parse
from flashrt.kv.state import entry_bytes, fixed_bytes_for
from flashrt.kv.prefix_cache import PrefixCache
from flashrt.kv.window_pool import WindowPool
from flashrt.engine import generate


def prompts(rng, model, batch, length):
    return torch.randint(0, model.cfg.vocab_size, (batch, length), generator=rng).tolist()


def test_device_budget_of_ten_percent_gives_the_same_logits(model, rng):
    cfg = model.cfg
    ids = prompts(rng, model, 2, 300)
    full = generate(model, ids, 5, prefill_chunk=16, kv_page_entries=8)
    cap = 305
    main = sum(-(-cap // cfg.ratio(l)) for l in cfg.kv_source_layers) * entry_bytes(cfg.head_dim, "fp4_b16") * 2
    budget = fixed_bytes_for(cfg, 2, cap, page_entries=8) + main // 10
    small = generate(model, ids, 5, prefill_chunk=16, kv_page_entries=8, kv_budget=budget)
    stats = small.state.tier_stats()
    assert stats["device_pages"] * stats["page_bytes"] <= main // 10
    assert stats["cold_pages"] > 5 * stats["device_pages"]  # most of the context is in host memory
    assert torch.equal(full.first_logits, small.first_logits)
    assert full.tokens == small.tokens


def test_budget_too_small_names_kv_budget(model, rng):
    with pytest.raises(ValueError, match="kv_budget"):
        generate(model, prompts(rng, model, 1, 40), 2, kv_budget=1000)


def test_spilled_pages_keep_their_bytes(model, rng):
    ids = torch.tensor(prompts(rng, model, 1, 120))
    state = model.new_state(1, 130)
    model.forward(ids, state=state)
    main = state.compressed[4].main
    before = main.read_row(0, 120)
    for table in main.tables:  # spill every page: a copy before a free
        for j in range(len(table.pages)):
            page = table.pages[j][1]
            state.pool.fifo.move_to_end(page, last=False)
            state.pool.unlock()
            state.pool._spill_one()
    after = main.read_row(0, 120)
    assert all(t == "host" for t, _ in main.tables[0].pages)
    assert torch.equal(before.data, after.data) and torch.equal(before.scale.view(torch.uint8), after.scale.view(torch.uint8))


def test_prefix_entry_restores_the_state_exactly(model, rng):
    ids = torch.tensor(prompts(rng, model, 1, 128))
    state = model.new_state(1, 200)
    full = model.forward(ids, state=state)
    entry = parse(export_row(state, 0, 128, full[0]), model.cfg, model.window_fmt, 128, FULL)
    loaded = model.new_state(1, 200)
    assert torch.equal(prefix.restore(model, loaded, [entry], ids, 128), full)  # no forward at all
    more = torch.tensor(prompts(rng, model, 1, 5))
    assert torch.equal(model.forward(more, state=loaded, all_positions=True),
                       model.forward(more, state=state, all_positions=True))
    # replaying the whole prefix over the loaded global KV reproduces the prefill too
    exact = prefix.restore(model, model.new_state(1, 200), [entry], ids, 128, replay=128)
    assert torch.equal(exact, full)
    # a bounded replay of window_size tokens is an approximation (an explicit option)
    bounded = prefix.restore(model, model.new_state(1, 200), [entry], ids, 128, replay=model.cfg.window_size)
    dev = float((bounded - full).norm() / full.norm())
    print(f"bounded replay rel. deviation (tiny, window 8): {dev:.3f}")
    assert 0 < dev < 2 and torch.isfinite(bounded).all()


def test_generate_with_prefix_cache_miss_then_hit(model, rng, tmp_path):
    cache = PrefixCache(tmp_path)
    ids = prompts(rng, model, 1, 150)
    miss = generate(model, ids, 3, prefix_cache=cache)
    assert cache.hits == 0 and len(cache.entries()) == 1
    hit = generate(model, ids, 3, prefix_cache=cache)
    assert cache.hits == 1 and len(hit.tokens[0]) == 3
    assert torch.isfinite(hit.first_logits).all() and miss.first_logits.shape == hit.first_logits.shape


def test_corrupt_entry_is_detected_and_dropped(tmp_path):
    cache = PrefixCache(tmp_path)
    key = "ab" * 32
    path = cache.put(key, os.urandom(4096), {"tokens": 64})
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert cache.get(key) is None and cache.corrupt == 1 and not path.exists()
    path = cache.put(key, b"x" * 100)
    path.write_bytes(path.read_bytes()[:-5])  # truncated
    assert cache.get(key) is None and not path.exists()


def test_sigkill_while_writing_leaves_nothing_served(tmp_path):
    PrefixCache(tmp_path)  # claimed here: the writer below is killed in its entry's fsync
    script = textwrap.dedent(f"""
        import os, time
        from flashrt.kv.prefix_cache import PrefixCache
        real = os.fsync
        def slow(fd):
            print("writing", flush=True)
            time.sleep(30)
            real(fd)
        os.fsync = slow
        PrefixCache({str(tmp_path)!r}).put("cd" * 32, os.urandom(1 << 20))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob("cd/.frtkv-tmp-*"))  # the killed writer's partial file
    cache = PrefixCache(tmp_path)  # the next start sweeps it: its writer is dead
    assert cache.get("cd" * 32) is None and cache.entries() == []
    assert list(tmp_path.glob("cd/*")) == []


def test_ttl_and_lru_cap(tmp_path, monkeypatch):
    cache = PrefixCache(tmp_path, ttl_hours=1, max_bytes=2500)
    a, b, c = ("a1" * 32), ("b2" * 32), ("c3" * 32)
    cache.put(a, b"a" * 1000)
    time.sleep(0.01)
    cache.put(b, b"b" * 1000)
    time.sleep(0.01)
    assert cache.get(a) is not None  # a is now the most recently used
    time.sleep(0.01)
    cache.put(c, b"c" * 1000)  # over the cap: b (least recently used) goes
    assert cache.get(b) is None and cache.get(a) is not None and cache.get(c) is not None
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 7200)
    assert cache.get(a) is None and not cache.path(a).exists()


def test_pause_and_resume_continue_exactly(model, rng, tmp_path):
    ids = torch.tensor(prompts(rng, model, 1, 150))
    state = model.new_state(1, 300)
    model.forward(ids[:, :137], state=state)
    want = [model.forward(ids[:, i:i + 1], state=state) for i in range(137, 150)]
    paused = model.new_state(1, 300)
    model.forward(ids[:, :137], state=paused)
    cache, pool = PrefixCache(tmp_path), WindowPool(ttl_minutes=5)
    session.pause(model, paused, 0, ids[0, :137].tolist(), cache, pool, "s1")
    resumed = session.resume(model, ids[0, :137].tolist(), cache, pool, "s1", 300)
    got = [model.forward(ids[:, i:i + 1], state=resumed) for i in range(137, 150)]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert session.resume(model, ids[0, :137].tolist(), cache, pool, "s1", 300) is None  # taken


def test_window_pool_ttl(monkeypatch):
    pool = WindowPool(ttl_minutes=1)
    pool.put("s", {"x": torch.ones(3)})
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 120)
    assert pool.take("s") is None
    with pytest.raises(ValueError, match="session_id"):
        pool.put("", {})


def test_kv_sizes_come_from_the_profile(model, monkeypatch):
    """generate() without kv_budget / kv_page_entries takes the model's profile: its page size and
    cold-tier cap (and on CUDA its device budget); explicit arguments win."""
    import dataclasses

    from flashrt import profiles
    from flashrt.engine.generation import profile_kv_sizes

    prof = dataclasses.replace(profiles.load_profile("cpu"), hkcp_page_entries=16, hkcp_cold_host_gib=0.5)
    monkeypatch.setattr(model, "profile", prof, raising=False)
    assert profile_kv_sizes(model, None, None) == (None, 16, 1 << 29)  # CPU: no device budget
    assert profile_kv_sizes(model, 12345, 8) == (12345, 8, 1 << 29)
    out = generate(model, [[1, 2, 3, 4, 5]], 2)
    assert out.state.tier_stats()["page_entries"] == 16
    monkeypatch.setattr(model, "profile", None)
    assert profile_kv_sizes(model, None, None) == (None, 64, None)


def test_a_profile_budget_too_small_says_where_it_came_from(model, monkeypatch):
    import dataclasses

    from flashrt import profiles
    from flashrt.engine import generation as gen

    monkeypatch.setattr(model, "profile", dataclasses.replace(profiles.load_profile("cpu"), name="tiny-card"))
    monkeypatch.setattr(gen, "profile_kv_sizes", lambda m, b, p: (1000, 64, None))  # as on a nearly full device
    with pytest.raises(ValueError, match="kv_budget.*profile 'tiny-card'"):
        generate(model, [[1, 2, 3]], 2)
