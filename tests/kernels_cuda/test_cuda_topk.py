"""CUDA kernels of topk.py (``topk_positions``) against the reference: exact equality (a selection).

Tiny rows in the interpreter; the summary / list / streaming paths of the threshold select are
forced with small ``TILES`` and checked through ``select_rows(stats=...)``. Realistic rows
(T = 128K and 1M, k = 512) run on a CUDA device only (``pytest -m gpu``).
"""
import math

import pytest
import torch

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kernel_check import DEVICE, GPU, requires_kernels, run_both  # noqa: E402
from test_topk import tied_scores  # noqa: E402

import flashrt  # noqa: E402
from flashrt import ops, profiles  # noqa: E402
from flashrt.kernels_cuda import splitk, topk, topk_split_kernel  # noqa: E402

pytestmark = requires_kernels


def _scores(kind, B, S, T, g):
    if kind == "tied":  # integers in [-5, 5] (-0.0 too) with NaN / +-inf sprinkled
        return tied_scores(B, S, T, g)
    if kind == "sparse":  # mostly non-finite: rows with fewer finite scores than k
        return tied_scores(B, S, T, g, p_special=0.8)
    if kind == "sorted":  # ascending with runs of equal values: the worst case for chunk maxima
        return torch.arange(T).div(3, rounding_mode="floor").float().expand(B, S, T).contiguous()
    return torch.randn(B, S, T, generator=g)


def _same(scores, k, cand=None):
    got, want = run_both("topk_positions", scores.to(DEVICE), k, None if cand is None else cand.to(DEVICE))
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(got.cpu(), want.cpu())


CASES = [(1, 1, 1, 1), (1, 1, 1, 4), (2, 3, 5, 2), (3, 2, 37, 8), (2, 2, 37, 37), (1, 2, 37, 50),
         (2, 1, 64, 16), (1, 2, 300, 20)]


@pytest.mark.parametrize("B,S,T,k", CASES)
@pytest.mark.parametrize("kind", ["tied", "smooth", "sparse"])
def test_topk_matches_reference(B, S, T, k, kind, rng):
    scores = _scores(kind, B, S, T, rng)
    cand = torch.rand(B, S, T, generator=rng) < 0.6 if (T + k) % 2 else None
    _same(scores, k, cand)


def test_topk_ties_signed_zero_and_non_finite():
    nan, inf = math.nan, math.inf
    scores = torch.tensor([[[1.0, 3.0, 3.0, 2.0, 3.0, 3.0, nan],
                            [0.0, -0.0, 0.0, -0.0, -1.0, 5.0, -inf],
                            [7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0],
                            [nan, inf, -inf, 1.0, nan, -5.0, inf],
                            [3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, -0.0, inf]]])
    for k in (1, 2, 3, 5, 7, 9):
        _same(scores, k)
    cand = torch.tensor([[[True, False, True, True, True, True, True]] * 5])
    _same(scores, 2, cand)
    _same(scores, 4, torch.zeros_like(cand))  # no candidate at all: all -1


def test_topk_empty_rows():
    with flashrt.use_backend("cuda"):
        assert ops.topk_positions(torch.zeros(2, 3, 0, device=DEVICE), 4).shape == (2, 3, 0)
        out = ops.topk_positions(torch.zeros(2, 0, 5, device=DEVICE), 4)
    assert out.shape == (2, 0, 4) and out.dtype == torch.int32


def test_topk_strided_scores(rng):
    scores = tied_scores(3, 4, 40, rng).transpose(0, 1)  # rows are not in memory order
    _same(scores, 6, (torch.rand(4, 3, 40, generator=rng) < 0.7))
    _same(tied_scores(2, 3, 80, rng)[..., ::2], 5)  # positions with a stride


# ---------------------------------------------------------------------------------------------
# the paths of the threshold select, forced with small tiles


def _force(monkeypatch, **select):
    # registers 1 unless given: the short test rows take the summary and list paths under test
    monkeypatch.setitem(topk.TILES, "select", {**topk.TILES["select"], "registers": 1, **select})
    monkeypatch.setitem(topk.TILES, "chunk_max", {**topk.TILES["chunk_max"], "block": 64})
    profiles._TILES_CACHE.clear()  # merged tiles are cached per TILES dict, which stays the same object


