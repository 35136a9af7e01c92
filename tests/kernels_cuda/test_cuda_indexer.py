"""CUDA kernels of indexer.py (``index_scores``, ``candidate_blocks``) against the reference.

``index_scores``: relative error (fp32 math; bf16 tensor-core dots on the GPU), ``-inf`` exactly
where ``t >= visible``; plain and ``fp4_b32`` keys (read as stored). ``candidate_blocks``: exact.
Tiny shapes in the interpreter; the released indexer (32 heads x 128, fp4 keys, T = 64K / 128K,
block pool 2048 x 8) on a CUDA device only (``pytest -m gpu``).
"""
import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_check import CountingKernel, DEVICE, GPU, requires_kernels, rel_err, run_both  # noqa: E402
from test_topk import tied_scores  # noqa: E402

import flashrt  # noqa: E402
from flashrt import ops  # noqa: E402
from flashrt.errors import BackendError  # noqa: E402
from flashrt.kernels_cuda import indexer  # noqa: E402

pytestmark = requires_kernels


def _tol(q_dtype) -> float:
    return 5e-3 if GPU and q_dtype != torch.float32 else 1e-4


def _visible(B, S, T, g):
    vis = torch.randint(0, T + 1, (B, S), generator=g)
    if vis.numel() >= 3:
        vis.view(-1)[0], vis.view(-1)[-1] = 0, T
    return vis.to(torch.int32)


def _inputs(B, S, H, D, T, q_dtype, g, k_fmt=None, k_dtype=None):
    q = torch.randn(B, S, H, D, generator=g).to(q_dtype)
    k = torch.randn(B, T, D, generator=g).to(k_dtype or q_dtype)
    if k_fmt is not None:
        k = ops.quantize(torch.randn(B, T, D, generator=g), k_fmt)
    w = torch.randn(B, S, H, generator=g)
    return q, k, w, _visible(B, S, T, g)


def _check_scores(q, k, w, vis):
    got, want = run_both("index_scores", *[t.to(DEVICE) for t in (q, k, w, vis)])
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel_err(got.cpu(), want.cpu()) < _tol(q.dtype)


SHAPES = [(1, 1, 1, 16, 1), (1, 3, 2, 32, 37), (2, 5, 5, 64, 37), (3, 2, 3, 96, 19), (2, 4, 4, 16, 5),
          (1, 2, 32, 128, 150)]


