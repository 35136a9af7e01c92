"""Fixtures of the parallel tests: a fresh compile/weights cache per test."""
import pytest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """``FLASHRT_CACHE_DIR`` in this test's temporary folder (built-in weights are made there)."""
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