def _select(scores, k, cand=None):
    """The list lengths (``stats``) of select_rows on [R, T] scores, its positions checked equal to
    the reference's."""
    R, T = scores.shape
    out = torch.empty(R, min(k, T), dtype=torch.int32, device=DEVICE)
    stats = torch.empty(R, dtype=torch.int32, device=DEVICE)
    cand_u8 = None if cand is None else cand.to(DEVICE).view(torch.uint8)
    topk.select_rows(scores.to(DEVICE), cand_u8, k, out, stats=stats)
    with flashrt.use_backend("reference"):
        want = ops.topk_positions(scores[None], k, None if cand is None else cand[None])[0]
    assert torch.equal(out.cpu(), want)
    return stats.cpu()


def _same_marks(scores, k, cand):
    """select_rows(mark=True) on [R, T] scores marks exactly the reference's picks."""
    R, T = scores.shape
    marks = torch.zeros(R, T, dtype=torch.uint8, device=DEVICE)
    topk.select_rows(scores.to(DEVICE), cand.to(DEVICE).view(torch.uint8), k, marks, mark=True)
    with flashrt.use_backend("reference"):
        want = ops.topk_positions(scores[None], k, cand[None])[0]
    expect = torch.zeros(R, T + 1, dtype=torch.uint8)
    expect.scatter_(1, torch.where(want < 0, T, want).long(), 1)
    assert torch.equal(marks.cpu(), expect[:, :T])


@pytest.mark.parametrize("kind", ["tied", "smooth", "sparse", "sorted"])
@pytest.mark.parametrize("fine", [4, 64])
def test_topk_chunk_summary_path(kind, fine, monkeypatch, rng):
    """T / C <= 16: chunks of 32 positions summarised by their max (fine=4: scanned as 8 fine
    chunks of 4, a two-level summary; fine=64: one level)."""
    _force(monkeypatch, summary=16, fine=fine, small=16, list=512)
    scores = _scores(kind, 1, 3, 300, rng)[0]
    stats = _select(scores, 9, torch.rand(3, 300, generator=rng) < 0.8 if kind == "tied" else None)
    assert (stats <= 512).all()


@pytest.mark.parametrize("kind", ["tied", "smooth", "sparse", "sorted"])
def test_topk_list_loops_in_one_step(kind, monkeypatch, rng):
    """A ``group`` wider than every selected chunk's elements: the chunk-id, list and streaming
    loops each take one masked step (the wide steps of tiles.topk.select.group); same picks."""
    _force(monkeypatch, summary=16, fine=4, small=16, list=512, group=2048)
    scores = _scores(kind, 1, 3, 700, rng)[0]
    _select(scores, 11, torch.rand(3, 700, generator=rng) < 0.8 if kind == "tied" else None)


@pytest.mark.parametrize("kind", ["tied", "smooth", "sorted"])
def test_topk_streamed_chunks(kind, monkeypatch, rng):
    """Lists longer than TILES list: the selected chunks are streamed (same picks)."""
    _force(monkeypatch, summary=8, small=8, list=16, group=32)
    scores = _scores(kind, 1, 2, 160, rng)[0]
    stats = _select(scores, 12)
    assert (stats > 16).any(), stats


def test_topk_streamed_list(monkeypatch, rng):
    """Lists longer than the register block (max(TILES small, 2k) = 8 here) but within TILES list:
    the stored list is streamed."""
    _force(monkeypatch, summary=16, small=4, list=512, group=32)
    scores = torch.cat([_scores("tied", 1, 1, 200, rng)[0], _scores("sorted", 1, 1, 200, rng)[0]])
    stats = _select(scores, 4, torch.rand(2, 200, generator=rng) < 0.9)
    assert ((stats > 8) & (stats <= 512)).any(), stats


