"""Shared helpers for the CUDA-kernel tests (``tests/kernels_cuda/test_cuda_*.py``).

On a CUDA machine the kernels run on the GPU; elsewhere they run in the Triton interpreter on CPU
tensors (``TRITON_INTERPRET=1``, set by conftest) with small shapes. Every check runs the same
``flashrt.ops`` call on the ``cuda`` backend and on the ``reference`` backend and compares.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch

import flashrt
from flashrt import dispatch

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")


def kernels_available() -> bool:
    return "cuda" in dispatch.backends() and dispatch.availability("cuda")[0]


requires_kernels = pytest.mark.skipif(not kernels_available(), reason="cuda backend unavailable (no triton)")


def run_on_and_reference(backend: str, op: str, *args, **kwargs):
    """(``backend`` result, reference result) of ``flashrt.ops.<op>`` on the same inputs."""
    fn = getattr(flashrt.ops, op)
    with flashrt.use_backend(backend):
        got = fn(*args, **kwargs)
    with flashrt.use_backend("reference"):
        want = fn(*args, **kwargs)
    return got, want


run_both = functools.partial(run_on_and_reference, "cuda")  # (cuda result, reference result)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (non-finite entries must agree exactly)."""
    g, w = got.double(), want.double()
    finite = torch.isfinite(w)
    assert torch.equal(torch.isfinite(g), finite), "non-finite entries differ"
    assert torch.equal(g[~finite], w[~finite]), "non-finite values differ"
    num = (g[finite] - w[finite]).norm()
    den = w[finite].norm()
    return float(num / den) if den > 0 else float(num)


def assert_error(fn, name: str, *fragments: str):
    """``fn()`` raises a ValueError whose message starts with the argument ``name`` and says
    what was expected and what was given; every fragment appears in it."""
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}(?!\w)[\s\S]*expected[\s\S]*got") as info:
        fn()
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


class CountingKernel:
    """Stands in for a Triton kernel object (``kernel[grid](...)``) and records each launch's grid."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch):
    """Names of the Triton kernels launched (under the interpreter), in order (a fixture: import it)."""
    from triton.runtime.interpreter import InterpretedFunction

    names = []
    real = InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run",
                        lambda self, *a, **k: (names.append(self.fn.__name__), real(self, *a, **k))[1])
    return names
