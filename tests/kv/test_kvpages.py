"""HKCP page pools: paged index K (device only, read in place), trash pages, generations, budget."""
import pytest
import torch

from flashrt.formats import QTensor
from flashrt.kv.state import KVState, entry_bytes, fixed_bytes_for, index_pages_for
from flashrt.kv.pages import BlockTable
from flashrt.kv.paged import PagedKeys


def ids(rng, model, batch, length):
    return torch.randint(0, model.cfg.vocab_size, (batch, length), generator=rng)


def new_state(model, batch, capacity, page_entries=4):
    pool = KVState.pool_for(model.cfg, batch, capacity, model.device, None, page_entries)
    return model.new_state(batch, capacity, pool=pool)


def shuffle_free_lists(state, rng):
    for pool, attr in ((state.index_pool, "free"), (state.pool, "free_dev")):
        free = getattr(pool, attr)
        setattr(pool, attr, [free[i] for i in torch.randperm(len(free), generator=rng).tolist()])


def test_pages_in_any_order_give_the_same_logits(model, rng):
    x = ids(rng, model, 2, 45)
    plain = new_state(model, 2, 64)
    want = [model.forward(x[:, :40], state=plain)] + [model.forward(x[:, i:i + 1], state=plain) for i in range(40, 45)]
    state = new_state(model, 2, 64)
    shuffle_free_lists(state, rng)
    got = [model.forward(x[:, :40], state=state)] + [model.forward(x[:, i:i + 1], state=state) for i in range(40, 45)]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    pages = state.compressed[4].index_k.pages[0]
    assert pages != sorted(pages)  # the rows' pages really are out of order
    keys = state.index_keys(4, 44)
    assert isinstance(keys, PagedKeys) and keys.shape == (2, 44, model.cfg.index_head_dim)


def test_index_keys_read_what_was_written(model, rng):
    state = new_state(model, 3, 40)
    shuffle_free_lists(state, rng)
    model.forward(ids(rng, model, 3, 33), state=state)
    cache = state.compressed[2].index_k
    keys = state.index_keys(2, 16).gather()  # ratio 2: 16 entries
    for row in range(3):
        stored = cache.read_row(row, 0, 16)
        assert torch.equal(keys.data[row], stored.data)
        assert torch.equal(keys.scale[row].view(torch.uint8), stored.scale.view(torch.uint8))
    assert keys.data.any()


