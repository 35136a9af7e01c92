"""The host bookkeeping of a serving step, done in batches: a step's page reservations, a row moved
in one copy of every layer's ring, block-table buffers refreshed only after an edit. Each is checked
against the per-row / per-layer way it replaces, on random inputs."""
import pytest
import torch

from flashrt.kv.index import IndexPool, PagedIndexK
from flashrt.kv.main_kv import PagedMainKV
from flashrt.kv.pages import PagePool
from flashrt.kv.state import KVState


def _draw(rng, hi: int, n: int = 1) -> list[int]:
    return torch.randint(0, hi, (n,), generator=rng).tolist()


def test_index_reserve_rows_equals_reserving_row_by_row(rng):
    """Same pages in the same order, same table (new pages written in one copy), whatever grows."""
    a_pool, b_pool = IndexPool(32, 4, "cpu", 2), IndexPool(32, 4, "cpu", 2)
    a, b = PagedIndexK(a_pool, 6, 8), PagedIndexK(b_pool, 6, 8)
    for _ in range(20):
        ends = [max(len(p) * 4 - 3, 0) + e for p, e in zip(a.pages, _draw(rng, 24, 6))]
        for row, end in enumerate(ends):
            a.reserve(row, end)
        b.reserve_rows(ends)
        assert a.pages == b.pages and torch.equal(a.table, b.table)
        assert a_pool.free == b_pool.free and a_pool.generation == b_pool.generation


def test_index_reserve_rows_writes_the_pages_it_handed_out_before_a_failure(rng, monkeypatch):
    pool = IndexPool(32, 4, "cpu", 64)
    keys = PagedIndexK(pool, 4, 64)
    real, left = pool.alloc, [int(_draw(rng, 6)[0]) + 1]

    def alloc():
        left[0] -= 1
        if left[0] < 0:
            raise RuntimeError("out of memory")
        return real()

    monkeypatch.setattr(pool, "alloc", alloc)
    with pytest.raises(RuntimeError, match="out of memory"):
        keys.reserve_rows([16, 16, 16, 16])
    for row, pages in enumerate(keys.pages):  # the table says what the host mirror says
        assert keys.table[row, :len(pages)].tolist() == pages
        assert (keys.table[row, len(pages):] == 0).all()


def test_main_reserve_rows_and_lock_rows_equal_the_row_by_row_calls(cfg, rng):
    """With a pool that spills: the same locks, pages, spills and tables as lock_from / reserve (the
    row locks applied when a spill needs them)."""
    def build():
        pool = PagePool(cfg.head_dim, 4, "cpu", 24)
        return pool, PagedMainKV(pool, 5, entries=200)

    (pa, a), (pb, b) = build(), build()
    positions = [0] * 5
    for step in range(200):  # at least 25 steps, and on until the pool has spilled
        if step >= 25 and pa.spilled > 0:
            break
        tokens = _draw(rng, 6)[0] + 1
        firsts, ends = positions, [p + tokens for p in positions]
        for m, pool, batched in ((a, pa, False), (b, pb, True)):
            pool.unlock()
            if batched:
                m.lock_rows(firsts)
                m.reserve_rows(ends, firsts)
            else:
                for row, f in enumerate(firsts):
                    m.lock_from(row, f)
                for row, (e, f) in enumerate(zip(ends, firsts)):
                    m.reserve(row, e, f)
        assert [t.pages for t in a.tables] == [t.pages for t in b.tables]
        assert pa.locked_pages() == pb.locked_pages() and pa.spilled == pb.spilled and list(pa.fifo) == list(pb.fifo)
        assert torch.equal(a.dev_ids(), b.dev_ids()) and torch.equal(a.host_ids(), b.host_ids())
        positions = [e if k else 0 for e, k in zip(ends, _draw(rng, 8, 5))]  # some rows start over (rows grow past the pool: spills)
        for row, p in enumerate(positions):
            if p == 0:
                a.clear_row(row)
                b.clear_row(row)
    assert pa.spilled > 0


