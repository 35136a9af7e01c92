"""``topk_positions`` as a threshold select (no sort), and the row-select driver ``select_rows``
that ``candidate_blocks`` reuses.

Scores become int32 keys whose signed order is the float order (``-0.0`` as ``+0.0``; NaN, +-inf
and non-candidates -> ``INT32_MIN``, below every finite key). Per row:

1. ``_chunk_max_kernel`` (many programs per row, one read of the row): the max key of every chunk
   of ``C`` positions, ``C`` = the smallest power of two with ``T / C <= TILES summary``. With
   ``C == 1`` this pass is skipped and the keys themselves are the summary (also for rows of up
   to ``TILES registers`` entries, whatever ``summary``).
2. ``_select_kernel`` (one program per row). A row of at most ``k`` entries takes every valid
   one, in position order, in one pass. A row the summary holds key by key (``C == 1``; with
   ``TILES bits`` 32) has its exact k-th largest key found in registers and its picks written
   from there: one search, no list. Longer rows:
   a. ``L`` = the k-th largest chunk max, by a bitwise binary search (``count(key >= t) >= k``)
      over the summary held in registers. ``k`` chunk maxima are ``k`` distinct elements, so
      ``L`` <= the k-th largest key (``INT32_MIN`` when fewer than ``k`` chunks hold a key).
   b. the ids of the chunks whose max is ``>= L`` are compacted (in position order).
   c. a list, in position order, of the positions in those chunks with ``key > L``, plus the first
      ``k`` with ``key == L`` (ties are taken in position order; no more than ``k`` can be needed).
   d. the exact k-th largest ``thr`` of the list (binary search again), then one compaction:
      ``key > thr`` and the first ``k - count(key > thr)`` positions with ``key == thr``, written
      in ascending position order, then ``-1`` padding. Lists up to ``TILES small`` (typical: a
      little over ``k`` for continuous scores) are held in registers; longer ones are streamed
      from the stored list (L2), and lists past ``TILES list`` (rows built to defeat the chunk
      maxima, e.g. ascending scores: up to ``(k - 1) * C`` keys above ``L``) stream the chunks.

Bytes: the scores once (+ candidates), ``1 / C`` of them written and read back as the summary,
and the few chunks of (b)-(c) re-read (about ``k`` chunks). No sort anywhere.
"""
from __future__ import annotations

import torch

from flashrt.families import Dim, KernelFamily, Support
from flashrt.tile_checks import POW2, WARPS, Tile
from flashrt.kernels_cuda.topk_kernel import _chunk_max_kernel, _select_kernel
from flashrt.kernels_cuda.topk_split_kernel import (_chunk_max_threshold_kernel, _scan_kernel, _scan_pick_kernel,
                                                    _split_pick_kernel, _threshold_kernel)
from flashrt.kernels_cuda import splitk
from flashrt.kernels_cuda.launch import PlanCache, cdiv, next_pow2
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda import pdl

TILES = {
    "chunk_max": {"block": 2048, "num_warps": 4},
    # summary: most chunk maxima (held in registers); bits: exact top bits of L (32: exact; fewer:
    # a cheaper search, a lower L, longer lists); fine: largest chunk scanned for keys above L
    # (longer summary chunks are split into fine ones); small: longest list selected in registers
    # (at least 2k); list: longest list kept (streamed from L2 when longer than small; past it the
    # chunks are streamed); group: elements per step of the scanning and streaming loops
    # radix_bits: bits of the k-th-largest searches decided per pass (1, 2, 4 or 8; bits % radix_bits == 0):
    # 2**radix_bits candidate thresholds counted at once (8: a 256-bin histogram of the digit),
    # bits / radix_bits sequential passes;
    # min_summary: the smallest summary block (capped at summary): rows of up to this many entries
    # share one compiled variant (a decode's rows grow by one entry at a time); registers: rows of
    # up to this many entries (or summary, the larger) are held whole in registers, their keys
    # their own summary (no chunk-max pass, no list), so a short summary for long rows does not
    # send rows a little longer than it down the list path
    # split_rows: launches of at most this many rows longer than registers split each row over
    # programs of split_slice entries (at most split_slices a row, the slice doubling past that):
    # each lists its slice's candidates, then one program a row picks from the list (0: never;
    # docs/kernels.md); split_warps: the warps of those kernels; split_fused: the row's last chunk-max
    # program finds L and its last scanning program picks (two launches, not four); split_skip: a
    # scanning program reads only its slice's chunks whose max is >= L when there are at most this
    # many (0: the whole slice); split_programs: split only while the launch's scanning programs (rows
    # times programs a row) are at most this many (0: no limit); split_min_programs: where they would be more, a
    # program scans several consecutive slices (a power of two, one after another) so that they are not, while a
    # row keeps at least this many programs (0: such launches are not split); split_bits: the exact top bits of a split
    # row's L (0: bits), apart from bits so that setting it leaves the unsplit select's variants as they are;
    # split_pick_radix: radix_bits of a split row's pick (its exact search over the list and the one-program
    # path past small; 0: radix_bits)
    "select": {"summary": 4096, "bits": 32, "fine": 16, "small": 1024, "list": 8192, "group": 2048,
               "num_warps": 8, "radix_bits": 1, "min_summary": 1024, "registers": 4096,
               "split_rows": 0, "split_slice": 4096, "split_slices": 256, "split_warps": 8,
               "split_fused": True, "split_skip": 0, "split_programs": 0, "split_min_programs": 0, "split_bits": 0,
               "split_pick_radix": 0},
}

