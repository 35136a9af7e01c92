"""CUDA kernels of attention.py (``sparse_attention``) against the reference backend.

Tiny shapes in the interpreter: every kv kind (plain bf16 / fp32, fp8, fp4_b16, fp4_b32 and
tuples of segments, the model's (fp8 ring, fp8 chunk, fp4_b16 main) included), bf16 / fp32 q,
-1 slots, all -1 rows, duplicate indices, sink None / tensor, strided views, the split-K path
forced through ``TILES``. Realistic shapes (64 heads x 512, K = 128 + 512) on a CUDA device only.
"""
import pytest
import torch

pytest.importorskip("triton")

from kernel_check import CountingKernel, DEVICE, GPU, requires_kernels, rel_err, run_both  # noqa: E402

import flashrt  # noqa: E402
from flashrt import dispatch, formats, ops  # noqa: E402
from flashrt.errors import BackendError  # noqa: E402
from flashrt.kernels_cuda import attention  # noqa: E402

pytestmark = requires_kernels


def _segment(kind, B, T, D, g, scale=1.0):
    x = torch.randn(B, T, D, generator=g) * scale
    if kind in ("bf16", "fp32", "fp16"):
        return x.to(getattr(torch, {"fp32": "float32", "fp16": "float16"}.get(kind, "bfloat16"))).to(DEVICE)
    return formats.quantize(x, kind).to(DEVICE)


