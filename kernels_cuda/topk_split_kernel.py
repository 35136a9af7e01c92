"""Triton kernels of the top-k select with a row split over several programs (launcher and
algorithm: :mod:`.topk`, ``select_rows``): a row's ``L`` from its chunk summary
(``_threshold_kernel``, or the last chunk-max program of the row: ``_chunk_max_threshold_kernel``),
a slice's candidates listed (``_scan_kernel``), and the row's picks from its list in registers, or
by the one-program select when the list does not fit (``_split_pick_kernel``, or the last scanning
program of the row: ``_scan_pick_kernel``). The fused kernels take one launch fewer each; their
last program is found by a ticket (``splitk.last_ticket``)."""
from __future__ import annotations

import triton
import triton.language as tl

from flashrt.kernels_cuda import splitk
from flashrt.kernels_cuda.pdl import wait_inputs
from flashrt.kernels_cuda.topk_kernel import _MIN, _kth_largest, _load_keys, _pad, _select_long, _store_chunk_max

# A program's slices are scanned together (one gather, one reservation) in groups whose chunk maxima, this many,
# fit a block in registers beside the keys
_SPAN_CHUNKS = tl.constexpr(2048)


@triton.jit
def _find_threshold(summ, state, NC, k, r, SUMMARY: tl.constexpr, BITS: tl.constexpr, RADIX: tl.constexpr):
    """Row ``r``'s ``L``, the k-th largest chunk max of its summary (``summ`` at the row; as the
    one-program select finds it), into ``state[r, 0]``; the row's list length ``state[r, 1]`` zeroed."""
    offs = tl.arange(0, SUMMARY)
    cmax = tl.load(summ + offs, mask=offs < NC, other=_MIN, cache_modifier=".cg")  # (written by other programs)
    tl.store(state + 2 * r, _kth_largest(cmax, k, BITS, RADIX))
    tl.store(state + 2 * r + 1, 0)


@triton.jit(do_not_specialize=("NC", "s_summ"))
def _threshold_kernel(summ, state, NC, k, s_summ, SUMMARY: tl.constexpr, BITS: tl.constexpr, RADIX: tl.constexpr):
    """One program a row: :func:`_find_threshold`."""
    wait_inputs()
    r = tl.program_id(0).to(tl.int64)
    _find_threshold(summ + r * s_summ, state, NC, k, r, SUMMARY, BITS, RADIX)


@triton.jit(do_not_specialize=("NF", "NC", "s_fine", "s_coarse"))
def _chunk_max_threshold_kernel(src, cand, fine, coarse, state, tickets, T, NF, NC, k, s_src, s_cand, s_fine,
                                s_coarse, C: tl.constexpr, F: tl.constexpr, CHUNKS: tl.constexpr,
                                SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr, SUMMARY: tl.constexpr,
                                BITS: tl.constexpr, RADIX: tl.constexpr):
    """The chunk-max pass (``coarse`` is the summary, ``fine`` too where F == 1); the row's last
    program to finish finds its ``L`` from the stored summary."""
    wait_inputs()
    _store_chunk_max(src, cand, fine, coarse, T, NF, NC, s_src, s_cand, s_fine, s_coarse, C, F, CHUNKS, SRC_KEYS,
                     HAS_CAND)
    r = tl.program_id(0).to(tl.int64)
    if splitk.last_ticket(tickets + r, tl.num_programs(1)):
        _find_threshold(coarse + r * s_coarse, state, NC, k, r, SUMMARY, BITS, RADIX)
        splitk.reset_ticket(tickets + r)