# Scan programs take their slices last first (tests: the blocks then reach the list out of
# position order, as they may in any order on a GPU)
_SCAN_REVERSED = False


PLANS = PlanCache("topk", TILES)  # the active tiles (and launch plans made with them)
_tiles = PLANS.tiles


def _pow2(n: int) -> int:
    return next_pow2(max(1, int(n)))


def select_rows(src: torch.Tensor, cand, k: int, out: torch.Tensor, mark: bool = False, stats=None) -> None:
    """Top-``k`` of every row of ``src`` ([R, T]: fp32 scores, or int32 keys as made by ``_keys``),
    only where ``cand`` ([R, T] uint8, or None) is nonzero, ties to the lower position. ``k`` may
    pass ``T`` (every valid entry is picked): callers pass the model's ``k`` whatever the row's
    length, so the compiled variant does not change as a context grows.

    ``mark=False``: ``out`` int32 [R, >= min(k, T)] gets the positions ascending, then -1 up to its width.
    ``mark=True``: ``out`` uint8 [R, T], zero on entry, gets 1 at every pick.
    ``stats``: int32 [R] or None; gets each row's list length (tests and tuning: longer than the
    register block ``max(TILES small, 2k)`` means the list was streamed, than ``TILES list`` that
    the chunks were), -1 for a row of at most ``k`` entries (every valid one picked in one
    pass, no search: a decode's rows until the context passes ``k`` entries), or -2 for a row
    picked from its keys in registers (one search, no list: rows of up to TILES ``summary`` or
    ``registers`` entries, the larger). Rows split over programs (TILES ``split_rows``): the
    length of the list of the slices' candidates, or -3 where it passed the register block and
    the row took the one-program path.
    """
    R, T = src.shape
    assert src.stride(1) == 1 and (cand is None or (cand.stride(1) == 1 and cand.shape == src.shape))
    assert src.dtype in (torch.float32, torch.int32) and out.stride(1) == 1 and k >= 1
    assert mark or out.shape[1] >= min(k, T)
    all_tiles = _tiles()
    tiles, chunk_tiles = all_tiles["select"], all_tiles["chunk_max"]
    # chunk size of the summary searched for L (1: the keys themselves)
    coarse = 1 if T <= tiles["registers"] else _pow2(cdiv(T, tiles["summary"]))
    C = min(coarse, tiles["fine"])  # chunk size of the scan; F fine chunks per coarse chunk
    F, NC, NF = coarse // C, cdiv(T, coarse), cdiv(T, C)
    has_cand, src_keys = cand is not None, src.dtype == torch.int32
    cand_t = cand if has_cand else src
    summ = torch.empty(R, NC, dtype=torch.int32, device=src.device)  # coarse maxima, then their ids
    fine = torch.empty(R, NF, dtype=torch.int32, device=src.device) if F > 1 else summ
    fids = torch.empty(R, NF, dtype=torch.int32, device=src.device) if F > 1 else summ
    slicing = _split_slices(T, R, tiles)  # (entries a slice, slices a row, slices a program) were the rows split
    split = (coarse > 1 and R <= tiles["split_rows"] and T > tiles["split_slice"]
             and (not tiles["split_programs"] or R * cdiv(slicing[1], slicing[2]) <= tiles["split_programs"]))
    radix, bits = tiles["radix_bits"], (split and tiles["split_bits"]) or tiles["bits"]
    assert radix in (1, 2, 4, 8) and bits % radix == 0, f"tiles.topk select: radix_bits {radix}, bits {bits}"
    pick_radix = tiles["split_pick_radix"] or radix
    assert not split or bits % pick_radix == 0, f"tiles.topk select: split_pick_radix {pick_radix}, bits {bits}"
    LIST = min(tiles["list"], _pow2((k - 1) * C * F + k))
    small = min(max(tiles["small"], _pow2(2 * k)), LIST)  # a list of k + k ties stays in registers
    lst = torch.empty(R, LIST, dtype=torch.int32, device=src.device)
    width = 0 if mark else out.shape[1]
    # SUMMARY and PAD are capacities (masked past NC / width): floored and taken from k rather than
    # from the row, so short rows of any length share one variant
    summary = max(_pow2(NC), min(tiles["min_summary"], tiles["summary"]))
    common = dict(C=C, F=F, SUMMARY=summary, BITS=bits, LIST=LIST, RADIX=radix, SRC_KEYS=src_keys,
                  HAS_CAND=has_cand)
    fused = split and tiles["split_fused"] and splitk.fits(R)
    state = torch.empty(R, 2, dtype=torch.int32, device=src.device) if split else None  # L, the list's length
    if coarse > 1:
        chunks = max(chunk_tiles["block"], coarse) // C
        args = (src, cand_t, fine, summ)
        sizes = (T, NF, NC)
        strides = (src.stride(0), cand_t.stride(0), fine.stride(0), summ.stride(0))
        launch = dict(C=C, F=F, CHUNKS=chunks, SRC_KEYS=src_keys, HAS_CAND=has_cand,
                      num_warps=chunk_tiles["num_warps"], **pdl.options(src.device))
        if fused:  # the row's last chunk-max program finds L
            _chunk_max_threshold_kernel[(R, cdiv(NF, chunks))](
                *args, state, splitk.counters(src.device), *sizes, k, *strides, SUMMARY=summary, BITS=bits,
                RADIX=radix, **launch)
        else:
            _chunk_max_kernel[(R, cdiv(NF, chunks))](*args, *sizes, *strides, **launch)
    if split:
        _select_split(src, cand_t, summ, fine, fids, lst, out, stats, state, T, NC, NF, k, width, tiles, common,
                      small, mark, fused, pick_radix, slicing)
        return
    _select_kernel[(R,)](src, cand_t, summ, fine, fids, lst, out, stats if stats is not None else summ, T, NC, NF,
                         k, width, src.stride(0), cand_t.stride(0), summ.stride(0), fine.stride(0), lst.stride(0),
                         out.stride(0), SMALL=small, GROUP=max(C * F, tiles["group"]), PAD=min(1024, _pow2(k)),
                         MARK=mark, STATS=stats is not None, **common, num_warps=tiles["num_warps"],
                         **pdl.options(src.device))