def test_masked_writes_go_to_the_trash_page_only(model, rng):
    state = new_state(model, 2, 32)
    for row in range(2):
        state.compressed[4].index_k.reserve(row, 8)
        state.compressed[4].main.reserve(row, 8)
    before_i, before_m = state.index_pool.dev.data.clone(), state.pool.dev.data.clone()
    Di, D = model.cfg.index_head_dim, model.cfg.head_dim
    rand = lambda fmt, dim: QTensor(torch.randint(0, 256, (2, 8, dim // 2), generator=rng, dtype=torch.uint8),
                                    torch.full((2, 8, dim // (32 if fmt == "fp4_b32" else 16)), 1, dtype=torch.uint8).view(
                                        torch.float8_e8m0fnu if fmt == "fp4_b32" else torch.float8_e4m3fn), fmt, (2, 8, dim))
    entry = torch.arange(8).repeat(2, 1)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[1, 5] = True
    main, index = rand("fp4_b16", D), rand("fp4_b32", Di)
    state.append_entries(4, main, index, entry, mask)
    c = state.compressed[4]
    for pool, before, page in ((state.index_pool, before_i, c.index_k.pages[1][1]),
                               (state.pool, before_m, c.main.tables[1].pages[1][1])):
        changed = (pool.dev.data != before).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == sorted({0, page})  # the one stored entry's page, and the trash page (0)
    got = state.compressed[4].index_k.read_row(1, 5, 6)
    assert torch.equal(got.data[0], index.data[1, 5])
    assert torch.equal(state.compressed[4].main.read_row(1, 8).data[5], main.data[1, 5])
    assert state.compressed[4].index_k.read_row(0, 0, 8).data.count_nonzero() == 0  # row 0: nothing stored


def test_block_table_updated_in_place_and_generation_on_growth(model, rng):
    state = new_state(model, 1, 16)
    table = state.compressed[4].index_k.table
    gen = state.generation
    x = ids(rng, model, 1, 16)
    model.forward(x[:, :12], state=state)
    assert state.compressed[4].index_k.table.data_ptr() == table.data_ptr() and state.generation == gen
    model.forward(x[:, 12:16], state=state)
    model.forward(x[:, :1], state=state)  # position 16: past the capacity, the table and pool grow
    assert state.generation > gen
    assert state.compressed[4].index_k.table.data_ptr() != table.data_ptr()
    assert state.index_pool.trash_row == 0 and state.pool.trash_row == 0


def test_budget_split_counts_index_pages(cfg):
    P, cap, B = 8, 300, 2
    main_page = P * entry_bytes(cfg.head_dim, "fp4_b16")
    index_page = P * entry_bytes(cfg.index_head_dim, "fp4_b32")
    budget = fixed_bytes_for(cfg, B, cap, P) + 20 * main_page + main_page - 1
    pool = KVState.pool_for(cfg, B, cap, "cpu", budget, P)
    assert pool.limit == 20 and pool.device_pages == 16  # allocated lazily, up to the budget
    need = index_pages_for(cfg, B, cap, P)
    assert [cfg.ratio(l) for l in cfg.kv_source_layers] == [2, 1]
    assert need == B * (19 + 38)  # 150 entries -> 19 pages of 8, 300 -> 38
    assert pool.index_pool.dev.shape[0] == need + 1  # + trash
    device = pool.dev.nbytes + pool.index_pool.dev.nbytes
    rings = cfg.total_layers * cfg.window_size * (cfg.head_dim + cfg.head_dim // 32) * B
    assert device + rings <= budget and index_page * (need + 1) <= fixed_bytes_for(cfg, B, cap, P)


def test_device_pages_grow_to_the_budget_then_spill_then_the_cold_cap(cfg):
    """Device pages are allocated by doubling up to the budget's count, then the oldest spill to
    host pages, at most the cold-tier bytes; past that a clear error (nothing overwritten)."""
    P = 8
    page = P * entry_bytes(cfg.head_dim, "fp4_b16")
    budget = fixed_bytes_for(cfg, 1, 4000, P) + 40 * page
    pool = KVState.pool_for(cfg, 1, 4000, "cpu", budget, P, cold_bytes=20 * page)
    table = BlockTable()
    pages = [pool.alloc(table, j) for j in range(40)]
    table.pages = [("dev", p) for p in pages]
    pool.unlock()
    assert pool.device_pages == 40 and pool.spilled == 0 and len(set(pages)) == 40 and 0 not in pages
    for j in range(40, 60):
        table.pages.append(("dev", pool.alloc(table, j)))
    assert pool.device_pages == 40 and pool.spilled == 20 and table.cold == 20
    with pytest.raises(ValueError, match="cold tier is full"):
        pool.alloc(table, 60)


def test_block_table_buffers_follow_every_change_incrementally(cfg, rng):
    """Pages added and spilled in random order: the device / host id buffers, updated entry by entry
    (not rebuilt) while their width suffices, always equal a rebuild from the tables."""
    from flashrt.kv.main_kv import PagedMainKV
    from flashrt.kv.pages import PagePool

    pool = PagePool(cfg.head_dim, 4, "cpu", 12)
    main = PagedMainKV(pool, 3, entries=400)
    for step in range(60):
        row = int(torch.randint(0, 3, (1,), generator=rng))
        main.reserve(row, 4 * (len(main.tables[row].pages) + int(torch.randint(1, 3, (1,), generator=rng))))
        pool.unlock()
        buf = main.dev_ids()
        width = buf.shape[1]
        want_dev = torch.full((3, width), -1, dtype=torch.long)
        want_host = torch.full((3, width), -1, dtype=torch.long)
        for r, t in enumerate(main.tables):
            for j, (tier, p) in enumerate(t.pages):
                (want_dev if tier == "dev" else want_host)[r, j] = p
        assert torch.equal(buf, want_dev) and torch.equal(main.host_ids(), want_host)
        assert torch.equal(main.host_ids_device(), want_host), step
    assert pool.spilled > 10 and width == main._dev_ids.shape[1] == 100  # 400 entries / 4: never widened


def test_cold_page_count_follows_the_spills(cfg):
    from flashrt.kv.main_kv import PagedMainKV
    from flashrt.kv.pages import PagePool

    pool = PagePool(cfg.head_dim, 4, "cpu", 6)
    main = PagedMainKV(pool, 2, entries=200)
    for n in range(4, 120, 4):
        for row in range(2):
            main.reserve(row, n)
        pool.unlock()
        for t in main.tables:
            assert t.cold == sum(1 for tier, _ in t.pages if tier == "host")
    assert sum(t.cold for t in main.tables) == pool.spilled > 40


def test_zero_qtensors_match_every_format_layout():
    """empty_qtensor (caches, warmup inputs) gives each format's stored layout, multi-byte scales
    (int8_t fp32, int8_w bf16) included, all bits zero."""
    from flashrt import formats
    from flashrt.kv.util import empty_qtensor

    for fmt in formats.FORMATS:
        shape = (3, 64, 128)
        q = empty_qtensor(fmt, shape, "cpu")
        data_shape, scale_shape = formats.expected_layout(fmt, shape)
        s = formats.spec(fmt)
        assert (tuple(q.data.shape), tuple(q.scale.shape)) == (tuple(data_shape), tuple(scale_shape)), fmt
        assert (q.data.dtype, q.scale.dtype) == (s.data_dtype, s.scale_dtype), fmt
        assert not q.data.view(torch.uint8).any() and not q.scale.contiguous().view(torch.uint8).any(), fmt
