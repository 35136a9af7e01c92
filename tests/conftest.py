import os
import sys
from pathlib import Path

import pytest
import torch

# Tests live in one folder per area (ops, kernels_cuda, kv, graphs, engine, ...); the shared test
# helpers sit beside this file, and a test module may reuse another area's reference helpers
# (e.g. the CUDA top-k tests use the op tests' tie generator): every area folder is importable.
_HERE = Path(__file__).resolve().parent
for _area in sorted(p for p in _HERE.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_area) not in sys.path:
        sys.path.append(str(_area))

if not torch.cuda.is_available():  # Triton kernels run in the interpreter (before flashrt loads them)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashrt import dispatch  # noqa: E402

# The CI machine has 2 cores and the test shapes are small: thread fan-out only costs time there;
# the suite runs its tests in parallel processes instead (``-n auto``, pytest-xdist).
torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker a core, at most 4 (the multi-rank tests start 2-4 processes of their
    own, and each worker holds its own torch and Triton)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _clean_dispatch(monkeypatch):
    """Each test starts and ends with the plugins of a plain install and no explicit backend.

    The CUDA backend's own test run sets FLASHRT_BACKEND on purpose; keep it then.
    """
    keep = os.environ.get("FLASHRT_TEST_KEEP_BACKEND")
    if not keep:
        monkeypatch.delenv("FLASHRT_BACKEND", raising=False)
    dispatch.reset_table()
    yield
    dispatch.reload()


@pytest.fixture
def rng():
    """A fresh, logged generator: each run draws new inputs, a failure prints its seed."""
    seed = int(os.environ.get("FLASHRT_TEST_SEED", 0)) or int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _module_tiles():
    """Kernels run with their modules' TILES (tests patch them to force code paths); the shipped
    profiles' tile sections are checked by tests/core/test_profiles.py."""
    import dataclasses

    from flashrt import profiles

    base = profiles.active_profile()
    profiles._TILES_CACHE.clear()
    with profiles.using(dataclasses.replace(base, tiles={})):
        yield
    profiles._TILES_CACHE.clear()


@pytest.fixture(scope="session")
def cfg():
    """The shipped ``tiny`` config (every V4.1 layer role)."""
    from flashrt.graphs.config import shipped_config

    return shipped_config("tiny")


@pytest.fixture(scope="session")
def weights(cfg):
    """Deterministic tiny weights (seed 0); treat as read-only."""
    from flashrt.graphs.init_weights import init_weights

    return init_weights(cfg, seed=0)


@pytest.fixture(scope="session")
def model(cfg, weights):
    """A tiny Model on the CPU (its internal state is per forward; pass state= to keep one)."""
    from flashrt.graphs.model import Model

    return Model(cfg, weights)
