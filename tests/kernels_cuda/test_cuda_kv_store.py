"""``store_paged`` (kernels_cuda/kv_store.py): the one-launch paged KV store against the reference
and against stores made pair by pair in Python, on fresh random pools, block tables and entries
(odd batch sizes, entry counts and row widths: word rows and byte rows; int32 and int64 tables;
masked pairs and pages with no pool page going to the trash row)."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from flashrt.formats import QTensor
from kernel_check import DEVICE, assert_error, launches, pinned_tiles, requires_kernels  # noqa: F401 (launches: a fixture)

pytestmark = requires_kernels
ks = pytest.importorskip("flashrt.kernels_cuda.kv_store")

U8 = torch.uint8


def _case(rng, fmt, B, n, D, P, pages, table_dtype):
    """A pool of ``pages`` pages (page 0 the trash page), each row's logical pages on distinct pool
    pages (some logical pages without one: -1), entries distinct per row, about a third masked."""
    W = max(1, -(-(n + 3) // P))
    pool = formats.quantize(torch.randn(1, pages * P, D, generator=rng), fmt).to(DEVICE)
    ids = (torch.randperm(pages - 1, generator=rng)[:B * W] + 1).view(B, W)
    ids[torch.rand(B, W, generator=rng) < 0.2] = -1
    entry = torch.stack([torch.randperm(W * P, generator=rng)[:n] for _ in range(B)])
    mask = torch.rand(B, n, generator=rng) < 0.7
    entry[~mask & (torch.rand(B, n, generator=rng) < 0.5)] = -1  # an empty entry is only ever masked off
    values = formats.quantize(torch.randn(B, n, D, generator=rng), fmt).to(DEVICE)
    return pool, ids.to(DEVICE, table_dtype), entry.to(DEVICE), mask.to(DEVICE), values, P


def _copy(q: QTensor) -> QTensor:
    return QTensor(q.data.clone(), q.scale.clone(), q.fmt, q.shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(U8).reshape(t.shape[0] * t.shape[1], -1).cpu()


def _by_hand(pool, table, entry, mask, values, P):
    """(pool data bytes, scale bytes, trash candidates) from plain Python loops over the pairs."""
    data, scale = _bytes(pool.data).clone(), _bytes(pool.scale).clone()
    vdata, vscale = _bytes(values.data), _bytes(values.scale)
    trash = []
    for b in range(entry.shape[0]):
        for j in range(entry.shape[1]):
            e = max(int(entry[b, j]), 0)
            page = int(table[b, min(e // P, table.shape[1] - 1)])
            i = b * entry.shape[1] + j
            if bool(mask[b, j]) and page >= 0:
                data[page * P + e % P], scale[page * P + e % P] = vdata[i], vscale[i]
            else:
                trash.append(i)
    return data, scale, trash


def _store(backend, args):
    pool = _copy(args[0])
    with flashrt.use_backend(backend):
        out = ops.store_paged(pool, *args[1:], 0)
    assert out is pool
    return pool


@pytest.mark.parametrize("fmt,B,n,D,P,table_dtype", [
    ("fp4_b16", 1, 1, 512, 64, torch.int64),   # a decode step's main-KV store
    ("fp4_b16", 3, 5, 48, 4, torch.int64),     # 3 scale bytes a row: byte rows
    ("fp4_b32", 5, 2, 128, 8, torch.int32),    # the indexer's K pool: an int32 block table
    ("fp8", 2, 7, 96, 3, torch.int32),
    ("int8", 7, 3, 64, 5, torch.int64),
])
def test_kernel_matches_the_reference_and_stores_by_hand(rng, fmt, B, n, D, P, table_dtype):
    args = _case(rng, fmt, B, n, D, P, pages=2 * B * (-(-(n + 3) // P)) + 3, table_dtype=table_dtype)
    got, want = _store("cuda", args), _store("reference", args)
    data, scale, trash = _by_hand(*args)
    gd, gs = _bytes(got.data), _bytes(got.scale)
    keep = torch.ones(gd.shape[0], dtype=torch.bool)
    keep[0] = False  # the trash row: one of the pairs not stored
    for g, w, h in ((gd, _bytes(want.data), data), (gs, _bytes(want.scale), scale)):
        assert torch.equal(g[keep], h[keep]) and torch.equal(w[keep], h[keep])
    if trash:  # the pairs not stored race for the trash row: each byte is some such pair's byte
        vd, vs = _bytes(args[4].data), _bytes(args[4].scale)
        for g, v in ((gd, vd), (gs, vs)):
            assert (g[0][None] == v[trash]).any(0).all()
    else:
        assert torch.equal(gd[0], _bytes(args[0].data)[0])


def test_one_launch_and_the_switch_off_is_the_same_store(rng, launches):
    pool, table, entry, mask, values, P = _case(rng, "fp4_b16", 4, 3, 64, 4, pages=20, table_dtype=torch.int64)
    # every pair stored, each to a pool row of its own (distinct pages, distinct entries per row): the
    # result is defined to the byte (pairs sharing a row would race on a GPU)
    B, W = table.shape
    table = (torch.randperm(19, generator=rng)[:B * W] + 1).view(B, W).to(DEVICE, torch.int64)
    entry = torch.stack([torch.randperm(W * P, generator=rng)[:entry.shape[1]] for _ in range(B)]).to(DEVICE)
    args = (pool, table, entry, torch.ones_like(mask), values, P)
    with pinned_tiles(kv_store=dict(store_paged=dict(in_kernel=True))):
        fused = _store("cuda", args)
    assert launches == ["_store_paged_kernel"]
    with pinned_tiles(kv_store=dict(store_paged=dict(in_kernel=False))):
        plain = _store("cuda", args)
    assert launches == ["_store_paged_kernel"]  # the switch off launched no kernel
    assert torch.equal(fused.data.view(U8), plain.data.view(U8))
    assert torch.equal(fused.scale.view(U8), plain.scale.view(U8))


def test_bad_arguments_are_named(rng):
    pool, table, entry, mask, values, P = _case(rng, "fp4_b16", 2, 3, 32, 4, pages=12, table_dtype=torch.int64)
    call = lambda **kw: ops.store_paged(**{"pool": pool, "table": table, "entry": entry, "mask": mask,
                                           "values": values, "page_entries": P, "trash_row": 0, **kw})
    assert_error(lambda: call(pool=pool.data), "pool", "QTensor")
    assert_error(lambda: call(mask=mask.int()), "mask", "bool")
    assert_error(lambda: call(mask=mask[:, :2]), "mask", "n=3")
    assert_error(lambda: call(values=formats.quantize(torch.randn(2, 3, 32), "fp8").to(DEVICE)), "values", "fp4_b16")
    assert_error(lambda: call(page_entries=5), "page_entries", "divisor")
    assert_error(lambda: call(trash_row=48), "trash_row", "[0, 47]")
    assert_error(lambda: call(entry=torch.full_like(entry, 4 * table.shape[1])), "entry", "values in")


@pytest.mark.parametrize("B,N,W,P,table_dtype,offset", [(1, 640, 3, 64, torch.int64, 129), (3, 37, 5, 7, torch.int32, 0),
                                                        (5, 1, 1, 1, torch.int64, 3), (2, 1500, 9, 16, torch.int32, 0)])
def test_resolve_matches_the_reference_and_lookups_by_hand(rng, B, N, W, P, table_dtype, offset):
    table = torch.randint(-1, 50, (B, W), generator=rng)  # -1: a logical page with no pool page
    picks = torch.randint(-1, W * P, (B, N), generator=rng, dtype=torch.int32)
    args = (table.to(DEVICE, table_dtype), picks.to(DEVICE), P, offset)
    with flashrt.use_backend("cuda"):
        got = ops.resolve_paged(*args)
    with flashrt.use_backend("reference"):
        want = ops.resolve_paged(*args)
    hand = [[-1 if e < 0 or table[b, e // P] < 0 else offset + int(table[b, e // P]) * P + e % P
             for e in picks[b].tolist()] for b in range(B)]
    assert got.dtype == torch.int32 and got.shape == (B, N)
    assert torch.equal(got.cpu(), want.cpu()) and got.cpu().tolist() == hand


def test_resolve_is_one_launch_and_checks_its_arguments(rng, launches):
    table = torch.randint(0, 9, (2, 4), generator=rng).to(DEVICE)
    picks = torch.randint(-1, 32, (2, 11), generator=rng).to(DEVICE)
    with flashrt.use_backend("cuda"):
        ops.resolve_paged(table, picks, 8)
    assert launches == ["_resolve_paged_kernel"]
    assert_error(lambda: ops.resolve_paged(table, picks.float(), 8), "picks", "int32")
    assert_error(lambda: ops.resolve_paged(table[:1], picks, 8), "table", "B=2")
    assert_error(lambda: ops.resolve_paged(table, picks, 0), "page_entries", ">= 1")
    assert_error(lambda: ops.resolve_paged(table, picks, 8, -1), "offset", "[0,")
    past = picks.clone()
    past[1, 3] = 32  # one past the 4 pages x 8 entries
    assert_error(lambda: ops.resolve_paged(table, past, 8), "picks", "[-1, 32)")


@pytest.mark.parametrize("fmt,Bd,S,D,n", [("fp8", 1, 8, 512, 1), ("fp8", 5, 7, 96, 5), ("int8", 3, 128, 64, 3),
                                          ("fp4_b16", 6, 5, 48, 11)])
def test_store_rows_matches_the_reference_and_stores_by_hand(rng, launches, fmt, Bd, S, D, n):
    dst = formats.quantize(torch.randn(Bd, S, D, generator=rng), fmt).to(DEVICE)
    flat = torch.randperm(Bd * S, generator=rng)[:n]  # n distinct (row, slot) pairs
    batch, slot = (flat // S).to(DEVICE), (flat % S).to(DEVICE)
    src = formats.quantize(torch.randn(n, D, generator=rng), fmt).to(DEVICE)
    got, want = _copy(dst), _copy(dst)
    with flashrt.use_backend("cuda"):
        assert ops.store_rows(got, batch, slot, src) is got
    assert launches == ["_store_rows_kernel"]
    with flashrt.use_backend("reference"):
        ops.store_rows(want, batch, slot, src)
    for part, g, w in (("data", got.data, want.data), ("scale", got.scale, want.scale)):
        hand = _bytes(getattr(dst, part)).clone()
        hand[flat] = _bytes(getattr(src, part).unsqueeze(0))
        assert torch.equal(_bytes(g), hand) and torch.equal(_bytes(w), hand), part


@pytest.mark.parametrize("fmt,Bd,S,D,n", [("fp8", 2, 8, 512, 6), ("fp4_b16", 4, 5, 48, 11), ("int8", 1, 16, 64, 7)])
def test_store_rows_with_keep_writes_only_the_kept_pairs(rng, launches, fmt, Bd, S, D, n):
    """``keep``: the pairs it marks are stored, every other row keeps its bytes (the pairs not kept
    included), on the CUDA kernel (one launch more: their slots set to -1) and the reference alike."""
    dst = formats.quantize(torch.randn(Bd, S, D, generator=rng), fmt).to(DEVICE)
    flat = torch.randperm(Bd * S, generator=rng)[:n]
    batch, slot = (flat // S).to(DEVICE), (flat % S).to(DEVICE)
    keep = (torch.rand(n, generator=rng) < 0.5).to(DEVICE)
    src = formats.quantize(torch.randn(n, D, generator=rng), fmt).to(DEVICE)
    got, want = _copy(dst), _copy(dst)
    with flashrt.use_backend("cuda"):
        assert ops.store_rows(got, batch, slot, src, keep) is got
    assert launches == ["_store_rows_kernel"]
    with flashrt.use_backend("reference"):
        ops.store_rows(want, batch, slot, src, keep)
    for part, g, w in (("data", got.data, want.data), ("scale", got.scale, want.scale)):
        hand = _bytes(getattr(dst, part)).clone()
        hand[flat[keep.cpu()]] = _bytes(getattr(src, part).unsqueeze(0))[keep.cpu()]
        assert torch.equal(_bytes(g), hand) and torch.equal(_bytes(w), hand), part


def test_store_rows_checks_its_arguments(rng):
    dst = formats.quantize(torch.randn(3, 4, 32, generator=rng), "fp8").to(DEVICE)
    src = formats.quantize(torch.randn(2, 32, generator=rng), "fp8").to(DEVICE)
    rows = torch.tensor([0, 2], device=DEVICE)
    assert_error(lambda: ops.store_rows(dst, rows, torch.tensor([1, 4], device=DEVICE), src), "slot", "[0, 4)")
    assert_error(lambda: ops.store_rows(dst, rows.int(), rows, src), "batch", "int64")
    assert_error(lambda: ops.store_rows(dst, rows, rows, src, rows), "keep", "bool")
    assert_error(lambda: ops.store_rows(dst, rows, rows, src, torch.ones(3, dtype=torch.bool, device=DEVICE)),
                 "keep", "n=2")
    assert_error(lambda: ops.store_rows(dst, rows[:1], rows[:1], src), "src", "n=1")
    assert_error(lambda: ops.store_rows(dst, rows, rows, formats.quantize(torch.randn(2, 32), "int8").to(DEVICE)),
                 "src", "fp8")