@pytest.mark.parametrize("kind", ["tied", "sparse", "smooth"])
@pytest.mark.parametrize("k", [100, 128])
def test_topk_rows_of_at_most_k_entries_take_every_valid_entry(kind, k, monkeypatch, rng):
    """T <= k: one pass over the row (several GROUP steps here), no search (stats -1); positions
    and marks as the reference's picks."""
    _force(monkeypatch, group=32)
    scores = _scores(kind, 1, 3, 100, rng)[0]
    cand = torch.rand(3, 100, generator=rng) < 0.7
    for c in (None, cand):
        assert (_select(scores, k, c) == -1).all()
    _same_marks(scores, k, cand)


@pytest.mark.parametrize("held", ["summary", "registers"])
@pytest.mark.parametrize("radix", [1, 8])
@pytest.mark.parametrize("kind", ["tied", "smooth", "sparse", "sorted"])
def test_topk_rows_the_summary_holds_pick_from_registers(kind, radix, held, monkeypatch, rng):
    """k < T <= 64 entries, held whole by TILES summary or by TILES registers over a shorter
    summary: the keys are their own summary, one exact search, no list (stats -2); positions and
    marks as the reference's picks, with and without candidates. A row one entry longer, or
    partial bits, takes the list path."""
    if held == "summary":
        _force(monkeypatch, summary=64, min_summary=64, radix_bits=radix, registers=16)
    else:
        _force(monkeypatch, summary=16, min_summary=16, radix_bits=radix, registers=64)
    T = int(torch.randint(10, 65, (1,), generator=rng))
    scores = _scores(kind, 1, 3, T, rng)[0]
    cand = torch.rand(3, T, generator=rng) < 0.7
    k = int(torch.randint(1, T, (1,), generator=rng))
    for c in (None, cand):
        assert (_select(scores, k, c) == -2).all()
    _same_marks(scores, k, cand)
    assert (_select(_scores(kind, 1, 2, 65, rng)[0], 9) >= 0).all()  # 65 entries: chunks of 2 (or 8)
    _force(monkeypatch, bits=16)
    assert (_select(scores, k) >= 0).all()


def test_topk_partial_bits_lower_bound(monkeypatch, rng):
    """Only the top bits of L exact: a lower L, longer lists, the same picks."""
    _force(monkeypatch, summary=16, bits=9, small=64, list=512)
    _select(torch.randn(2, 200, generator=rng) * 1e-3 + 5.0, 7)


@pytest.mark.parametrize("radix", [2, 4, 8])
@pytest.mark.parametrize("kind", ["tied", "smooth", "sparse", "sorted"])
def test_topk_radix_search(radix, kind, monkeypatch, rng):
    """radix_bits 2 / 4 / 8: several bits of each k-th-largest search per pass (the chunk-summary L
    and the register-list threshold; at 8 a histogram of the digit); the same picks as the
    reference, with and without candidates."""
    _force(monkeypatch, summary=16, fine=4, small=64, list=512, radix_bits=radix)
    scores = _scores(kind, 1, 3, 300, rng)[0]
    _select(scores, 9, torch.rand(3, 300, generator=rng) < 0.8)
    _select(scores, 1)


@pytest.mark.parametrize("radix", [2, 4, 8])
def test_topk_radix_search_partial_bits(radix, monkeypatch, rng):
    """Only the top 8 bits of L exact, found 2 / 4 / 8 bits a pass: the same picks."""
    _force(monkeypatch, summary=16, bits=8, small=64, list=512, radix_bits=radix)
    _select(torch.randn(2, 200, generator=rng) * 1e-3 + 5.0, 7)