def test_block_table_buffers_follow_edits_made_through_another_batch(cfg, rng):
    """Two batches share a pool: a spill caused by one moves the other's page to the host, and the
    other's buffers show it (the skip of an unchanged batch must not miss it)."""
    pool = PagePool(cfg.head_dim, 4, "cpu", 6)
    a, b = PagedMainKV(pool, 2, entries=200), PagedMainKV(pool, 2, entries=200)
    for row in range(2):
        a.reserve(row, 8)
    pool.unlock()
    before = a.dev_ids().clone()
    ends = [0, 0]
    for _ in range(9):  # one more page for a random row of b each step (a step's pages fit the pool)
        row = int(_draw(rng, 2)[0])
        ends[row] += 4
        b.reserve(row, ends[row])
        pool.unlock()
    for m in (a, b):
        want = torch.full_like(m.dev_ids(), -1)
        for r, t in enumerate(m.tables):
            for j, (tier, p) in enumerate(t.pages):
                if tier == "dev":
                    want[r, j] = p
        assert torch.equal(m.dev_ids(), want)
    assert not torch.equal(before, a.dev_ids())  # some of a's pages went cold


def test_take_row_moves_every_layer_in_one_copy_as_layer_by_layer(cfg, rng):
    """A state's rings are views of one store: take_row from it equals the layer-by-layer copy a
    concatenated state (no store) takes; reset_row clears every layer's ring start."""
    pool = KVState.pool_for(cfg, 4, 32, "cpu", None)
    src = KVState(cfg, 3, 32, "cpu", pool=pool)
    u8 = torch.uint8
    for l, q in src.rings.items():
        q.data.view(u8).copy_(torch.randint(0, 256, q.data.shape, generator=rng, dtype=torch.int32).to(u8))
        q.scale.view(u8).copy_(torch.randint(0, 256, q.scale.shape, generator=rng, dtype=torch.int32).to(u8))
        src.ring_start[l].copy_(torch.randint(0, 50, (3,), generator=rng))
    split = KVState.cat([KVState(cfg, 1, 32, "cpu", pool=pool), KVState(cfg, 1, 32, "cpu", pool=pool)])
    stacked = KVState(cfg, 2, 32, "cpu", pool=pool)
    row = _draw(rng, 3)[0]
    want = {l: (q.data.view(u8)[row].clone(), q.scale.view(u8)[row].clone(), int(src.ring_start[l][row]))
            for l, q in src.rings.items()}
    stacked.take_row(1, src, row)
    split.take_row(1, stacked, 1)
    for l, (data, scale, start) in want.items():
        for st in (stacked, split):
            assert torch.equal(st.rings[l].data.view(u8)[1], data) and torch.equal(st.rings[l].scale.view(u8)[1], scale)
        assert int(split.ring_start[l][1]) == start and int(stacked.ring_start[l][1]) == 0  # moved on, then reset
        assert int(src.ring_start[l][row]) == 0


def test_index_rows_of_any_span_are_their_pool_rows(rng):
    """``PagedIndexK._rows``: entry ``e`` of a row lives at pool row ``pages[e // P] * P + e % P``,
    for spans starting and ending anywhere (not only on page bounds)."""
    P = int(torch.randint(2, 9, (), generator=rng))
    keys = PagedIndexK(IndexPool(16, P, "cpu", 64), 3, 40 * P)
    row = int(torch.randint(0, 3, (), generator=rng))
    n = int(torch.randint(1, 30 * P, (), generator=rng))
    keys.reserve(row, n)
    pages = keys.pages[row] = [keys.pages[row][i] for i in torch.randperm(len(keys.pages[row]), generator=rng)]
    for _ in range(20):
        lo = int(torch.randint(0, n, (), generator=rng))
        hi = int(torch.randint(lo + 1, n + 1, (), generator=rng))
        want = [pages[e // P] * P + e % P for e in range(lo, hi)]
        assert keys._rows(row, lo, hi).tolist() == want
