"""KVState row operations a serving engine uses (take_row, release_row, rewind_rows) and exact row
snapshots (engine/snapshot.py): a moved or restored row computes bit-identical logits, released
pages go back to the pools, and a snapshot does not change when its state runs on."""
import pytest
import torch

from flashrt.engine.snapshot import restore_row, snapshot_row
from flashrt.kv.state import KVState


def prefilled(model, pool, ids):
    st = model.new_state(1, 64, pool=pool)
    model.forward(ids, state=st)
    return st


def test_take_row_moves_a_sequence_exactly_and_release_returns_pages(model, cfg, rng):
    ids = [torch.randint(0, cfg.vocab_size, (1, n), generator=rng) for n in (21, 9, 30)]
    a = prefilled(model, None, ids[0])
    pool = a.pool
    batch = KVState(cfg, 4, 16, "cpu", pool=pool)
    for row, i in ((2, 0), (0, 1), (3, 2)):
        batch.take_row(row, a if i == 0 else prefilled(model, pool, ids[i]), 0)
    assert a.row_pages(0) == 0 and a.host_positions == [0]  # the source row is left empty
    ref = KVState(cfg, 4, 16, "cpu", pool=pool)  # the same sequence alone (4 rows: CPU GEMMs of
    ref.take_row(0, prefilled(model, pool, ids[0]), 0)  # fewer rows round differently)
    tok = torch.randint(0, cfg.vocab_size, (4, 1), generator=rng)
    for _ in range(3):  # row 2 of the batch runs exactly what row 0 of the other runs
        got = model.forward(tok, state=batch)[2]
        assert torch.equal(got, model.forward(tok[[2, 0, 0, 0]], state=ref)[0])
        batch.rewind_rows([1])  # the padding row stays at position 0
        ref.rewind_rows([1, 2, 3])
        assert batch.host_positions[1] == 0 and int(batch.positions[1]) == 0
    held = pool.pages_in_use
    assert held == sum(batch.row_pages(r) + ref.row_pages(r) for r in range(4))
    for r in range(4):
        batch.release_row(r)
        ref.release_row(r)
    assert pool.pages_in_use == 0 and pool.index_pool.pages_in_use == 0


def test_snapshot_restores_exactly_and_stays_fixed(model, cfg, rng):
    ids = torch.randint(0, cfg.vocab_size, (1, 37), generator=rng)
    st = prefilled(model, None, ids)
    snap = snapshot_row(st, 0)
    frozen = {k: v.clone() for k, v in snap.tensors.items()}
    tok = torch.randint(0, cfg.vocab_size, (1, 1), generator=rng)
    want = model.forward(tok, state=st)  # the state runs on (and is then emptied)
    st.release_row(0)
    assert all(torch.equal(frozen[k], v) for k, v in snap.tensors.items())
    other = model.new_state(1, 8, pool=st.pool)
    restore_row(snap, other, 0)
    assert other.host_positions == [37]
    assert torch.equal(model.forward(tok, state=other), want)
    # through bytes (the on-disk prefix cache) too
    from flashrt.engine.snapshot import RowSnapshot

    again = model.new_state(1, 8, pool=st.pool)
    restore_row(RowSnapshot.from_bytes(snap.to_bytes(), snap.position), again, 0)
    assert torch.equal(model.forward(tok, state=again), want)


def test_snapshot_reads_both_tiers(model, cfg, rng):
    from flashrt.engine.snapshot import _main_entries
    from flashrt.kv.state import entry_bytes, fixed_bytes_for

    page = 8 * entry_bytes(cfg.head_dim, "fp4_b16")
    st = KVState(cfg, 1, 64, "cpu", kv_budget=fixed_bytes_for(cfg, 1, 64, 8) + 4 * page, page_entries=8)
    ids = torch.randint(0, cfg.vocab_size, (1, 37), generator=rng)
    for c0 in range(0, 37, 8):  # chunks: a step's new pages fit the 4 device pages
        want = model.forward(ids[:, c0:c0 + 8], state=st)
    assert st.pool.spilled > 0  # some pages live on the host tier
    for l, c in st.compressed.items():
        e = 37 // cfg.ratio(l)
        data, scale = _main_entries(c.main, 0, e)
        ref = c.main.read_row(0, e)
        assert torch.equal(data, ref.data.view(torch.uint8)) and torch.equal(scale, ref.scale.view(torch.uint8))
    snap = snapshot_row(st, 0)
    tok = torch.randint(0, cfg.vocab_size, (1, 1), generator=rng)
    other = model.new_state(1, 8)
    restore_row(snap, other, 0)
    assert torch.equal(model.forward(tok, state=other), model.forward(tok, state=st))
    assert want.shape == (1, cfg.vocab_size)


