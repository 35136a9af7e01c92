"""``store_paged_many`` (kernels_cuda/kv_store.py): several paged stores at the same entries, two a
launch, against the reference and against the separate ``store_paged`` calls it replaces, on fresh
random pools of different formats, page sizes and block tables (masked pairs, pages with no pool
page); its argument checks name the store."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import DEVICE, assert_error, launches, requires_kernels  # noqa: F401 (launches: a fixture)
from test_cuda_kv_store import _by_hand, _bytes, _case, _copy

pytestmark = requires_kernels


def _store_for(rng, entry, W, P, fmt, D, P2):
    """A second pool (``fmt``, ``D``, pages of ``P2``) whose block table covers the same entries."""
    B = entry.shape[0]
    W2 = -(-(W * P) // P2)
    pages = B * W2 + 2
    pool = formats.quantize(torch.randn(1, pages * P2, D, generator=rng), fmt).to(DEVICE)
    table = (torch.randperm(pages - 1, generator=rng)[:B * W2] + 1).view(B, W2)
    table[torch.rand(B, W2, generator=rng) < 0.2] = -1
    values = formats.quantize(torch.randn(B, entry.shape[1], D, generator=rng), fmt).to(DEVICE)
    return pool, table.to(DEVICE), values, P2, 0


def _stores(rng, B, n, count):
    pool, table, entry, mask, values, P = _case(rng, "fp4_b16", B, n, 64, 4, pages=2 * B * (-(-(n + 3) // 4)) + 3,
                                                table_dtype=torch.int64)
    more = [_store_for(rng, entry, table.shape[1], P, fmt, D, P2)
            for fmt, D, P2 in (("fp4_b32", 32, 8), ("fp8", 96, 3))[:count - 1]]
    return ((pool, table, values, P, 0), *more), entry, mask


def _copies(stores):
    return tuple((_copy(s[0]), *s[1:]) for s in stores)


@pytest.mark.parametrize("B,n,count", [(1, 1, 2), (3, 5, 2), (4, 2, 3), (2, 3, 1)])
def test_many_stores_equal_the_separate_stores_and_the_reference(rng, launches, B, n, count):
    stores, entry, mask = _stores(rng, B, n, count)
    got, want, apart = _copies(stores), _copies(stores), _copies(stores)
    with flashrt.use_backend("cuda"):
        out = ops.store_paged_many(got, entry, mask)
        assert all(o is s[0] for o, s in zip(out, got))
    expect = ["_store_paged_two_kernel"] * (count // 2) + ["_store_paged_kernel"] * (count % 2)
    assert launches == expect
    with flashrt.use_backend("reference"):
        ops.store_paged_many(want, entry, mask)
    with flashrt.use_backend("cuda"):
        for pool, table, values, P, trash in apart:
            ops.store_paged(pool, table, entry, mask, values, P, trash)
    for g, w, a, (pool, table, values, P, _) in zip(got, want, apart, stores):
        hand = _by_hand(pool, table, entry, mask, values, P)  # pair by pair in Python
        for k, part in enumerate(("data", "scale")):
            gb, wb, ab = (_bytes(getattr(s[0], part))[1:] for s in (g, w, a))  # row 0: the trash row
            assert torch.equal(gb, hand[k][1:]) and torch.equal(wb, gb) and torch.equal(ab, gb), part


def test_bad_stores_are_named(rng):
    stores, entry, mask = _stores(rng, 2, 3, 2)
    assert_error(lambda: ops.store_paged_many((), entry, mask), "stores", "non-empty")
    assert_error(lambda: ops.store_paged_many((stores[0][:4],), entry, mask), "stores[0]", "trash_row")
    bad = (stores[0], (stores[1][0], stores[1][1].float(), *stores[1][2:]))
    assert_error(lambda: ops.store_paged_many(bad, entry, mask), "stores[1].table", "int32")
    bad = (stores[0], (*stores[1][:3], 7, 0))
    assert_error(lambda: ops.store_paged_many(bad, entry, mask), "stores[1].page_entries", "divisor")
    assert_error(lambda: ops.store_paged_many(stores, entry, mask.int()), "mask", "bool")
