"""Shared helpers for the CUDA-kernel tests (``tests/kernels_cuda/test_cuda_*.py``).

On a CUDA machine the kernels run on the GPU; elsewhere they run in the Triton interpreter on CPU
tensors (``TRITON_INTERPRET=1``, set by conftest) with small shapes. Every check runs the same
``flashrt.ops`` call on the ``cuda`` backend and on the ``reference`` backend and compares.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import pytest
import torch

import flashrt
from flashrt import dispatch, profiles

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")


def kernels_available() -> bool:
    return "cuda" in dispatch.backends() and dispatch.availability("cuda")[0]


requires_kernels = pytest.mark.skipif(not kernels_available(), reason="cuda backend unavailable (no triton)")


def _ptxas_missing() -> bool:
    try:
        import triton
    except ImportError:
        return True
    from pathlib import Path

    return not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


needs_ptxas = pytest.mark.skipif(_ptxas_missing(), reason="Triton without its bundled ptxas (no NVIDIA backend)")


def sm90_compile(family: str, *args: str) -> list[dict]:
    """The reports of ``tools/sm90_compile.py FAMILY ARGS --json`` under the h200 profile: every kernel
    the launcher makes for that call, compiled for sm_90 in a subprocess without the interpreter. The
    dumps (the reports' ``dump`` paths, which the tool reads the loops back from) go to a folder of this
    test process's own: tests in parallel processes compile kernels of the same names."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    dumps = os.path.join(tempfile.gettempdir(), f"sm90-dumps-{os.getpid()}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"FLASHRT_PROFILE": "h200",
                                                                             "SM90_DUMP_DIR": dumps}
    run = subprocess.run([sys.executable, str(root / "tools" / "sm90_compile.py"), family, *args, "--json"],
                         capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


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


def record_launches(monkeypatch) -> list:
    """A list that collects the name of each Triton kernel launched from now on, in order:
    interpreted launches and compiled ones (``kernel[grid](...)`` on a GPU); a ``kernel.warmup``
    compile is no launch."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    names = []
    for cls in (InterpretedFunction, JITFunction):
        def run(self, *a, _real=cls.run, **k):
            if not k.get("warmup"):
                names.append(self.fn.__name__)
            return _real(self, *a, **k)

        monkeypatch.setattr(cls, "run", run)
    return names


@pytest.fixture
def launches(monkeypatch):
    """Names of the Triton kernels launched in the test, in order (:func:`record_launches`; a
    fixture: import it)."""
    return record_launches(monkeypatch)


@contextlib.contextmanager
def pinned_tiles(**sections):
    """The active profile with exactly these ``tiles`` sections (kernel family -> what differs from
    its ``TILES``) inside the block: the kernels read their modules' defaults and these overrides,
    whatever profile the device selected (h200.yaml's tiles change paths and launch counts). A new
    profile object: the merged tiles and the launch plans are made afresh for it."""
    with profiles.using(dataclasses.replace(profiles.active_profile(), tiles=sections)):
        yield


def assert_counters_zero(t: torch.Tensor):
    """The split-K ticket counters of the device ``t`` lives on (kernels_cuda/splitk.py) are all
    back at zero. The device is taken from a tensor: ``torch.device("cuda")`` has no index, the
    pool's key does."""
    from flashrt.kernels_cuda import splitk

    pool = splitk.counters(t.device)
    assert int(pool.count_nonzero()) == 0, f"split-K ticket counters not reset on {t.device}"


def moe_case(rng, n, D, I, E, k, stack, xdt=torch.bfloat16) -> tuple:
    """``moe_experts``' arguments on the test device: x [n, D] in ``xdt``, routing weights and indices (a
    token's slots may repeat), the expert stacks ``stack(E, rows, K)`` makes (w1, w3 [E, I, D], w2 [E, D, I])
    and a SwiGLU limit of 10."""
    x = (torch.randn(n, D, generator=rng) * 3.0).to(DEVICE, xdt)
    idx = torch.randint(0, E, (n, k), generator=rng, dtype=torch.int32).to(DEVICE)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    w = [stack(E, *s).to(DEVICE) for s in ((I, D), (I, D), (D, I))]
    return (x, rw, idx, *w, 10.0)


def qgmma_knobs(on: bool, tokens: int, warps: int, stages: int, inflight: int = 2, maxnreg: int | None = None,
                **more) -> dict:
    """A rule's knobs of the streamed ``qgmma`` launches (the experts' and linear's of that name; ``more``:
    other knobs of the rule, e.g. the experts' ``qgmma_bf16``)."""
    return dict(qgmma=on, qgmma_tokens=tokens, qgmma_warps=warps, qgmma_stages=stages, qgmma_inflight=inflight,
                qgmma_maxnreg=maxnreg, **more)


def run_moe(args, moe_tiles: dict, **kw) -> torch.Tensor:
    """``moe_experts(*args, **kw)`` on the CUDA backend with exactly ``moe_tiles`` as the moe section."""
    with pinned_tiles(moe=moe_tiles), flashrt.use_backend("cuda"):
        from flashrt import ops

        return ops.moe_experts(*args, **kw)


def assert_moe_path_matches(args, moe_tiles: dict, other_tiles: dict):
    """``moe_experts`` under ``moe_tiles`` (fp32 out) against the reference and against ``other_tiles``'
    path: within 5e-3 relative of both, the split-K counters back at zero."""
    from flashrt import ops

    got = run_moe(args, moe_tiles, out_dtype=torch.float32)
    assert_counters_zero(got)
    other = run_moe(args, other_tiles, out_dtype=torch.float32)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, out_dtype=torch.float32)
    assert got.shape == want.shape and rel_err(got, want) < 5e-3 and rel_err(got, other) < 5e-3


def random_experts(rng, n, k, E, top, I, shared_fmt):
    """Routing of ``n`` tokens to ``top`` of ``E`` experts (weights, indices), the routed fp4_w expert
    stacks (W1 / W3 ``[E, I, k]``, W2 ``[E, k, I]``) and a ``shared_fmt`` shared expert of the same
    shapes, from ``rng``, on the test device."""
    from flashrt import formats

    idx = torch.stack([torch.randperm(E, generator=rng)[:top] for _ in range(n)]).to(DEVICE, torch.int32)
    rw = torch.rand(n, top, generator=rng).to(DEVICE)
    q = lambda fmt, *s: formats.quantize(torch.randn(*s, generator=rng) * 0.25, fmt).to(DEVICE)
    experts = [q("fp4_w", *s) for s in ((E, I, k), (E, I, k), (E, k, I))]
    shared = tuple(q(shared_fmt, 1, *s) for s in ((I, k), (I, k), (k, I)))
    return rw, idx, experts, shared


def gemm_outputs(backend: str, x, weights, routed, **tiles) -> tuple:
    """``ops.linear(x, w)`` for each of ``weights``, then ``ops.moe_experts`` over ``routed`` (the
    ``rw, idx, experts, shared`` of :func:`random_experts`, SwiGLU limit 10), on ``backend``; with
    ``tiles`` given, under exactly those tile sections (:func:`pinned_tiles`)."""
    from flashrt import ops

    rw, idx, experts, shared = routed
    with flashrt.use_backend(backend), (pinned_tiles(**tiles) if tiles else contextlib.nullcontext()):
        return (*(ops.linear(x, w) for w in weights), ops.moe_experts(x, rw, idx, *experts, 10.0, shared=shared))


def linear_three_ways(x, w, tiles: dict, other_tiles: dict) -> tuple:
    """``ops.linear(x, w)`` on the cuda backend under the ``linear`` tiles ``tiles`` (the split-K
    counters checked back at zero after it), under ``other_tiles``, and on the reference:
    (got, other, want)."""
    from flashrt import ops

    with flashrt.use_backend("cuda"):
        with pinned_tiles(linear=tiles):
            got = ops.linear(x, w)
            assert_counters_zero(got)
        with pinned_tiles(linear=other_tiles):
            other = ops.linear(x, w)
    with flashrt.use_backend("reference"):
        return got, other, ops.linear(x, w)


def assert_same_sums(got, plain, want):
    """Outputs of a loop that reorders the sums inside its MMAs (``got``) against the plain loop's
    (fp32 rounding only: a wrong order moves them by ~1) and the reference's (its tolerance)."""
    for g, p, r in zip(got, plain, want, strict=True):
        assert g.shape == r.shape
        assert rel_err(g, p) < 1e-5
        assert rel_err(g, r) < 1e-2


def moe_reference_by_expert(x, weights, indices, w1, w3, w2, limit):
    """The reference backend expert by expert (it dequantizes only one expert's weights at a time)."""
    from flashrt.backends import reference

    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(indices).tolist():
        tok, slot = torch.nonzero(indices == e, as_tuple=True)
        sub = [w.narrow(0, e, 1) for w in (w1, w3, w2)]
        zero = torch.zeros(tok.numel(), 1, dtype=torch.int32, device=x.device)
        out.index_add_(0, tok, reference.moe_experts(x[tok], weights[tok, slot][:, None], zero, *sub, limit))
    return out


MODEL_OPS = ("linear", "grouped_linear", "moe_route", "moe_experts", "sparse_attention", "prefix_attention",
             "index_scores", "topk_positions", "rms_norm", "rope", "norm_rope_quantize", "hc_coefficients",
             "hc_expand", "hc_collapse_norm", "engram_gate", "engram_lookup", "compress_pool", "compress_decode",
             "store_rows")


@contextlib.contextmanager
def recorded_calls(names=MODEL_OPS):
    """Inside the block every call of the ``flashrt.ops`` functions ``names`` is kept: the yielded list
    gets (op, args, kwargs, output) per call."""
    from flashrt import ops

    calls, originals = [], {n: getattr(ops, n) for n in names}

    def wrap(n):
        def call(*a, **kw):
            out = originals[n](*a, **kw)
            calls.append((n, a, kw, out))
            return out
        return call

    for n in names:
        setattr(ops, n, wrap(n))
    try:
        yield calls
    finally:
        for n in names:
            setattr(ops, n, originals[n])


def assert_calls_match_reference(calls: list) -> set:
    """Each recorded call's output against the reference backend's on the same inputs: quantized
    outputs by their values, a routing's picks where they agree (a near-tie may swap one) and its
    weights there, top-k picks exactly, the rest within 2e-2 relative; returns the ops checked."""
    from flashrt import formats

    for n, a, kw, got in calls:
        with flashrt.use_backend("reference"):
            want = getattr(flashrt.ops, n)(*a, **kw)
        if isinstance(got, formats.QTensor):
            got, want = formats.dequantize(got), formats.dequantize(want)
        if n == "moe_route":
            same = (got[1] == want[1]).all(dim=1)
            assert same.float().mean() > 0.9 and rel_err(got[0][same], want[0][same]) < 1e-5, n
            continue
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            if g.is_floating_point():
                assert rel_err(g, w) < 2e-2, n
            else:
                assert torch.equal(g, w), n
    return {c[0] for c in calls}
