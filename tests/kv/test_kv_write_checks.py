"""The KV cache writes (``flashrt.kv.util.write_rows`` / ``write_paged``) read no index values,
whatever value-check setting their caller runs under: their slots, entries and block tables are the
state's own, and a range check would read them back (a host sync per write on a GPU). A read is
seen by patching ``checks.value_range``, which every index-range check goes through."""
import traceback

import pytest
import torch

from flashrt import checks, formats, ops
from flashrt.engine.snapshot import restore_row, snapshot_row
from flashrt.kv.util import empty_qtensor, write_rows

STORES = ("store_rows", "store_paged")


@pytest.fixture
def reads(monkeypatch):
    """One entry per index-value read: the store op it came from, or None for any other check."""
    seen, real = [], checks.value_range

    def spy(t):
        names = {f.name for f in traceback.extract_stack()}
        seen.append(next((n for n in STORES if n in names), None))
        return real(t)
    monkeypatch.setattr(checks, "value_range", spy)
    return seen


def test_write_rows_stores_the_bytes_without_reading_its_slots(reads, rng):
    B, S, n, D = 3, 8, 5, 64
    flat = torch.randperm(B * S, generator=rng)[:n]  # distinct (row, slot) pairs
    batch, slot = flat // S, flat % S
    src = formats.quantize(torch.randn(n, D, generator=rng), "fp8")
    dst = empty_qtensor("fp8", (B, S, D), "cpu")
    assert checks.values_checked()
    write_rows(dst, batch, slot, src)
    assert reads == [] and checks.values_checked()  # no read, and the caller's setting is back
    u8 = torch.uint8
    assert torch.equal(dst.data.view(u8)[batch, slot], src.data.view(u8))
    assert torch.equal(dst.scale.view(u8)[batch, slot], src.scale.view(u8))
    untouched = torch.ones(B * S, dtype=torch.bool)
    untouched[flat] = False
    assert not dst.data.view(u8).reshape(B * S, -1)[untouched].any()
    ops.store_rows(dst, batch, slot, src)  # the op itself, called with checks on, does read them
    assert reads == ["store_rows", "store_rows"]


def test_a_model_s_prefill_decode_and_restore_read_no_store_index(reads, model, cfg, rng):
    """The chunk's ring writes at its commit and a restored row's writes run with value checks on
    (after ``Model.forward``'s checked-off block, and from the snapshot code): still no store reads."""
    ids = torch.randint(0, cfg.vocab_size, (1, 2 * cfg.window_size + 5), generator=rng)
    st = model.new_state(1, 64)
    model.forward(ids, state=st)
    tok = torch.randint(0, cfg.vocab_size, (1, 1), generator=rng)
    for _ in range(3):
        model.forward(tok, state=st)
    other = model.new_state(1, 64, pool=st.pool)
    restore_row(snapshot_row(st, 0), other, 0)
    assert torch.equal(model.forward(tok, state=other), model.forward(tok, state=st))
    assert None in reads  # the spy is live: forward checks the ids it is given
    assert [r for r in reads if r is not None] == [] and checks.values_checked()