@pytest.mark.parametrize("B,S,H,D,T", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_scores_plain(B, S, H, D, T, dtype, rng):
    _check_scores(*_inputs(B, S, H, D, T, dtype, rng))


@pytest.mark.parametrize("B,S,H,D,T", [(2, 3, 4, 32, 37), (1, 2, 3, 96, 70), (2, 1, 32, 128, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_scores_fp4_keys(B, S, H, D, T, dtype, rng):
    _check_scores(*_inputs(B, S, H, D, T, dtype, rng, k_fmt="fp4_b32"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_index_scores_weight_dtype_and_scale(dtype, rng):
    """bf16 head weights (the linear's output) and a weight scale, read and scaled in the kernel:
    the same scores as fp32 weights scaled beforehand (one fp32 product either way)."""
    q, k, w, vis = _inputs(2, 3, 32, 128, 70, torch.bfloat16, rng, k_fmt="fp4_b32")
    w = w.to(dtype)
    scale = 128 ** -0.5 * 32 ** -0.5
    args = [t.to(DEVICE) for t in (q, k, w, vis)]
    got, want = run_both("index_scores", *args, scale)
    assert rel_err(got.cpu(), want.cpu()) < _tol(q.dtype)
    with flashrt.use_backend("cuda"):
        pre = ops.index_scores(args[0], args[1], args[2].to(torch.float32) * scale, args[3])
    assert torch.equal(got, pre)


@pytest.mark.parametrize("fmt", ["fp4_b16", "fp8", "int8"])
@pytest.mark.parametrize("D", [32, 96])
def test_index_scores_other_key_formats(fmt, D, rng):
    if fmt not in flashrt.formats.FORMATS:
        pytest.skip(f"{fmt} is not a format of this flashrt")
    _check_scores(*_inputs(2, 3, 4, D, 37, torch.bfloat16, rng, k_fmt=fmt))


def test_index_scores_fp4_codes_and_scales(rng):
    """Every E2M1 code (both nibbles, signs, 0.5 subnormal in fp16) and a spread of UE8M0 scales."""
    B, T, D = 1, 16, 64
    q = torch.randn(B, 2, 3, D, generator=rng)
    data = torch.arange(256, dtype=torch.uint8).view(1, 8, 32).repeat(1, 2, 1)  # [1, 16, 32] bytes
    scale = torch.randint(100, 150, (B, T, D // 32), generator=rng, dtype=torch.uint8)
    k = flashrt.formats.QTensor(data, scale.view(torch.float8_e8m0fnu), "fp4_b32", (B, T, D))
    _check_scores(q, k, torch.rand(B, 2, 3, generator=rng), torch.tensor([[T, 9]], dtype=torch.int32))


def test_index_scores_mixed_dtypes_and_strides(rng):
    q, k, w, vis = _inputs(2, 3, 4, 32, 21, torch.bfloat16, rng, k_dtype=torch.float32)
    _check_scores(q, k, w, vis)  # bf16 q, fp32 k
    _check_scores(q.half(), k.half(), w, vis)  # fp16
    qt = torch.randn(2, 4, 3, 32, generator=rng).transpose(1, 2)  # non-contiguous q and weights
    wt = torch.randn(2, 4, 3, generator=rng).transpose(1, 2)
    _check_scores(qt, torch.randn(2, 40, 32, generator=rng)[:, :21], wt, vis)  # batch stride of 40 rows
    _check_scores(qt, torch.randn(2, 21, 64, generator=rng)[..., ::2], wt, vis)  # element stride 2
    big = ops.quantize(torch.randn(2, 40, 32, generator=rng), "fp4_b32")
    _check_scores(qt, big.narrow(1, 0, 21), wt, vis)  # a cache view: batch stride of 40 entries


@pytest.mark.parametrize("fill", ["zero", "full"])
def test_index_scores_visible_extremes(fill, rng):
    q, k, w, _ = _inputs(2, 3, 2, 32, 37, torch.float32, rng, k_fmt="fp4_b32")
    _check_scores(q, k, w, torch.full((2, 3), 0 if fill == "zero" else 37, dtype=torch.int32))


def test_index_scores_empty():
    q = torch.randn(2, 3, 4, 32, device=DEVICE)
    with flashrt.use_backend("cuda"):
        out = ops.index_scores(q, torch.randn(2, 0, 32, device=DEVICE), torch.rand(2, 3, 4, device=DEVICE),
                               torch.zeros(2, 3, dtype=torch.int32, device=DEVICE))
        assert out.shape == (2, 3, 0) and out.dtype == torch.float32
        out = ops.index_scores(q[:, :0], torch.randn(2, 5, 32, device=DEVICE), torch.rand(2, 0, 4, device=DEVICE),
                               torch.zeros(2, 0, dtype=torch.int32, device=DEVICE))
        assert out.shape == (2, 0, 5)


def test_index_scores_declines_and_dispatch(monkeypatch, rng):
    q, k, w, vis = _inputs(1, 2, 2, 32, 9, torch.float32, rng)
    sup = lambda *args: indexer.FAMILY.serves("index_scores", *args) is None
    assert sup(q, k, w, vis) and sup(q, ops.quantize(k, "fp4_b32"), w, vis)
    assert sup(q, ops.quantize(k, "fp8"), w, vis) and sup(q, ops.quantize(k, "fp4_b16"), w, vis)
    assert not sup(q.double(), k.double(), w, vis)
    with flashrt.use_backend("cuda"), pytest.raises(BackendError):  # declined: no fallback when explicit
        ops.index_scores(q.double().to(DEVICE), k.double().to(DEVICE), w.to(DEVICE), vis.to(DEVICE))
    assert not sup(torch.empty(1, 2, 2, 1024), torch.empty(1, 9, 1024), w, vis)
    assert not sup(torch.empty(1, 2, 256, 32), k, torch.empty(1, 2, 256), vis)
    calls = []
    monkeypatch.setattr(indexer, "_index_scores_kernel", CountingKernel(indexer._index_scores_kernel, calls))
    _check_scores(q, k, w, vis)
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------
# candidate_blocks


def _same_blocks(scores, visible, topk_blocks, block_size):
    got, want = run_both("candidate_blocks", scores.to(DEVICE), visible.to(DEVICE), topk_blocks, block_size)
    assert got.dtype == torch.bool and torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("B,S,T,bs,nblk", [(1, 1, 7, 2, 2), (2, 3, 37, 4, 3), (2, 2, 64, 8, 2), (3, 2, 37, 3, 20),
                                           (1, 2, 300, 5, 7), (1, 1, 5, 1, 2), (1, 2, 40, 50, 1)])
@pytest.mark.parametrize("kind", ["tied", "smooth", "sparse"])
def test_candidate_blocks_matches_reference(B, S, T, bs, nblk, kind, rng):
    if kind == "smooth":
        scores = torch.randn(B, S, T, generator=rng)
    else:
        scores = tied_scores(B, S, T, rng, p_special=0.85 if kind == "sparse" else 0.2, levels=2)
    _same_blocks(scores, _visible(B, S, T, rng), nblk, bs)


def test_candidate_blocks_pinned_ties_and_non_finite():
    nan, inf = math.nan, math.inf
    row = torch.tensor([[[3.0, nan, 1.0, inf, 3.0, -inf, nan, nan, nan, -inf, 3.0, 0.0, 2.0]]])
    for vis in (0, 1, 8, 12, 13):
        for nblk in (1, 2, 3, 10):
            _same_blocks(row, torch.tensor([[vis]], dtype=torch.int32), nblk, 3)
    dead = torch.full((1, 1, 5), nan)
    _same_blocks(dead, torch.tensor([[5]], dtype=torch.int32), 3, 2)
    _same_blocks(dead, torch.tensor([[0]], dtype=torch.int32), 3, 2)


def test_candidate_blocks_empty_and_dispatch(monkeypatch, rng):
    with flashrt.use_backend("cuda"):
        out = ops.candidate_blocks(torch.zeros(2, 3, 0, device=DEVICE), torch.zeros(2, 3, dtype=torch.int32,
                                   device=DEVICE), 2, 4)
    assert out.shape == (2, 3, 0) and out.dtype == torch.bool
    assert indexer.FAMILY.serves("candidate_blocks", torch.empty(1, 1, 2**30, device="meta"), None, 2, 4) is not None
    calls = []
    real = indexer.select_rows
    monkeypatch.setattr(indexer, "select_rows", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    _same_blocks(torch.randn(1, 2, 30, generator=rng), torch.tensor([[30, 7]], dtype=torch.int32), 3, 4)
    assert calls == [3]


# ---------------------------------------------------------------------------------------------
# the released indexer (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("B,S,T", [(1, 1, 131072), (8, 1, 65536), (64, 1, 2048), (1, 64, 65536)])
def test_index_scores_released_shapes(B, S, T, rng):
    """32 heads x 128, fake-quantized bf16 q as the model passes it, fp4_b32 keys."""
    q = torch.randn(B, S, 32, 128, generator=rng).to(torch.bfloat16)
    q = ops.dequantize(ops.quantize(q, "fp4_b32"), torch.bfloat16)
    k = ops.quantize(torch.randn(B, T, 128, generator=rng), "fp4_b32")
    w = torch.randn(B, S, 32, generator=rng) * 128**-0.5 * 32**-0.5
    vis = torch.randint(T // 2, T + 1, (B, S), generator=rng, dtype=torch.int32)
    _check_scores(q, k, w, vis)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("rows,T", [(1, 131072), (64, 131072), (512, 16384)])
def test_candidate_blocks_released_shapes(rows, T, rng):
    scores = torch.randn(rows, 1, T, generator=rng)
    vis = torch.randint(1, T + 1, (rows, 1), generator=rng, dtype=torch.int32)
    scores = scores.masked_fill(torch.arange(T) >= vis[..., None], -math.inf)
    _same_blocks(scores, vis, 2048, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("asm", [True, False])
@pytest.mark.parametrize("lo,hi", [(100, 150), (20, 70), (150, 200)])  # in range / below / above [66, 192]
def test_index_scores_fp4_decode_paths(asm, lo, hi, monkeypatch, rng):
    """The inline-asm decode and the exact fallback both match, for every code and scale range."""
    monkeypatch.setitem(indexer.TILES, "index_scores", {**indexer.TILES["index_scores"], "asm_decode": asm})
    B, S, T, D = 2, 3, 1000, 128
    data = torch.randint(0, 256, (B, T, D // 2), dtype=torch.uint8, generator=rng)
    scale = torch.randint(lo, hi, (B, T, D // 32), dtype=torch.uint8, generator=rng)
    k = flashrt.formats.QTensor(data, scale.view(torch.float8_e8m0fnu), "fp4_b32", (B, T, D))
    q = torch.randn(B, S, 32, D, generator=rng).to(torch.bfloat16)
    _check_scores(q, k, torch.rand(B, S, 32, generator=rng), _visible(B, S, T, rng))
