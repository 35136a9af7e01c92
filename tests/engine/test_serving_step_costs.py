"""Host-side costs of a serving step (CPU): pools that would grow during a run are allocated up front
so captured decode steps are not recaptured for a moved pool; a decode step issues no synchronous
host->device copy from the engine; a changed block table goes to the device in one copy; the step
timer records device events only when asked."""
import collections
import os
import random
import time

import pytest
import torch

from flashrt.engine import Engine, EngineConfig, SamplingParams
from flashrt.engine import slots as slots_mod
from flashrt.engine import step_capture as sc
from flashrt.engine import step_timing
from flashrt.engine.step_timing import StepTimer
from flashrt.kv.main_kv import PagedMainKV
from flashrt.kv.pages import PagePool

ENGINE_DIR = os.path.dirname(slots_mod.__file__)


class KeyCounter:
    """Stands in for the capture: records each runner's capture keys (a new key = a capture)."""

    def __init__(self, monkeypatch):
        self.keys = collections.defaultdict(list)
        orig = sc.StepCapture._step

        def step(runner, entries, buffers):
            key = (tuple(sorted(entries.items())), buffers.cold, buffers.layout(), runner._layout())
            if key not in self.keys[id(runner)]:
                self.keys[id(runner)].append(key)
            return orig(runner, entries, buffers)
        monkeypatch.setattr(sc.StepCapture, "_step", step)

    def layouts(self) -> list[int]:
        """Distinct state layouts (tensor addresses and shapes) each runner was captured for."""
        return [len({k[2] for k in ks}) for ks in self.keys.values()]


def run_waves(core, rng, waves, rows, max_tokens):
    ids = iter(range(10 ** 6))
    for _ in range(waves):
        for _ in range(rows):
            n = int(torch.randint(20, 60, (1,), generator=rng))
            core.add(f"r{next(ids)}", torch.randint(0, 256, (n,), generator=rng).tolist(),
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while core.has_work:
            core.step()


def test_growing_pools_do_not_recapture_decode_steps(model, rng, monkeypatch):
    counter = KeyCounter(monkeypatch)
    engine = Engine(model, prefill_chunk=16, max_step_tokens=256, max_running=8, cuda_graphs=True,
                    prefix_cache_bytes=0, kv_budget=64 << 20, max_model_len=128)
    core = engine.step_loop
    pool = core.pool
    before = (pool.device_pages, pool.index_pool.dev.shape[0], pool.generation, pool.index_pool.generation)
    # 8 rows running to ~90 positions: without pages allocated up front both pools double mid-run
    run_waves(core, rng, 2, 8, 30)
    assert (pool.device_pages, pool.index_pool.dev.shape[0], pool.generation, pool.index_pool.generation) == before
    assert counter.keys and counter.layouts() == [1] * len(counter.keys)
    assert core.counters["decode_captures"] == 0  # CPU: the static-buffer step runs eagerly
    assert core.counters["decode_eager"] == core.counters["decode_steps"] > 0 == core.counters["decode_replays"]
    assert pool.pages_in_use == 0 and pool.index_pool.pages_in_use == 0


def test_captures_are_counted(model, rng, monkeypatch):
    real = sc.StepCapture.step

    def step(runner, ids):  # a capture per new runner, as the first CUDA step of a shape makes
        runner.stats["captured"] += not runner.stats["eager"]
        return real(runner, ids)
    monkeypatch.setattr(sc.StepCapture, "step", step)
    engine = Engine(model, prefill_chunk=16, max_step_tokens=256, max_running=8, cuda_graphs=True,
                    prefix_cache_bytes=0)
    core = engine.step_loop
    run_waves(core, rng, 1, 6, 4)
    # the runners that decoded (a bucket of 4 rows, then 8, or 8 at once); a runner made for rows
    # whose sequences all finished before a decode step in it has nothing to capture
    runners = sum(1 for _, cap in core.slots.cache.values() if cap is not None and any(cap.stats.values()))
    assert runners >= 1 and core.counters["decode_captures"] == runners
    assert engine.stats()["decode_captures"] == runners


def test_pools_are_reserved_within_the_budget(model):
    cfg = EngineConfig(max_running=8, prefill_chunk=16, kv_budget=64 << 20, max_model_len=4096).resolve(model)
    pool, _ = cfg.make_pool(model)
    limit = pool.limit
    rows_positions = cfg.reserve_pools(model, pool, 4097)
    assert pool.device_pages <= limit
    assert 16 <= rows_positions <= 4097
    # the engine's own page limit caps the reservation too
    capped = EngineConfig(max_running=8, prefill_chunk=16, kv_budget=64 << 20, max_model_len=4096,
                          max_kv_pages=40).resolve(model)
    pool, _ = capped.make_pool(model)
    capped.reserve_pools(model, pool, 4097)
    assert pool.device_pages == 40  # 8 rows of 4097 positions need more: grown to the cap, not past it
    # without a device budget nothing is reserved: the pools grow on demand
    free = EngineConfig(max_running=8, prefill_chunk=16).resolve(model)
    pool, _ = free.make_pool(model)
    pages = pool.device_pages
    assert free.reserve_pools(model, pool, 4097) == 16 and pool.device_pages == pages


def test_a_decode_step_makes_no_blocking_host_to_device_copy(model, rng, monkeypatch):
    engine = Engine(model, prefill_chunk=16, max_step_tokens=256, max_running=8, cuda_graphs=True,
                    prefix_cache_bytes=0)
    core = engine.step_loop
    for i in range(5):
        core.add(f"r{i}", torch.randint(0, 256, (int(torch.randint(5, 15, (1,), generator=rng)),),
                                        generator=rng).tolist(),
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    core.step()
    assert len(core.scheduler.running) == 5
    made = []
    real = torch.tensor

    def tensor(*a, **k):  # torch.tensor(..., device=...) is a synchronous copy on CUDA
        caller = os.path.dirname(__import__("sys")._getframe(1).f_code.co_filename)
        if "device" in k and caller == ENGINE_DIR:
            made.append(k["device"])
        return real(*a, **k)
    monkeypatch.setattr(torch, "tensor", tensor)
    for _ in range(3):
        core.step()
    assert made == []


def test_to_device_stages_in_pinned_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: calls.append(("to", a, k)) or t)
    slots_mod.to_device([3, 1, 2], torch.device("cuda"))
    assert calls == ["pin", ("to", (torch.device("cuda"),), {"non_blocking": True})]


def test_changed_block_table_cells_go_over_in_one_copy(monkeypatch):
    pool = PagePool(64, 4, "cpu", None)
    main = PagedMainKV(pool, 4, entries=64)
    for row in range(4):
        main.reserve(row, 8 * (row + 1))
    main.dev_ids()
    main.reserve(2, 40)  # row 2 gains pages; the other rows do not change
    copies = []
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: copies.append(tuple(t.shape)) or real(t, *a, **k))
    before = main.dev_ids().clone()
    monkeypatch.setattr(torch.Tensor, "to", real)
    assert len(copies) == 1
    expect = torch.full_like(before, -1)
    for r, t in enumerate(main.tables):
        expect[r, :len(t.pages)] = torch.tensor([p for _, p in t.pages])
    assert torch.equal(before, expect)
    assert copies[0] == (4, 10 - 6)  # rows, cols, device and host page x row 2's 4 new pages only