@triton.jit
def _scan_slice(src, cand, fine, lst, lkey, starts, state, T, NF, k, r, p, SLICE: tl.constexpr, C: tl.constexpr,
                SKIP: tl.constexpr, LIST: tl.constexpr, SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr):
    """Slice ``p`` of row ``r`` (pointers at the row): its positions with ``key > L`` and its first
    ``k`` with ``key == L``, in position order, appended to the row's list. ``SKIP`` > 0: the
    slice's ``C``-entry chunks whose max (``fine``) is at least ``L`` are read alone when there are
    at most ``SKIP`` of them (every candidate lies in one), else the whole slice."""
    L = tl.load(state + 2 * r)
    if SKIP > 0:
        j = tl.arange(0, SLICE // C)
        first = p * (SLICE // C)
        hit = tl.load(fine + first + j, mask=first + j < NF, other=_MIN) >= tl.maximum(L, _MIN + 1)
        n_hit = tl.sum(hit.to(tl.int32))
        if n_hit <= SKIP:
            nth = tl.arange(0, SKIP)
            # the index of the (n+1)-th chunk above L: the chunks whose running count of hits is <= n
            idx = tl.sum((tl.cumsum(hit.to(tl.int32), 0)[None, :] <= nth[:, None]).to(tl.int32), axis=1)
            pos = (first + idx)[:, None] * C + tl.arange(0, C)[None, :]
            live = (nth < n_hit)[:, None] & (pos < T)
            key = _load_keys(src, cand, pos, live, SRC_KEYS, HAS_CAND)
            _append(tl.reshape(pos, [SKIP * C]), tl.reshape(key, [SKIP * C]), L, k, state, r, p, lst, lkey, starts,
                    LIST)
        else:
            _append_slice(src, cand, L, T, k, state, r, p, lst, lkey, starts, SLICE, LIST, SRC_KEYS, HAS_CAND)
    else:
        _append_slice(src, cand, L, T, k, state, r, p, lst, lkey, starts, SLICE, LIST, SRC_KEYS, HAS_CAND)


@triton.jit
def _append_slice(src, cand, L, T, k, state, r, p, lst, lkey, starts, SLICE: tl.constexpr, LIST: tl.constexpr,
                  SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr):
    """:func:`_append` of every entry of slice ``p``."""
    pos = p * SLICE + tl.arange(0, SLICE)
    _append(pos, _load_keys(src, cand, pos, pos < T, SRC_KEYS, HAS_CAND), L, k, state, r, p, lst, lkey, starts, LIST)


@triton.jit
def _keep(key, L, k):
    """Of entries in position order (``key`` MIN where not an entry): those with ``key > L`` and the
    first ``k`` with ``key == L`` (the pick takes at most ``k`` ties, the first by position)."""
    eq = (key == L) & (key != _MIN)
    if tl.sum(eq.to(tl.int32)) > k:  # more ties than can be picked: the first k (a scan only here)
        eq = eq & (tl.cumsum(eq.to(tl.int32), 0) - 1 < k)
    return (key > L) | eq


@triton.jit
def _publish(pos, key, keep, start, lst, lkey, LIST: tl.constexpr):
    """The kept entries written in order to the list from offset ``start`` (those past its end dropped:
    the pick then takes the one-program path, the list's length telling it so)."""
    dst = start + tl.cumsum(keep.to(tl.int32), 0) - 1
    ok = keep & (dst < LIST)
    tl.store(lst + dst, pos, mask=ok)
    tl.store(lkey + dst, key, mask=ok)


@triton.jit
def _append(pos, key, L, k, state, r, p, lst, lkey, starts, LIST: tl.constexpr):
    """Slice ``p``'s entries (``pos`` ascending, ``key`` MIN where not an entry): :func:`_keep`'s
    appended to the row's list (positions in ``lst``, keys in ``lkey``) at an offset reserved from the
    list's length (``state[r, 1]``); the offset goes to ``starts[p]``. Blocks land in the list in
    whatever order the programs reserve them."""
    keep = _keep(key, L, k)
    start = tl.atomic_add(state + 2 * r + 1, tl.sum(keep.to(tl.int32)))
    _publish(pos, key, keep, start, lst, lkey, LIST)
    tl.store(starts + p, start)


@triton.jit
def _scan_slices(src, cand, fine, lst, lkey, starts, state, T, NF, k, r, n_slices, SLICE: tl.constexpr,
                 C: tl.constexpr, SKIP: tl.constexpr, LIST: tl.constexpr, SRC_KEYS: tl.constexpr,
                 HAS_CAND: tl.constexpr, REVERSED: tl.constexpr, SPAN: tl.constexpr):
    """This program's ``SPAN`` consecutive slices of the row: program j of the row's axis scans slices
    ``j * SPAN ...``, or (``REVERSED``: blocks reserved last slice first, as tests want them) program
    ``n - 1 - j``'s. Where ``SKIP`` applies, in groups of as many slices as have ``_SPAN_CHUNKS`` chunk maxima
    (all ``SPAN`` where fewer): a group at once when none of its slices has more than ``SKIP`` chunks at or
    above ``L`` (:func:`_scan_span`), else its slices in turn (:func:`_scan_each`)."""
    q = tl.program_id(1)
    if REVERSED:
        q = tl.num_programs(1) - 1 - q
    CH: tl.constexpr = SLICE // C
    GROUP: tl.constexpr = SPAN if SPAN * CH <= _SPAN_CHUNKS else _SPAN_CHUNKS // CH
    if SKIP > 0 and GROUP > 1:
        L = tl.load(state + 2 * r)
        for j in range(SPAN // GROUP):
            first = q * SPAN + (SPAN - GROUP - j * GROUP if REVERSED else j * GROUP)
            p = first + tl.arange(0, GROUP)
            chunk = p[:, None] * CH + tl.arange(0, CH)[None, :]
            hit = (tl.load(fine + chunk, mask=chunk < NF, other=_MIN) >= tl.maximum(L, _MIN + 1)).to(tl.int32)
            n_hit = tl.sum(hit, axis=1)
            if tl.max(n_hit, 0) <= SKIP:
                _scan_span(src, cand, lst, lkey, starts, state, T, k, r, p, L, hit, n_hit, n_slices, C, SKIP,
                           LIST, SRC_KEYS, HAS_CAND, GROUP, CH)
            else:
                _scan_each(src, cand, fine, lst, lkey, starts, state, T, NF, k, r, first, n_slices, SLICE, C,
                           SKIP, LIST, SRC_KEYS, HAS_CAND, REVERSED, GROUP)
    else:
        _scan_each(src, cand, fine, lst, lkey, starts, state, T, NF, k, r, q * SPAN, n_slices, SLICE, C, SKIP,
                   LIST, SRC_KEYS, HAS_CAND, REVERSED, SPAN)


@triton.jit
def _scan_each(src, cand, fine, lst, lkey, starts, state, T, NF, k, r, first, n_slices, SLICE: tl.constexpr,
               C: tl.constexpr, SKIP: tl.constexpr, LIST: tl.constexpr, SRC_KEYS: tl.constexpr,
               HAS_CAND: tl.constexpr, REVERSED: tl.constexpr, COUNT: tl.constexpr):
    """Slices ``first ...`` (``COUNT`` of them) one after another (:func:`_scan_slice`), the last first where
    ``REVERSED``."""
    for g in range(COUNT):
        p = first + (COUNT - 1 - g if REVERSED else g)
        if p < n_slices:
            _scan_slice(src, cand, fine, lst, lkey, starts, state, T, NF, k, r, p, SLICE, C, SKIP, LIST, SRC_KEYS,
                        HAS_CAND)


@triton.jit
def _scan_span(src, cand, lst, lkey, starts, state, T, k, r, p, L, hit, n_hit, n_slices, C: tl.constexpr,
               SKIP: tl.constexpr, LIST: tl.constexpr, SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr,
               SPAN: tl.constexpr, CH: tl.constexpr):
    """Slices ``p`` (``SPAN`` consecutive ones) at once, each with at most ``SKIP`` of its ``CH`` chunks at or
    above ``L`` (``hit`` [SPAN, CH], ``n_hit`` a slice): those chunks' keys read in one gather, each slice's
    kept entries (as :func:`_keep` keeps a slice's) appended with one reservation, the span's slices one block
    each, consecutive in the list (``starts`` of each: the reservation plus the slices' before it).
    One dependent chain of loads and one atomic a group rather than one a slice."""
    nth = tl.arange(0, SKIP)
    g = tl.arange(0, SPAN)
    run = tl.cumsum(hit, 1)  # hits up to each chunk, a slice at a time
    idx = tl.zeros([SPAN, SKIP], dtype=tl.int32)
    for s in tl.static_range(SPAN):
        # slice s's (n+1)-th chunk above L: the chunks whose running count of hits is <= n
        run_s = tl.sum(tl.where(g[:, None] == s, run, 0), axis=0)
        idx_s = tl.sum((run_s[None, :] <= nth[:, None]).to(tl.int32), axis=1)
        idx = tl.where(g[:, None] == s, idx_s[None, :], idx)
    pos = ((p[:, None] * CH + idx) * C)[:, :, None] + tl.arange(0, C)[None, None, :]
    live = ((nth[None, :] < n_hit[:, None])[:, :, None]) & (pos < T)
    pos = tl.reshape(pos, [SPAN * SKIP * C])
    key = _load_keys(src, cand, pos, tl.reshape(live, [SPAN * SKIP * C]), SRC_KEYS, HAS_CAND)
    eq = tl.reshape(((key == L) & (key != _MIN)).to(tl.int32), [SPAN, SKIP * C])
    if tl.max(tl.sum(eq, axis=1), 0) > k:  # a slice's first k ties only, as each slice alone lists them
        eq = eq * (tl.cumsum(eq, 1) - 1 < k).to(tl.int32)
    keep = (key > L) | (tl.reshape(eq, [SPAN * SKIP * C]) != 0)
    count = tl.sum(tl.reshape(keep.to(tl.int32), [SPAN, SKIP * C]), axis=1)
    start = tl.atomic_add(state + 2 * r + 1, tl.sum(count, 0))
    _publish(pos, key, keep, start, lst, lkey, LIST)
    tl.store(starts + p, start + tl.cumsum(count, 0) - count, mask=p < n_slices)


# T and the row strides stay specialised (as in ``_chunk_max_kernel``): the slice's loads in vectors
@triton.jit(do_not_specialize=("NF", "n_slices", "s_fine", "s_lst", "s_starts"))
def _scan_kernel(src, cand, fine, lst, lkey, starts, state, T, NF, k, n_slices, s_src, s_cand, s_fine, s_lst,
                 s_starts, SLICE: tl.constexpr, C: tl.constexpr, SKIP: tl.constexpr, LIST: tl.constexpr,
                 SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr, REVERSED: tl.constexpr, SPAN: tl.constexpr):
    """Program (row, ``SPAN`` slices): :func:`_scan_slices`."""
    wait_inputs()
    r = tl.program_id(0).to(tl.int64)
    _scan_slices(src + r * s_src, cand + r * s_cand, fine + r * s_fine, lst + r * s_lst, lkey + r * s_lst,
                 starts + r * s_starts, state, T, NF, k, r, n_slices, SLICE, C, SKIP, LIST, SRC_KEYS, HAS_CAND,
                 REVERSED, SPAN)


@triton.jit
def _rank_by_position(flag, slice_of, starts, LEN: tl.constexpr, SLICES: tl.constexpr):
    """For the flagged entries of a list of ``LEN`` entries made of per-slice blocks (each block in
    position order, the blocks in any order, block j starting at ``starts[j]``): each one's rank
    among the flagged entries in position order. Rank = flagged entries of earlier slices +
    flagged entries before it in its own block; the latter is its rank in the list less the
    flagged entries before its block's start (the list's exclusive count, read at each start)."""
    flag = flag.to(tl.int32)
    cnt = tl.histogram(slice_of, SLICES, mask=flag != 0)  # flagged entries per slice
    before = tl.cumsum(flag, 0) - flag  # flagged entries before each list index
    before_in_list = tl.gather(before, tl.minimum(starts, LEN - 1), 0)  # (an empty block's value is unused)
    delta = tl.cumsum(cnt, 0) - cnt - before_in_list
    return before + tl.gather(delta, slice_of, 0)


@triton.jit
def _pick_row(src, cand, summ, fine, fids, lst, lkey, starts, state, out, stats, r, T, NC, NF, k, width, n_slices,
              C: tl.constexpr, F: tl.constexpr, SUMMARY: tl.constexpr, BITS: tl.constexpr, LIST: tl.constexpr,
              SMALL: tl.constexpr, GROUP: tl.constexpr, PAD: tl.constexpr, SLICE: tl.constexpr,
              SLICES: tl.constexpr, SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr, MARK: tl.constexpr,
              STATS: tl.constexpr, RADIX: tl.constexpr):
    """Row ``r``'s picks after its slices are listed (pointers at the row): a list of at most
    ``SMALL`` entries is held in registers, its exact k-th largest ``thr`` found, and the picks
    (``key > thr``, then the ties in position order) written in position order; a longer list (rows
    that defeat the chunk maxima, or many ties) falls back to the one-program select from the summary.
    The list, its length and the blocks' starts were written by other programs: read from L2 (``.cg``),
    never from a line this program's L1 may hold from before (the length shares one with ``L``)."""
    total = tl.load(state + 2 * r + 1, cache_modifier=".cg")
    if total <= SMALL:
        if STATS:
            tl.store(stats + r, total)
        e = tl.arange(0, SMALL)
        live = e < total
        pos = tl.load(lst + e, mask=live, other=0, cache_modifier=".cg")
        key = tl.load(lkey + e, mask=live, other=_MIN, cache_modifier=".cg")
        # L (the row's, at most the list's k-th largest: k of its entries are at least L) bounds the search
        thr = _kth_largest(key, k, 32, RADIX, tl.load(state + 2 * r, cache_modifier=".cg"), True)
        gt = key > thr
        eq = (key == thr) & (key != _MIN)
        need = k - tl.sum(gt.to(tl.int32))
        j = tl.arange(0, SLICES)
        first = tl.load(starts + j, mask=j < n_slices, other=0, cache_modifier=".cg")
        slice_of = pos // SLICE
        if tl.sum(eq.to(tl.int32)) <= need:  # every tie is picked (one, for distinct scores): no ranking
            sel = gt | eq
        else:
            sel = gt | (eq & (_rank_by_position(eq, slice_of, first, SMALL, SLICES) < need))  # the first ties by position
        if MARK:
            tl.store(out + pos, sel.to(tl.uint8), mask=sel)
        else:
            tl.store(out + _rank_by_position(sel, slice_of, first, SMALL, SLICES), pos, mask=sel)
        n_out = tl.sum(sel.to(tl.int32))
    else:
        if STATS:
            tl.store(stats + r, -3)
        n_out = _select_long(src, cand, summ, fine, fids, lst, out, stats + r, T, NC, NF, k, C, F, SUMMARY, BITS,
                             LIST, SMALL, GROUP, SRC_KEYS, HAS_CAND, MARK, False, RADIX)
    _pad(out, n_out, width, PAD, MARK)


_PICK_SIZED = ("T", "NC", "NF", "width", "n_slices", "s_src", "s_cand", "s_summ", "s_fine", "s_out")


@triton.jit(do_not_specialize=_PICK_SIZED)
def _split_pick_kernel(src, cand, summ, fine, fids, lst, lkey, starts, state, out, stats, T, NC, NF, k, width,
                       n_slices, s_src, s_cand, s_summ, s_fine, s_lst, s_starts, s_out,
                       C: tl.constexpr, F: tl.constexpr, SUMMARY: tl.constexpr, BITS: tl.constexpr,
                       LIST: tl.constexpr, SMALL: tl.constexpr, GROUP: tl.constexpr, PAD: tl.constexpr,
                       SLICE: tl.constexpr, SLICES: tl.constexpr, SRC_KEYS: tl.constexpr,
                       HAS_CAND: tl.constexpr, MARK: tl.constexpr, STATS: tl.constexpr, RADIX: tl.constexpr):
    """One program a row after ``_scan_kernel``: :func:`_pick_row`."""
    wait_inputs()
    r = tl.program_id(0).to(tl.int64)
    _pick_row(src + r * s_src, cand + r * s_cand, summ + r * s_summ, fine + r * s_fine, fids + r * s_fine,
              lst + r * s_lst, lkey + r * s_lst, starts + r * s_starts, state, out + r * s_out, stats, r, T, NC, NF,
              k, width, n_slices, C, F, SUMMARY, BITS, LIST, SMALL, GROUP, PAD, SLICE, SLICES, SRC_KEYS, HAS_CAND,
              MARK, STATS, RADIX)


@triton.jit(do_not_specialize=("NC", "NF", "width", "n_slices", "s_summ", "s_fine", "s_lst", "s_starts", "s_out"))
def _scan_pick_kernel(src, cand, summ, fine, fids, lst, lkey, starts, state, out, stats, tickets, T, NC, NF, k,
                      width, n_slices, s_src, s_cand, s_summ, s_fine, s_lst, s_starts, s_out,
                      C: tl.constexpr, F: tl.constexpr, SUMMARY: tl.constexpr, BITS: tl.constexpr,
                      LIST: tl.constexpr, SMALL: tl.constexpr, GROUP: tl.constexpr, PAD: tl.constexpr,
                      SLICE: tl.constexpr, SLICES: tl.constexpr, SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr,
                      MARK: tl.constexpr, STATS: tl.constexpr, RADIX: tl.constexpr, REVERSED: tl.constexpr,
                      SKIP: tl.constexpr, SPAN: tl.constexpr):
    """Program (row, ``SPAN`` slices): :func:`_scan_slices`; the row's last program to finish then picks
    (:func:`_pick_row`) from the list the others have published."""
    wait_inputs()
    r = tl.program_id(0).to(tl.int64)
    src += r * s_src
    cand += r * s_cand
    lst += r * s_lst
    lkey += r * s_lst
    starts += r * s_starts
    _scan_slices(src, cand, fine + r * s_fine, lst, lkey, starts, state, T, NF, k, r, n_slices, SLICE, C, SKIP, LIST,
                 SRC_KEYS, HAS_CAND, REVERSED, SPAN)
    if splitk.last_ticket(tickets + r, tl.num_programs(1)):
        _pick_row(src, cand, summ + r * s_summ, fine + r * s_fine, fids + r * s_fine, lst, lkey, starts, state,
                  out + r * s_out, stats, r, T, NC, NF, k, width, n_slices, C, F, SUMMARY, BITS, LIST, SMALL, GROUP,
                  PAD, SLICE, SLICES, SRC_KEYS, HAS_CAND, MARK, STATS, RADIX)
        splitk.reset_ticket(tickets + r)