@pytest.mark.parametrize("skip", [0, 2])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("reversed_", [False, True])
@pytest.mark.parametrize("kind", ["tied", "smooth", "sparse", "sorted"])
def test_topk_split_rows(kind, reversed_, fused, skip, monkeypatch, rng):
    """Rows split over scanning programs (split_rows): each slice's candidates listed in blocks,
    the picks ranked back into position order from the blocks' offsets (the blocks in slice order
    and, reversed, last slice first); positions and marks as the reference's, with and without
    candidates; L and the picks by their own launches or by the rows' last programs (fused); the
    slices read whole or (skip 2) only their chunks above L where at most 2 of their 4 are.
    Every list fits the register block (at most T < 512 = small entries), so every row takes the
    split pick (stats: the list's length, not -3)."""
    _force(monkeypatch, summary=16, small=512, list=512, split_rows=4, split_slice=32, split_slices=8,
           split_fused=fused, split_skip=skip)
    monkeypatch.setattr(topk, "_SCAN_REVERSED", reversed_)
    T = int(torch.randint(257, 400, (1,), generator=rng))  # 5-7 slices of 64 (8 at most a row: 32 doubles)
    scores = _scores(kind, 1, 3, T, rng)[0]
    cand = torch.rand(3, T, generator=rng) < 0.7
    k = int(torch.randint(9, 40, (1,), generator=rng))  # the list capacity (k - 1) * 32 + k rounds up to 512
    for c in (None, cand):
        assert (_select(scores, k, c) >= 0).all()
    _same_marks(scores, k, cand)
    assert not splitk.counters(torch.device(DEVICE)).any()  # the last programs put their tickets back


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["tied", "sorted"])
def test_topk_split_long_list_takes_one_program_path(kind, fused, monkeypatch, rng):
    """A split row whose list passes ``small`` (many ties, or rows that defeat the chunk maxima) is
    selected by the one-program path from the summary; the same picks."""
    _force(monkeypatch, summary=16, small=16, list=512, split_rows=4, split_slice=32, split_slices=4,
           split_fused=fused)
    monkeypatch.setattr(topk, "_SCAN_REVERSED", True)
    scores = _scores(kind, 1, 2, 300, rng)[0]
    assert (_select(scores, 12, torch.rand(2, 300, generator=rng) < 0.9) == -3).all()


def test_topk_split_lists_at_most_k_ties_a_slice(monkeypatch, rng):
    """Rows of 0s and 1s (hundreds of ties at L): each slice lists its keys above L and only its
    first k ties, so the list's length is count(key > L) + the sum over slices of min(k, ties),
    with L the k-th largest max of the 32-entry chunks (computed here); the picks as the reference's."""
    _force(monkeypatch, summary=16, small=512, list=512, split_rows=4, split_slice=64, split_slices=8)
    monkeypatch.setattr(topk, "_SCAN_REVERSED", True)
    T, k = 300, 9
    scores = (torch.rand(2, T, generator=rng) < 0.5).float()
    stats = _select(scores, k)
    chunk_max = torch.nn.functional.pad(scores, (0, 320 - T), value=-1.0).view(2, 10, 32).amax(-1)
    L = chunk_max.topk(k, -1).values[:, -1:]
    ties = torch.nn.functional.pad(scores == L, (0, 320 - T)).view(2, 5, 64).sum(-1)
    assert torch.equal(stats.long(), (scores > L).sum(-1) + ties.clamp(max=k).sum(-1)), (stats, L)


@pytest.mark.parametrize("fine", [16, 64])
@pytest.mark.parametrize("kind", ["tied", "smooth", "sparse", "sorted"])
def test_topk_split_skip_lists_what_the_whole_slice_lists(kind, fine, monkeypatch, rng):
    """A slice read only through its chunks above L (split_skip) lists the same block as the whole
    slice read: the same list lengths row by row, the same picks; with a cap of 1 chunk, slices
    with more chunks above L read themselves whole. Chunks of 16 under a two-level summary (fine
    16), or the summary's own chunks of 32 (fine 64: one level)."""
    scores = _scores(kind, 1, 3, 300, rng)[0]
    cand = torch.rand(3, 300, generator=rng) < 0.8
    lengths = {}
    for skip in (0, 1, 4):
        _force(monkeypatch, summary=16, fine=fine, small=512, list=512, split_rows=4, split_slice=64, split_slices=8,
               split_skip=skip)
        lengths[skip] = [_select(scores, 9, c) for c in (None, cand)]
    for skip in (1, 4):
        assert all(torch.equal(a, b) for a, b in zip(lengths[skip], lengths[0])), (lengths, skip)


@pytest.mark.parametrize("radix", [1, 8])
def test_topk_split_partial_bits(radix, monkeypatch, rng):
    """Split rows with only the top bits of L exact (a lower L, longer slice lists; the pick's
    search is exact), L found 1 or 8 bits a pass: the same picks."""
    _force(monkeypatch, summary=16, bits=8, small=512, list=512, split_rows=4, split_slice=32, split_slices=8,
           radix_bits=radix)
    monkeypatch.setattr(topk, "_SCAN_REVERSED", True)
    assert (_select(torch.randn(2, 300, generator=rng) * 1e-3 + 5.0, 9) >= 0).all()