def _row_contents(st, row: int) -> list[torch.Tensor]:
    """Everything ``row`` of ``st`` carries, page contents read through its tables (page ids differ)."""
    u8, pos = torch.uint8, st.host_positions[row]
    out = [st._ring_store.data.view(u8)[:, row], st._ring_store.scale.view(u8)[:, row],
           st._ring_start_store[:, row], st.positions[row], st.engram_history[row], torch.tensor(pos)]
    for l, c in st.compressed.items():
        e = pos // st.cfg.ratio(l)
        if c.kv_state is not None:
            out += [c.kv_state[row], c.score_state[row]]
        main, index = c.main.read_row(row, e), c.index_k.read_row(row, 0, e)
        out += [main.data.view(u8), main.scale.view(u8), index.data.view(u8), index.scale.view(u8)]
    return out


def test_take_rows_equals_take_row_one_by_one(model, cfg, rng):
    """Rows moved together (one copy per tensor) land as moved one at a time: same contents, sources
    left empty, the same pages held, and the next step's logits equal."""
    n = int(torch.randint(17, 40, (), generator=rng))
    ids = torch.randint(0, cfg.vocab_size, (3, n), generator=rng)
    srcs = [model.new_state(3, 64), model.new_state(3, 64)]  # the same prompts twice, pools of their own
    for st in srcs:
        model.forward(ids, state=st)
    rows = torch.randperm(5, generator=rng)[:3].tolist()
    src_rows = torch.randperm(3, generator=rng).tolist()
    together, one_by_one = (KVState(cfg, 5, 64, "cpu", pool=st.pool) for st in srcs)
    together.take_rows(rows, srcs[0], src_rows)
    for row, src_row in zip(rows, src_rows):
        one_by_one.take_row(row, srcs[1], src_row)
    for r in range(5):
        assert together.host_positions[r] == one_by_one.host_positions[r] == (n if r in rows else 0)
        for a, b in zip(_row_contents(together, r), _row_contents(one_by_one, r)):
            assert torch.equal(a, b)
    for st in srcs:
        assert st.host_positions == [0, 0, 0] and not st.positions.any()
        assert sum(st.row_pages(r) for r in range(3)) == 0
    assert srcs[0].pool.pages_in_use == srcs[1].pool.pages_in_use > 0
    tok = torch.randint(0, cfg.vocab_size, (5, 1), generator=rng)
    assert torch.equal(model.forward(tok, state=together), model.forward(tok, state=one_by_one))


def test_take_rows_refuses_mismatched_rows(cfg):
    pool = KVState.pool_for(cfg, 4, 16, "cpu", None)
    a, b = KVState(cfg, 3, 16, "cpu", pool=pool), KVState(cfg, 3, 16, "cpu", pool=pool)
    for rows, src_rows in (([0, 1], [0]), ([0, 0], [1, 2]), ([0, 1], [2, 2])):
        with pytest.raises(ValueError, match="rows, src_rows: expected two lists of distinct rows"):
            a.take_rows(rows, b, src_rows)
    with pytest.raises(ValueError, match="same page pool"):
        a.take_rows([0], KVState(cfg, 1, 16, "cpu"), [0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_row_moves_do_not_wait_for_the_device(cfg, rng):
    """take_rows, reset and rewind of many rows queue their copies and fills behind a long kernel
    instead of waiting for it (a serving step joins prefilled rows while their prefill still runs)."""
    import time

    dev = torch.device("cuda")
    a = KVState(cfg, 8, 64, dev)
    b = KVState(cfg, 8, 64, dev, pool=a.pool)
    rows = sorted(torch.randperm(8, generator=rng)[:int(torch.randint(2, 8, (), generator=rng))].tolist())
    moves = {"take_rows": lambda: a.take_rows(rows, b, rows), "rewind_rows": lambda: a.rewind_rows(rows),
             "release_row": lambda: a.release_row(rows[0])}
    for name, move in moves.items():
        move()  # warm: the pinned staging blocks exist
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        end.record()
        t0 = time.perf_counter()
        move()
        host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        assert host_ms < 0.25 * start.elapsed_time(end), (name, host_ms, start.elapsed_time(end))


def test_row_moves_make_no_host_sync(cfg, rng):
    """take_rows, rewind_rows, reset and release of many rows make none of the host syncs a GPU run
    would wait on (tools/host_syncs.py: value reads, host data copied up, a number put by a tensor
    index); the GPU test above times the same on a device."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from host_syncs import HostSyncs

    a = KVState(cfg, 8, 64, torch.device("cpu"))
    b = KVState(cfg, 8, 64, torch.device("cpu"), pool=a.pool)
    rows = sorted(torch.randperm(8, generator=rng)[:int(torch.randint(2, 8, (), generator=rng))].tolist())
    with HostSyncs() as syncs:
        a.take_rows(rows, b, rows)
        a.rewind_rows(rows)
        a.reset_row(rows[0])
        a.release_row(rows[-1])
    assert syncs.total == 0, syncs.sites
