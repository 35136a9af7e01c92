"""Fixtures shared by the engine tests."""
import pytest
import torch

from flashrt.engine.run import load_model


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The built-in ``tiny-vl`` model on the CPU, its weights made in a cache of this module's own."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FLASHRT_CACHE_DIR", str(tmp_path_factory.mktemp("vl-cache")))
    yield load_model("tiny-vl", torch.device("cpu"), quiet=True)
    mp.undo()