@pytest.mark.parametrize("pick_radix", [2, 8])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["tied", "smooth", "sorted"])
def test_topk_split_pick_radix(kind, fused, pick_radix, monkeypatch, rng):
    """split_pick_radix: a split row's pick searches its list 2 or 8 bits a pass while L is found one bit
    a pass: positions and marks as the reference's, with and without candidates; and the same for rows
    whose lists pass small (the one-program path, at the pick's radix too)."""
    _force(monkeypatch, summary=16, small=512, list=512, split_rows=4, split_slice=32, split_slices=8,
           split_fused=fused, radix_bits=1, split_pick_radix=pick_radix)
    radix = []  # the RADIX each pick launch takes
    name = "_scan_pick_kernel" if fused else "_split_pick_kernel"
    kernel = getattr(topk, name)

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: (radix.append(kw["RADIX"]), kernel[grid](*a, **kw))[1]

    monkeypatch.setattr(topk, name, Spy())
    scores = _scores(kind, 1, 3, 300, rng)[0]
    cand = torch.rand(3, 300, generator=rng) < 0.7
    k = int(torch.randint(9, 40, (1,), generator=rng))
    for c in (None, cand):
        assert (_select(scores, k, c) >= 0).all()
    _same_marks(scores, k, cand)
    assert radix and set(radix) == {pick_radix}
    _force(monkeypatch, summary=16, small=16, list=512, split_rows=4, split_slice=32, split_slices=4,
           split_fused=fused, radix_bits=1, split_pick_radix=pick_radix)
    stats = _select(scores, 12, cand)  # its positions checked against the reference's either way
    if kind != "smooth":  # hundreds of ties or a sorted row: lists far past 16 entries
        assert (stats == -3).all()


def test_topk_split_bits_apply_to_split_rows_only(monkeypatch, rng):
    """split_bits: only the top bits of a split row's L exact (a lower L, a longer list of the slices'
    candidates, the same picks); the rows of a launch that is not split keep bits."""
    scores = torch.randn(2, 300, generator=rng) * 1e-3 + 5.0  # close keys: 8 top bits leave L far lower
    lengths = {}
    for split_bits in (0, 8):
        _force(monkeypatch, summary=16, small=512, list=512, split_rows=1, split_slice=32, split_slices=8,
               split_bits=split_bits)
        lengths[split_bits] = (_select(scores[:1], 9), _select(scores, 9))  # one row split, two rows not
    assert (lengths[8][0] > lengths[0][0]).all() and (lengths[0][0] >= 9).all(), lengths
    assert torch.equal(lengths[8][1], lengths[0][1]), lengths


def test_topk_split_only_below_split_rows(monkeypatch, rng):
    """The split applies to launches of at most split_rows rows longer than registers."""
    _force(monkeypatch, summary=16, small=128, list=512, split_rows=2, split_slice=32, split_slices=8)
    launched = []
    real = topk._select_split
    monkeypatch.setattr(topk, "_select_split", lambda *a, **kw: launched.append(a[0].shape[0]) or real(*a, **kw))
    for rows in (1, 2, 3):
        _select(_scores("smooth", 1, rows, 300, rng)[0], 9)
    _select(_scores("smooth", 1, 1, 16, rng)[0], 9)  # held by the summary: no split
    assert launched == [1, 2]


def test_topk_split_only_up_to_split_programs(monkeypatch, rng):
    """With split_programs, a launch splits only while its rows times slices a row are at most that
    many (the picks checked against the reference's either way)."""
    _force(monkeypatch, summary=16, small=128, list=512, split_rows=8, split_slice=32, split_slices=8,
           split_programs=16)
    launched = []
    real = topk._select_split
    monkeypatch.setattr(topk, "_select_split", lambda *a, **kw: launched.append(a[0].shape) or real(*a, **kw))
    for rows, T in ((1, 256), (2, 256), (3, 256), (4, 100), (5, 100)):  # 8 slices a row of 256, 4 of 100
        _select(_scores("smooth", 1, rows, T, rng)[0], 9)
    assert launched == [(1, 256), (2, 256), (4, 100)]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("reversed_", [False, True])