def _kv(kinds, B, T, D, g):
    """One segment per kind, lengths summing to T (the first ones short, like the ring / chunk)."""
    kinds = kinds.split("+")
    lens = [max(1, T // (2 ** (len(kinds) - i))) for i in range(len(kinds) - 1)]
    lens.append(T - sum(lens))
    segs = tuple(_segment(k, B, n, D, g) for k, n in zip(kinds, lens))
    return segs if len(segs) > 1 else segs[0]


def _indices(B, S, K, T, g, p_empty=0.25, empty_row=True):
    idx = torch.randint(0, max(T, 1), (B, S, K), generator=g)
    idx[torch.rand(B, S, K, generator=g) < p_empty] = -1
    if empty_row:
        idx[0, -1] = -1  # a row with no valid slot
    return idx.to(torch.int32).to(DEVICE)


def _check(q, kv, idx, sink, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    got, want = run_both("sparse_attention", q, kv, idx, sink, scale)
    assert got.dtype == q.dtype and got.shape == q.shape and got.device == q.device
    tol = 1e-4 if q.dtype == torch.float32 else 2e-2
    assert rel_err(got.float().cpu(), want.float().cpu()) < tol
    return got, want


KINDS = ["fp32", "bf16", "fp8", "fp4_b16", "fp4_b32", "fp8+fp8+fp4_b16", "bf16+fp4_b32", "fp4_b16+fp8+fp4_b16"]


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_sink", [False, True])
def test_attention_matches_reference(kinds, q_dtype, with_sink, rng):
    B, S, H, D, T, K = (2, 3, 2, 32, 50, 40) if with_sink else (1, 2, 16, 64, 37, 23)
    q = torch.randn(B, S, H, D, generator=rng).to(q_dtype).to(DEVICE)
    sink = torch.randn(H, generator=rng).to(DEVICE) if with_sink else None
    _check(q, _kv(kinds, B, T, D, rng), _indices(B, S, K, T, rng), sink)


@pytest.mark.parametrize("split", [0, 16, 23])
@pytest.mark.parametrize("split_k", [False, True])
def test_attention_indices_in_two_parts(split, split_k, monkeypatch, rng):
    """The window's indices and the picks as two tensors, read as their concatenation in one launch
    (no copy): the reference's result, and the same bits as the concatenated indices, split over K
    or not."""
    if split_k:
        monkeypatch.setitem(attention.TILES, "split", {"programs": 64, "min_blocks": 1, "max_splits": 16})
        monkeypatch.setitem(attention.TILES, "attention", dict(attention.TILES["attention"], K_BLOCK=16))
    B, S, H, D, T, K = 2, 1 if split_k else 3, 16, 64, 70, 40  # a decode step; a verify chunk of 3 queries
    q = torch.randn(B, S, H, D, generator=rng).to(torch.bfloat16).to(DEVICE)
    kv, sink = _kv("fp8+fp8+fp4_b16", B, T, D, rng), torch.randn(H, generator=rng).to(DEVICE)
    idx = _indices(B, S, K, T, rng)
    parts = (idx[..., :split].contiguous(), idx[..., split:].contiguous())
    got, _ = _check(q, kv, parts, sink)
    with flashrt.use_backend("cuda"):
        assert torch.equal(got, ops.sparse_attention(q, kv, idx, sink, D ** -0.5))


@pytest.mark.parametrize("H,D", [(3, 96), (80, 32)])  # D not a power of two; several head blocks
def test_attention_odd_shapes(H, D, rng):
    q = torch.randn(2, 2, H, D, generator=rng).to(torch.bfloat16).to(DEVICE)
    _check(q, _kv("fp8+fp4_b16+fp4_b32", 2, 30, D, rng), _indices(2, 2, 19, 30, rng),
           torch.randn(H, generator=rng).to(DEVICE))


def test_attention_fp16_q_and_fp16_kv(rng):
    q = torch.randn(2, 2, 16, 32, generator=rng).half().to(DEVICE)
    got, want = run_both("sparse_attention", q, _kv("fp16+fp8", 2, 30, 32, rng), _indices(2, 2, 20, 30, rng),
                         torch.randn(16, generator=rng).to(DEVICE), 0.3)
    assert got.dtype == torch.float16 and rel_err(got.float().cpu(), want.float().cpu()) < 2e-3


def test_attention_edge_rows(rng):
    """Duplicates, all-empty rows with and without a sink (zeros), a dominant sink, big logits."""
    B, S, H, D, T = 2, 3, 16, 32, 6
    q = torch.randn(B, S, H, D, generator=rng).to(DEVICE) * 4
    kv = _kv("fp8+fp4_b16", B, T, D, rng)
    idx = torch.tensor([[[0, 0, 0, 5], [-1, -1, -1, -1], [5, -1, 2, 2]],
                        [[-1, -1, -1, -1], [1, 1, -1, 1], [3, 4, 5, 0]]], dtype=torch.int32, device=DEVICE)
    sink = torch.randn(H, generator=rng).to(DEVICE)
    sink[0], sink[1] = 300.0, -300.0
    for s in (None, sink):
        got, _ = _check(q, kv, idx, s, scale=1.0)
        assert torch.count_nonzero(got[0, 1]) == 0 and torch.count_nonzero(got[1, 0]) == 0
    assert got[..., 0, :].abs().max() < 1e-30  # the huge sink takes all the mass


def test_attention_empty_inputs(rng):
    q = torch.randn(1, 2, 16, 32, generator=rng).to(DEVICE)
    kv = _kv("fp8", 1, 8, 32, rng)
    got, _ = _check(q, kv, torch.empty(1, 2, 0, dtype=torch.int32, device=DEVICE), None)
    assert torch.count_nonzero(got) == 0
    empty = formats.quantize(torch.zeros(1, 0, 32), "fp4_b16").to(DEVICE)  # an empty segment in the tuple
    _check(q, (empty, kv, empty), _indices(1, 2, 5, 8, rng), torch.randn(16, generator=rng).to(DEVICE))


def test_attention_strided_views(rng):
    """A narrowed cache (batch stride > T * row), a strided q and non-contiguous indices."""
    B, S, H, D = 2, 2, 16, 64
    cache = formats.quantize(torch.randn(B, 40, D, generator=rng), "fp4_b16").to(DEVICE)
    ring = _segment("fp8", B, 8, D, rng)
    q = torch.randn(B, H, S, D, generator=rng).to(torch.bfloat16).to(DEVICE).transpose(1, 2)
    idx = _indices(B, 24, S, 8 + 30, rng).transpose(1, 2)
    _check(q, (ring, cache.narrow(1, 0, 30)), idx, torch.randn(H, generator=rng).to(DEVICE))


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_attention_split_k(q_dtype, monkeypatch, rng):
    """Few queries: K split over programs, merged by _combine_kernel (bf16 partials for bf16 q)."""
    monkeypatch.setitem(attention.TILES, "split", {"programs": 64, "min_blocks": 1, "max_splits": 16})
    monkeypatch.setitem(attention.TILES, "attention", dict(attention.TILES["attention"], K_BLOCK=16))
    monkeypatch.setitem(attention.TILES, "attention_fp32", dict(attention.TILES["attention_fp32"], K_BLOCK=16))
    splits = []
    real = attention._combine
    monkeypatch.setattr(attention, "_combine", lambda *a: splits.append(a[-1]) or real(*a))
    B, S, H, D, T = 2, 1, 16, 32, 50
    q = torch.randn(B, S, H, D, generator=rng).to(q_dtype).to(DEVICE)
    kv = _kv("fp8+fp8+fp4_b16", B, T, D, rng)
    for sink in (None, torch.randn(H, generator=rng).to(DEVICE)):
        idx = _indices(B, S, 40, T, rng, empty_row=sink is None)
        idx[-1, 0, :20] = -1  # a split with no valid slot
        _check(q, kv, idx, sink)
    assert splits == [3, 3]


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d_split", [1, 2])
def test_attention_split_k_merged_in_the_launch(q_dtype, d_split, monkeypatch, rng):
    """``combine.in_kernel``: the last split program of each tile merges the partials, no combine
    launch; the output is bit-identical to the separate combine's (the same merge in the same
    order) and the ticket counters are back at zero after each call."""
    from flashrt import profiles
    from flashrt.kernels_cuda import splitk

    monkeypatch.setitem(attention.TILES, "split", {"programs": 64, "min_blocks": 1, "max_splits": 16})
    for key in ("attention", "attention_fp32"):
        monkeypatch.setitem(attention.TILES, key, dict(attention.TILES[key], K_BLOCK=16, D_SPLIT=d_split))
    B, S, H, D, T = 2, 1, 16, 64, 50
    q = torch.randn(B, S, H, D, generator=rng).to(q_dtype).to(DEVICE)
    kv = _kv("fp8+fp8+fp4_b16", B, T, D, rng)
    idx = _indices(B, S, 40, T, rng)
    idx[-1, 0, :20] = -1  # a split with no valid slot
    sink = torch.randn(H, generator=rng).to(DEVICE)
    outs, real = {}, attention._combine
    for in_kernel in (False, True):
        monkeypatch.setitem(attention.TILES, "combine", dict(attention.TILES["combine"], in_kernel=in_kernel))
        profiles._TILES_CACHE.clear()  # the merged tiles are cached per profile: take the change
        launches = []
        monkeypatch.setattr(attention, "_combine", lambda *a: launches.append(a[-1]) or real(*a))
        for _ in range(2):  # the second call finds the counters reset by the first
            outs[in_kernel], _ = _check(q, kv, idx, sink)
        assert (launches == []) == in_kernel, launches
        assert int(splitk.counters(q.device).abs().sum()) == 0
    _, _, _, splits, _, got_split = attention._plan(q, 40)
    assert splits > 1 and got_split == d_split
    assert torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D, split_k", [(64, False), (96, False), (96, True)])
def test_attention_output_columns_split_over_two_programs(q_dtype, D, split_k, monkeypatch, rng):
    """D_SPLIT 2, with and without split K: each program accumulates half of the columns (96:
    the high half is partly padding); the same results as the reference."""
    for key in ("attention", "attention_fp32"):
        monkeypatch.setitem(attention.TILES, key, dict(attention.TILES[key], K_BLOCK=16, D_SPLIT=2))
    monkeypatch.setitem(attention.TILES, "split", {"programs": 64, "min_blocks": 1, "max_splits": 16 if split_k else 1})
    B, S, H, T = 2, 2, 16, 40
    q = torch.randn(B, S, H, D, generator=rng).to(q_dtype).to(DEVICE)
    _, _, _, splits, _, d_split = attention._plan(q, 36)
    assert d_split == 2 and (splits > 1) == split_k
    _check(q, _kv("fp8+fp4_b16+fp4_b32", B, T, D, rng), _indices(B, S, 36, T, rng), torch.randn(H, generator=rng).to(DEVICE))


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_attention_four_segments(q_dtype, monkeypatch, rng):
    """HKCP's cold decode: ring + chunk (fp8) + the shared page pool + cold staging (fp4_b16, batch
    1, shared by every row); the fourth segment joins the pool's dequant path. With split K too."""
    monkeypatch.setitem(attention.TILES, "split", {"programs": 64, "min_blocks": 1, "max_splits": 16})
    B, S, H, D = 2, 1, 16, 64
    q = torch.randn(B, S, H, D, generator=rng).to(q_dtype).to(DEVICE)
    ring, chunk = _segment("fp8", B, 8, D, rng), _segment("fp8", B, S, D, rng)
    pool, staging = _segment("fp4_b16", 1, 30, D, rng), _segment("fp4_b16", 1, 12, D, rng)
    kv = (ring, chunk, pool, staging)
    assert attention._roles([1, 1, 2, 2]) == (0, 2, 2)
    for sink in (None, torch.randn(H, generator=rng).to(DEVICE)):
        _check(q, kv, _indices(B, S, 40, 8 + S + 30 + 12, rng), sink)


def test_cuda_backend_runs_the_kernel(monkeypatch, rng):
    launches = []
    monkeypatch.setattr(attention, "_sparse_attention_kernel", CountingKernel(attention._sparse_attention_kernel, launches))
    q = torch.randn(1, 1, 16, 32, generator=rng).to(DEVICE)
    with flashrt.use_backend("cuda"):
        assert dispatch.chain("sparse_attention", DEVICE.type) == ["cuda"]
        ops.sparse_attention(q, _kv("fp8", 1, 8, 32, rng), _indices(1, 1, 4, 8, rng), None, 0.1)
    assert len(launches) == 1


def test_supports_declines(rng):
    sup = lambda *args: attention.FAMILY.serves("sparse_attention", *args) is None
    idx = torch.zeros(1, 1, 4, dtype=torch.int32, device=DEVICE)

    def call(q, kv):
        return sup(q, kv, idx, None, 0.1)

    q32 = torch.randn(1, 1, 2, 32).to(DEVICE)
    kv32 = torch.randn(1, 8, 32).to(DEVICE)
    assert call(q32, kv32) and call(q32, _kv("fp8+fp8+fp4_b16", 1, 8, 32, rng))
    assert not call(q32.double(), kv32)  # fp64 q
    assert not call(q32, kv32.double())  # fp64 kv
    assert not call(torch.randn(1, 1, 2, 48).to(DEVICE), torch.randn(1, 8, 48).to(DEVICE))  # D % 32
    assert not call(torch.randn(1, 1, 2, 1024).to(DEVICE), torch.randn(1, 8, 1024).to(DEVICE))  # D > 512
    assert call(q32, tuple(_segment("fp8", 1, 2, 32, rng) for _ in range(4)))  # 4 segments, one format
    assert not call(q32, tuple(_segment("fp8", 1, 2, 32, rng) for _ in range(5)))  # 5 segments
    for kinds in ("fp8+fp4_b16+fp4_b32+bf16", "bf16+fp8+fp4_b16+fp4_b32"):  # a 4th format: no 4th dequant path
        assert not call(q32, _kv(kinds, 1, 8, 32, rng)), kinds
    with flashrt.use_backend("cuda"), pytest.raises(BackendError):
        ops.sparse_attention(q32.double(), kv32.double(), idx, None, 0.1)


# ---------------------------------------------------------------------------------------------
# realistic shapes (GPU): 64 heads x 512, K = 128 window + 512 top-k, main KV = context / 2


def _fp4_cache(B, T, D, g):
    """A random fp4_b16 cache drawn as stored bytes (E4M3 scale bytes 32..63: [1/16, 1.875])."""
    data = torch.randint(0, 256, (B, T, D // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(32, 64, (B, T, D // 16), generator=g, dtype=torch.uint8)
    return formats.QTensor(data, scale.view(torch.float8_e4m3fn), "fp4_b16", (B, T, D)).to(DEVICE)


def _model_case(B, S, context, g, q_dtype=torch.bfloat16):
    H, D, W, Tc = 64, 512, 128, context // 2
    q = (torch.randn(B, S, H, D, generator=g) * 0.5).to(q_dtype).to(DEVICE)
    kv = (_segment("fp8", B, W, D, g), _segment("fp8", B, S, D, g), _fp4_cache(B, Tc, D, g))
    window = torch.randint(0, W + S, (B, S, W), generator=g)
    topk = torch.randint(W + S, W + S + Tc, (B, S, 512), generator=g).sort(-1).values
    idx = torch.cat([window, topk], -1)
    idx[torch.rand(idx.shape, generator=g) < 0.05] = -1
    return q, kv, idx.to(torch.int32).to(DEVICE), torch.randn(H, generator=g).to(DEVICE)


def test_attention_model_shape_split(rng):
    """One decode query at the released shape (64 x 512, K = 640): split-K with bf16 partials."""
    case = _model_case(1, 1, 2048, rng)
    assert attention._plan(case[0], 640)[3] > 1
    _check(*case)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("B,context", [(1, 4096), (8, 4096), (64, 4096), (1, 131072), (8, 131072),
                                       (64, 131072), (1, 1 << 20)])
def test_attention_decode_realistic(B, context, rng):
    _check(*_model_case(B, 1, context, rng))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_attention_prefill_realistic(q_dtype, rng):
    _check(*_model_case(1, 512, 8192, rng, q_dtype))




@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_prefill_tiles_apply_from_their_query_count(q_dtype, monkeypatch, rng):
    """``tiles.attention.prefill``: launches of at least ``min_queries`` queries with bf16 q take its
    warps and stages, smaller ones (and fp32 q) keep their own; the results match the reference."""
    monkeypatch.setitem(attention.TILES, "prefill", {"min_queries": 6, "max_heads": 0, "num_warps": 4,
                                                     "num_stages": 3})
    H, D, T = 16, 64, 48
    own = attention.TILES["attention" if q_dtype == torch.bfloat16 else "attention_fp32"]
    for B, S in ((1, 5), (2, 3), (1, 1)):
        q = torch.randn(B, S, H, D, generator=rng).to(q_dtype).to(DEVICE)
        plan = attention._launch_plan(q, 24, (attention.FMT_CODES["fp8"],), True)["constexprs"]
        wide = q_dtype == torch.bfloat16 and B * S >= 6
        assert (plan["num_warps"], plan["num_stages"]) == ((4, 3) if wide else (own["num_warps"], own["num_stages"]))
        _check(q, _kv("fp8", B, T, D, rng), _indices(B, S, 24, T, rng), torch.randn(H, generator=rng).to(DEVICE))


def test_prefill_tiles_keep_programs_of_more_heads_than_max_heads(monkeypatch, rng):
    """``tiles.attention.prefill.max_heads``: a launch whose programs hold more heads (the padded
    head block) keeps the decode tile's warps even past ``min_queries``; at most that many take the
    variant; the results match the reference either way."""
    max_heads = (16, 32)[int(torch.randint(2, (1,), generator=rng))]
    monkeypatch.setitem(attention.TILES, "prefill", {"min_queries": 2, "max_heads": max_heads, "num_warps": 4,
                                                     "num_stages": 3})
    own, D, T = attention.TILES["attention"], 64, 40
    for H in (8, 16, 24, 32, 48, 64):
        q = torch.randn(1, 3, H, D, generator=rng).to(torch.bfloat16).to(DEVICE)
        plan = attention._launch_plan(q, 24, (attention.FMT_CODES["fp8"],), True)["constexprs"]
        variant = max(16, 1 << (H - 1).bit_length()) <= max_heads  # heads padded to a power of two, >= 16
        assert (plan["num_warps"], plan["num_stages"]) == ((4, 3) if variant else (own["num_warps"], own["num_stages"]))
        if H in (16, 64):
            _check(q, _kv("fp8", 1, T, D, rng), _indices(1, 3, 24, T, rng), torch.randn(H, generator=rng).to(DEVICE))