def _split_slices(T: int, R: int, tiles: dict) -> tuple[int, int, int]:
    """(entries a slice, slices a row, slices a program) of ``R`` split rows of ``T`` entries: slices of
    ``split_slice`` entries, doubled while a row would take more than ``split_slices`` of them, one a program;
    where that makes more than ``split_programs`` scanning programs, ``split_min_programs`` (or more) a row
    with several slices each (a power of two), as long as that keeps the launch within ``split_programs``."""
    slice_ = max(tiles["split_slice"], _pow2(cdiv(T, tiles["split_slices"])))
    n = cdiv(T, slice_)
    programs, least = tiles["split_programs"], tiles["split_min_programs"]
    span = 1
    if programs and least and R * n > programs and programs // R >= least:
        span = _pow2(cdiv(n, programs // R))  # cdiv(n, span) <= programs // R programs a row
    return slice_, n, span


def _select_split(src, cand, summ, fine, fids, lst, out, stats, state, T, NC, NF, k, width, tiles, common, small,
                  mark, fused, pick_radix, slicing):
    """The select of rows split over programs, after the chunk-max pass (``fused``: whose last
    program of a row has found its ``L``; else ``_threshold_kernel`` finds it): every slice
    (``slicing``: entries a slice, slices a row, slices a program: :func:`_split_slices`) lists its candidates
    (``_scan_kernel``, a program scanning its slices in turn), then a row's picks come from its
    list, or from the one-program path when the list passes ``small`` (``_split_pick_kernel``;
    ``fused``: both in ``_scan_pick_kernel``, the row's last scanning program picking); the pick's searches
    ``pick_radix`` bits a pass."""
    R = src.shape[0]
    slices = tiles["split_slices"]
    slice_, n_slices, span = slicing
    programs = cdiv(n_slices, span)  # scanning programs a row
    lkey = torch.empty_like(lst)
    starts = torch.empty(R, slices, dtype=torch.int32, device=src.device)
    launch = dict(num_warps=tiles["split_warps"], **pdl.options(src.device))
    rows = (src.stride(0), cand.stride(0))
    pick = dict(SMALL=small, GROUP=max(common["C"] * common["F"], tiles["group"]), PAD=min(1024, _pow2(k)),
                SLICE=slice_, SLICES=slices, MARK=mark, STATS=stats is not None, **{**common, "RADIX": pick_radix},
                **launch)
    stats = stats if stats is not None else summ
    pick_args = (src, cand, summ, fine, fids, lst, lkey, starts, state, out, stats)
    pick_sizes = (T, NC, NF, k, width, n_slices, *rows, summ.stride(0), fine.stride(0), lst.stride(0),
                  starts.stride(0), out.stride(0))
    skip = tiles["split_skip"]
    if fused:
        # several slices a program: held to 128 registers a thread, two programs of 8 warps an SM as with one slice
        # a program (the loop over the slices otherwise lets the compiler take more)
        cap = dict(maxnreg=128) if span > 1 else {}
        _scan_pick_kernel[(R, programs)](*pick_args, splitk.counters(src.device), *pick_sizes,
                                         REVERSED=_SCAN_REVERSED, SKIP=skip, SPAN=span, **pick, **cap)
        return
    _threshold_kernel[(R,)](summ, state, NC, k, summ.stride(0), SUMMARY=common["SUMMARY"], BITS=common["BITS"],
                            RADIX=common["RADIX"], **launch)
    _scan_kernel[(R, programs)](src, cand, fine, lst, lkey, starts, state, T, NF, k, n_slices, *rows, fine.stride(0),
                                lst.stride(0), starts.stride(0), SLICE=slice_, C=common["C"], SKIP=skip,
                                LIST=common["LIST"], SRC_KEYS=common["SRC_KEYS"], HAS_CAND=common["HAS_CAND"],
                                REVERSED=_SCAN_REVERSED, SPAN=span, **launch)
    _split_pick_kernel[(R,)](*pick_args, *pick_sizes, **pick)


def topk_positions(scores, k, candidates=None):
    B, S, T = scores.shape
    width = min(k, T)
    out = torch.empty(B, S, width, dtype=torch.int32, device=scores.device)
    if B * S == 0 or width == 0:
        return out
    src = scores.reshape(B * S, T)
    src = src if src.stride(1) == 1 else src.contiguous()
    cand = None
    if candidates is not None:
        cand = candidates.reshape(B * S, T).contiguous().view(torch.uint8)
    select_rows(src, cand, k, out.view(B * S, width))
    return out


def warmup_cases(device, d: dict, dtype):
    """topk_positions over a step's index scores, with and without candidate blocks."""
    for n in _warmup.TOKENS:
        for T in _warmup.CONTEXTS:
            scores, k = torch.randn(1, n, T, device=device), d["index_topk"]  # as the model passes it
            yield _warmup.Launch("topk_positions", topk_positions, (scores, k, None))
            cand = torch.rand(1, n, T, device=device) < 0.5
            yield _warmup.Launch("topk_positions candidates", topk_positions, (scores, k, cand))


FAMILY = KernelFamily(
    "topk", ops={"topk_positions": topk_positions},
    supports={"topk_positions": Support(inputs={"scores": (torch.float32,)}, dims={"scores[-1]": Dim(0, 2**30 - 1)})},
    tiles=TILES, tile_checks={"chunk_max.block": POW2, "select.summary": POW2, "select.fine": POW2,
                              "select.small": POW2, "select.list": POW2, "select.group": POW2,
                              "select.min_summary": POW2, "select.registers": POW2,
                              "select.split_slice": POW2, "select.split_slices": POW2,
                              "select.split_rows": Tile(low=0, kind=int), "select.split_warps": WARPS,
                              "select.split_programs": Tile(low=0, kind=int),
                              "select.split_min_programs": Tile(low=0, kind=int),
                              "select.split_skip": Tile(choices=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256)),
                              "select.bits": Tile(high=32), "select.split_bits": Tile(low=0, high=32),
                              "select.radix_bits": Tile(choices=(1, 2, 4, 8)),
                              "select.split_pick_radix": Tile(choices=(0, 1, 2, 4, 8))},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="top-k positions: chunk maxima, threshold search, ordered picks")