def test_topk_split_min_programs_gives_programs_several_slices(fused, reversed_, monkeypatch, rng):
    """With split_min_programs, a launch over split_programs scanning programs gives each program several
    consecutive slices (a power of two, the last program's may run past the row) so that it fits, while a row
    keeps at least that many programs; past that it is not split. The picks as the reference's each time (the
    blocks of one program's slices reserved in turn, or last first), with candidates and as marks."""
    _force(monkeypatch, summary=16, small=512, list=512, split_rows=8, split_slice=32, split_slices=8,
           split_programs=16, split_min_programs=4, split_fused=fused)
    monkeypatch.setattr(topk, "_SCAN_REVERSED", reversed_)
    launched = []
    real = topk._select_split
    monkeypatch.setattr(topk, "_select_split",
                        lambda *a, **kw: launched.append((a[0].shape[0], a[-1])) or real(*a, **kw))
    # rows of 8 slices of 32: 1-2 rows one slice a program; 3-4 rows 2 slices (4 programs a row); 5 rows not split;
    # 4 rows of 7 slices (T = 200): 4 programs a row, the last one's second slice past the row
    for rows, T in ((1, 256), (2, 256), (3, 256), (4, 256), (5, 256), (4, 200)):
        scores = _scores("smooth", 1, rows, T, rng)[0]
        cand = torch.rand(rows, T, generator=rng) < 0.8
        assert (_select(scores, 9, cand) >= 0).all()
        _same_marks(scores, 9, cand)
    seen = sorted(set(launched))
    assert seen == [(1, (32, 8, 1)), (2, (32, 8, 1)), (3, (32, 8, 2)), (4, (32, 7, 2)), (4, (32, 8, 2))], seen
    assert not splitk.counters(torch.device(DEVICE)).any()


def test_topk_decline_and_dispatch(monkeypatch, rng):
    assert topk.FAMILY.serves("topk_positions", torch.empty(1, 1, 2**30, device="meta"), 4, None) is not None
    assert topk.FAMILY.serves("topk_positions", torch.empty(1, 1, 9), 4, None) is None
    calls = []
    real = topk.select_rows
    monkeypatch.setattr(topk, "select_rows", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    with flashrt.use_backend("cuda"):
        ops.topk_positions(torch.randn(1, 2, 9, device=DEVICE), 4)
    assert calls == [4]


# ---------------------------------------------------------------------------------------------
# realistic rows (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("rows,T", [(1, 131072), (8, 131072), (64, 131072), (2048, 8192), (4, 1 << 20)])
@pytest.mark.parametrize("kind", ["smooth", "tied", "masked"])
def test_topk_realistic(rows, T, kind, rng):
    scores = torch.randn(rows, 1, T, generator=rng)
    cand = None
    if kind == "tied":  # few distinct values: long runs of ties at the threshold
        scores = scores.mul(4).round()
    if kind == "masked":  # a causal-like visible prefix and a candidate mask
        vis = torch.randint(1, T + 1, (rows, 1, 1), generator=rng)
        scores = scores.masked_fill(torch.arange(T) >= vis, -math.inf)
        cand = torch.rand(rows, 1, T, generator=rng) < 0.5
    _same(scores, 512, cand)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("radix", [2, 4, 8])
@pytest.mark.parametrize("rows,T", [(1, 131072), (64, 131072)])
def test_topk_realistic_radix(radix, rows, T, monkeypatch, rng):
    monkeypatch.setitem(topk.TILES, "select", {**topk.TILES["select"], "radix_bits": radix})
    _same(torch.randn(rows, 1, T, generator=rng), 512, None)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["sorted", "constant", "two_levels"])
