"""``ops.index_scores`` over paged keys (:class:`flashrt.kv.paged.PagedKeys`, the HKCP index K).

Paged keys must give exactly what the contiguous keys they map give: on the reference backend
(a gather, then the same math: equal bit for bit) and on the CUDA kernel (which reads the pool
rows in place; relative error against the reference). Pages are placed in a shuffled order with
spare and garbage pages around them, and block-table columns past ``length`` point anywhere.
"""
import pytest
import torch

import flashrt
from flashrt import ops
from flashrt.backends import trace
from flashrt.formats import QTensor
from flashrt.kv.paged import PagedKeys
from kernel_check import DEVICE, GPU, assert_error, kernels_available, rel_err, run_both


def paged(k, P: int, g, spare: int = 3) -> PagedKeys:
    """``k`` [B, T, D] (plain or QTensor) spread over a pool whose pages are shuffled; the pool's
    other rows are random bytes."""
    B, T, D = k.shape
    n = -(-T // P)
    pages = B * n + spare
    perm = torch.randperm(pages, generator=g)[: B * n].view(B, n)  # non-monotonic placement
    table = torch.cat([perm, torch.randint(0, pages, (B, 2), generator=g)], 1).to(torch.int32)

    def spread(x, fill):  # x [B, T, w] -> pool [1, pages * P, w] with x's rows at the mapped places
        pool = fill((pages * P, x.shape[-1]))
        t = torch.arange(T)
        rows = perm[:, t // P].long() * P + t % P
        pool[rows.reshape(-1)] = x.reshape(B * T, -1)
        return pool.unsqueeze(0)

    if isinstance(k, QTensor):
        u8 = torch.uint8
        rand = lambda shape: torch.randint(0, 256, shape, generator=g, dtype=u8)
        data = spread(k.data.view(u8), rand).view(k.data.dtype)
        scale = spread(k.scale.view(u8), lambda s: torch.full(s, 120, dtype=u8)).view(k.scale.dtype)
        pool = QTensor(data, scale, k.fmt, (1, pages * P, D))
    else:
        pool = spread(k, lambda s: torch.randn(s, generator=g).to(k.dtype))
    return PagedKeys(pool, table, P, T)


def inputs(B, S, H, D, T, g, fmt=None):
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(B, T, D, generator=g)
    k = ops.quantize(k, fmt) if fmt else k
    vis = torch.randint(0, T + 1, (B, S), generator=g, dtype=torch.int32)
    vis.view(-1)[-1] = T
    return q, k, torch.randn(B, S, H, generator=g), vis


@pytest.mark.parametrize("fmt,P", [(None, 4), ("fp4_b32", 8), ("fp4_b32", 3), ("fp8", 16)])
def test_reference_paged_equals_contiguous(fmt, P, rng):
    q, k, w, vis = inputs(2, 3, 4, 32, 37, rng, fmt)
    pk = paged(k, P, rng)
    with flashrt.use_backend("reference"):
        want = ops.index_scores(q, k, w, vis)
        got = ops.index_scores(q, pk, w, vis)
    assert torch.equal(got, want)


@pytest.mark.skipif(not kernels_available(), reason="cuda backend unavailable (no triton)")
@pytest.mark.parametrize("fmt,P,T,D", [(None, 4, 37, 32), ("fp4_b32", 8, 37, 32), ("fp4_b32", 64, 150, 128),
                                       ("fp4_b32", 5, 129, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_paged_equals_contiguous(fmt, P, T, D, dtype, rng):
    q, k, w, vis = inputs(2, 2, 4, D, T, rng, fmt)
    q, k = q.to(dtype), (k if fmt else k.to(dtype))
    pk = paged(k, P, rng)
    q, k, w, vis = (t.to(DEVICE) for t in (q, k, w, vis))
    pk = PagedKeys(pk.pool.to(DEVICE), pk.block_table.to(DEVICE), P, T)
    got, want = run_both("index_scores", q, pk, w, vis)
    assert rel_err(got.cpu(), want.cpu()) < (5e-3 if GPU and dtype != torch.float32 else 1e-4)
    with flashrt.use_backend("cuda"):
        flat = ops.index_scores(q, k, w, vis)
    assert torch.equal(got, flat)  # the same tiles as the contiguous kernel, only the addresses differ


def test_trace_counts_the_mapped_rows_not_the_pool(rng):
    q, k, w, vis = inputs(1, 2, 2, 32, 16, rng, "fp4_b32")
    pk = paged(k, 4, rng, spare=40)
    meta = lambda t: t.to("meta")
    mk = PagedKeys(QTensor(meta(pk.pool.data), meta(pk.pool.scale), pk.pool.fmt, pk.pool.shape), meta(pk.block_table), 4, 16)
    with trace.record() as g_paged, flashrt.use_backend("trace"):
        ops.index_scores(meta(q), mk, meta(w), meta(vis))
    with trace.record() as g_flat, flashrt.use_backend("trace"):
        ops.index_scores(meta(q), QTensor(meta(k.data), meta(k.scale), k.fmt, k.shape), meta(w), meta(vis))
    a, b = g_paged.calls[0], g_flat.calls[0]
    assert a.flops == b.flops
    assert a.bytes_read == b.bytes_read + pk.block_table.numel() * 4


def test_bad_paged_keys(rng):
    q, k, w, vis = inputs(2, 3, 4, 32, 20, rng, "fp4_b32")
    pk = paged(k, 4, rng)
    ops.index_scores(q, pk, w, vis)
    bad = lambda **kw: PagedKeys(**{**pk.__dict__, **kw})
    assert_error(lambda: ops.index_scores(q, bad(block_table=pk.block_table.long()), w, vis),
                 "k.block_table", "torch.int32", "torch.int64")
    assert_error(lambda: ops.index_scores(q, bad(block_table=pk.block_table[:1]), w, vis), "k.block_table", "B=2")
    assert_error(lambda: ops.index_scores(q, bad(page_size=0), w, vis), "k.page_size", ">= 1", "0")
    assert_error(lambda: ops.index_scores(q, bad(page_size=7), w, vis), "k.pool", "rows % page_size", "7")
    assert_error(lambda: ops.index_scores(q, bad(length=10 ** 6), w, vis), "k.length", "max_pages * page_size")
    assert_error(lambda: ops.index_scores(q, bad(pool=ops.quantize(torch.randn(1, 64, 64), "fp4_b32")), w, vis),
                 "k.pool", "Di=32")
    assert_error(lambda: ops.index_scores(q, bad(pool=ops.quantize(torch.randn(2, 64, 32), "fp4_b32")), w, vis),
                 "k.pool", "[1, rows, Di=32]")
    high = pk.block_table.clone()
    high[1, 0] = pk.pool.shape[1] // 4
    assert_error(lambda: ops.index_scores(q, bad(block_table=high), w, vis), "k.block_table", "[0, ")
    assert_error(lambda: ops.index_scores(q, bad(length=5), w, vis), "visible", "[0, 6)")