class FakeEvent:
    made = []

    def __init__(self, enable_timing=False):
        self.synced = False
        FakeEvent.made.append(self)

    def record(self):
        pass

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, other):
        return 2.0


@pytest.mark.parametrize("asked", [False, True])
def test_step_timer_syncs_only_when_asked(monkeypatch, asked):
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = StepTimer(torch.device("cuda"), device_timing=asked) if asked else StepTimer(torch.device("cuda"))
    counters = collections.Counter()
    timer.start()
    timer.mark("decode")
    timer.mark("prefill")
    timer.mark("sample")
    host, device = timer.stop(counters, 4, 16)
    assert counters["decode_rows"] == 4 and counters["decode_steps"] == 1 and counters["step_seconds"] > 0
    assert set(host) == {"decode", "prefill", "sample"}
    assert 0 < sum(host.values()) <= counters["step_seconds"] * 1e3  # from the first mark to the end
    if asked:
        assert any(e.synced for e in FakeEvent.made)
        assert counters["decode_device_seconds"] == pytest.approx(2e-3)
        assert device == {"decode": 2.0, "prefill": 2.0}  # the sampling phase waits for the device: not timed
    else:
        assert FakeEvent.made == [] and counters["decode_device_seconds"] == 0 and device == {}


def test_step_timer_counts_allocator_slow_paths_per_phase(monkeypatch):
    """With device timing, each phase gets the allocator counters' growth between its mark and the
    next; phases where nothing grew are left out, and a phase met twice adds up."""
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    rng = random.Random()
    phases = rng.choices(step_timing.PHASES, k=rng.randint(2, 8))
    growth = [[rng.choice([0, 0, rng.randint(1, 5)]) for _ in range(4)] for _ in range(len(phases) + 1)]
    readings = [tuple(rng.randint(0, 100) for _ in range(4))]
    for g in growth:  # the reading at each later mark: the one before plus that interval's growth
        readings.append(tuple(a + b for a, b in zip(readings[-1], g)))
    it = iter(readings)
    monkeypatch.setattr(step_timing, "alloc_counts", lambda: next(it))
    timer = StepTimer(torch.device("cuda"), device_timing=True)
    timer.start()
    for phase in phases:
        timer.mark(phase)
    timer.stop(collections.Counter(), 1, 0)
    want = {}
    for phase, g in zip(phases, growth[1:]):  # growth[0]: between start and the first mark, no phase
        if any(g):
            want[phase] = [a + b for a, b in zip(want.get(phase, [0] * 4), g)]
    assert timer.allocs == want


def test_step_timer_sums_a_phase_met_twice():
    """A phase marked twice in a step (prefill, prefix snapshots, prefill again) adds up per phase."""
    timer = StepTimer(torch.device("cpu"))
    counters = collections.Counter()
    timer.start()
    for phase in ("prefill", "prefix", "prefill", "prefix", "join"):
        timer.mark(phase)
        time.sleep(0.002)
    host, device = timer.stop(counters, 0, 8)
    assert set(host) == {"prefill", "prefix", "join"} and device == {}
    assert host["prefill"] >= 4 and host["prefix"] >= 4
    assert counters["prefill_seconds"] == pytest.approx(host["prefill"] / 1e3)
    assert counters["decode_steps"] == 0 and counters["prefill_step_tokens"] == 8