def test_topk_adversarial_rows(kind):
    """Rows that defeat the chunk summary (long lists, the streaming path) stay exact."""
    T = 131072
    pos = torch.arange(T, dtype=torch.float32)
    row = {"sorted": pos.div(64, rounding_mode="floor"), "constant": torch.zeros(T),
           "two_levels": (pos % 17 == 0).float()}[kind]
    _same(row.expand(3, 1, T).contiguous(), 512)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("rows,T", [(1, 131072), (8, 131072), (64, 131072), (4, 1 << 20)])
@pytest.mark.parametrize("kind", ["smooth", "tied", "masked", "sorted", "constant"])
@pytest.mark.parametrize("fused,skip", [(True, 0), (False, 0), (True, 32)])
def test_topk_realistic_split(fused, skip, kind, rows, T, monkeypatch, rng):
    """Rows split over scanning programs on the device, where the slices reserve their blocks of the
    list in whatever order they run: the reference's picks, also for rows whose list passes the
    register block (tied, sorted, constant: the one-program path); fused, the rows' last programs
    (L, the picks) read what the others wrote, and put their tickets back; skip, the slices read
    through their chunks above L."""
    monkeypatch.setitem(topk.TILES, "select", {**topk.TILES["select"], "split_rows": 64, "split_fused": fused,
                                               "split_skip": skip})
    profiles._TILES_CACHE.clear()
    scores, cand = torch.randn(rows, 1, T, generator=rng), None
    pos = torch.arange(T, dtype=torch.float32)
    if kind == "tied":
        scores = scores.mul(4).round()
    elif kind == "masked":
        vis = torch.randint(1, T + 1, (rows, 1, 1), generator=rng)
        scores = scores.masked_fill(torch.arange(T) >= vis, -math.inf)
        cand = torch.rand(rows, 1, T, generator=rng) < 0.5
    elif kind == "sorted":
        scores = pos.div(64, rounding_mode="floor").expand(rows, 1, T).contiguous()
    elif kind == "constant":
        scores = torch.zeros(rows, 1, T)
    _same(scores, 512, cand)
    assert not splitk.counters(torch.device(DEVICE)).any()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("reversed_", [False, True])
@pytest.mark.parametrize("kind", ["tied", "smooth", "sorted"])
def test_topk_split_span_scans_a_programs_slices_at_once(kind, reversed_, fused, monkeypatch, rng):
    """A program of several slices whose slices each have at most split_skip chunks above L reads them in one
    gather and reserves their blocks at once (or a group at a time, _SPAN_CHUNKS 4: 2 slices of 2 chunks): the
    same list, row by row, as the slices scanned one after another (_SPAN_CHUNKS 0), ties clamped to k a slice
    (tied rows), slices with more chunks above L sending the group back to its slices in turn (sorted rows);
    the picks as the reference's, as positions and as marks."""
    _force(monkeypatch, summary=16, small=512, list=512, split_rows=8, split_slice=32, split_slices=8,
           split_programs=8, split_min_programs=2, split_skip=2, split_fused=fused)
    monkeypatch.setattr(topk, "_SCAN_REVERSED", reversed_)
    launched = []
    real = topk._select_split
    monkeypatch.setattr(topk, "_select_split",
                        lambda *a, **kw: launched.append(a[-1]) or real(*a, **kw))
    T = int(torch.randint(200, 257, (1,), generator=rng))  # 7-8 slices of 32
    rows = int(torch.randint(3, 5, (1,), generator=rng))  # 4 slices a program
    scores = _scores(kind, 1, rows, T, rng)[0]
    cand = torch.rand(rows, T, generator=rng) < 0.8
    k = int(torch.randint(3, 12, (1,), generator=rng))
    lengths = {}
    for chunks in (2048, 4, 0):  # the span at once, in groups of 2 slices (2 chunks each), each in turn
        monkeypatch.setattr(topk_split_kernel, "_SPAN_CHUNKS", tl.constexpr(chunks))
        lengths[chunks] = [_select(scores, k, c) for c in (None, cand)]
        _same_marks(scores, k, cand)
    for chunks in (2048, 4):
        assert all(torch.equal(a, b) for a, b in zip(lengths[chunks], lengths[0])), (chunks, lengths)
    assert {s[2] for s in launched} == {8 // (8 // rows)}, launched  # several slices a program
    assert not splitk.counters(torch.device(DEVICE)).any()
