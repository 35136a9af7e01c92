"""How the serving engine is built and stopped (engine/core_process.py ``build``, engine/client.py):
the model loads under the profile its compile pool was started with, and an engine process left
running at the server's exit is stopped (the process is not daemonic: it forks compile workers)."""
import contextlib
import multiprocessing
import time
from types import SimpleNamespace

import torch

from flashrt.engine import EngineConfig, precompile
from flashrt.engine import run as run_mod
from flashrt.engine.client import _stop_at_exit
from flashrt.engine.core_process import CoreSpec, build
from flashrt.graphs.loader import resolve_profile


def test_build_loads_and_warms_up_inside_the_compiles_block(monkeypatch):
    """The load gets the profile the pool plans under; the block sees the loaded config (the plan is
    kept under it) and ends only after the engine exists."""
    seen, real_load = [], run_mod.load_model

    @contextlib.contextmanager
    def fake_beside(model, dev):
        state = SimpleNamespace(profile=resolve_profile(None, dev), cfg=None, report=None)
        seen.append(("begin", model, dev.type, state.profile.name))
        yield state
        seen.append(("end", state.cfg.name if state.cfg is not None else None))

    def load(model, dev, seed=0, quiet=False, profile=None):
        seen.append(("load", model, seed, profile.name if profile is not None else None))
        return real_load(model, dev, seed, quiet=quiet, profile=profile)

    monkeypatch.setattr(precompile, "compiles_beside", fake_beside)
    monkeypatch.setattr(run_mod, "load_model", load)
    seed = int(torch.randint(0, 1000, (1,)))
    engine = build(CoreSpec("tiny", "cpu", seed, EngineConfig(max_running=2), threads=1))
    profile = resolve_profile(None, torch.device("cpu")).name
    assert seen == [("begin", "tiny", "cpu", profile), ("load", "tiny", seed, profile), ("end", engine.model.cfg.name)]


def _wait_for_eof(conn):
    try:
        conn.recv()
    except EOFError:
        pass


def _ignore_eof(conn):
    time.sleep(120)


def test_an_engine_process_left_running_is_stopped_at_exit():
    ctx = multiprocessing.get_context("spawn")
    for target, code in ((_wait_for_eof, 0), (_ignore_eof, -9)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child,), daemon=False)
        proc.start()
        child.close()
        t0 = time.monotonic()
        _stop_at_exit(proc, parent)
        assert not proc.is_alive() and proc.exitcode == code and time.monotonic() - t0 < 60
