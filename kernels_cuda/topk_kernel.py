"""Triton kernels of the threshold top-k (launcher and algorithm: :mod:`.topk`): int32 order keys
(``_keys``), the bitwise k-th-largest search, the chunk maxima and the per-row select."""
from __future__ import annotations

import triton
import triton.language as tl

from flashrt.kernels_cuda.pdl import wait_inputs

_MIN = tl.constexpr(-2147483648)


@triton.jit
def _keys(x, ok):
    """fp32 -> int32 keys ordered as the floats; -0.0 -> +0.0; non-finite or not ``ok`` -> MIN."""
    b = x.to(tl.int32, bitcast=True)
    finite = (b & 0x7F800000) != 0x7F800000
    b = tl.where(b == _MIN, 0, b)
    key = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return tl.where(ok & finite, key, _MIN)


@triton.jit
def _load_keys(src, cand, pos, mask, SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr):
    """Keys at ``pos`` of one row: int32 keys as stored, or fp32 scores (and candidates) converted."""
    if SRC_KEYS:
        key = tl.load(src + pos, mask=mask, other=_MIN)
    else:
        ok = mask
        if HAS_CAND:
            ok = ok & (tl.load(cand + pos, mask=mask, other=0) != 0)
        key = _keys(tl.load(src + pos, mask=mask, other=0.0), ok)
    return key


@triton.jit
def _kth_largest(keys, k, BITS: tl.constexpr, RADIX: tl.constexpr = 1, lo=_MIN, HAS_LO: tl.constexpr = False):
    """The k-th largest of ``keys`` (MIN when fewer than k exceed MIN), its top ``BITS`` bits
    exact and the rest zero (a lower bound when BITS < 32), or exact where RADIX 1 finds it early.
    RADIX bits per step: all ``2**RADIX`` candidate digits counted in one pass (BITS / RADIX
    sequential reductions); at RADIX 8 the pass is a 256-bin histogram of the digit under the bits
    decided so far; at RADIX 1 see :func:`_kth_bits` (``lo``: a key known not to exceed the answer)."""
    if RADIX == 8:
        ans = _kth_histogram(keys, k, BITS)
    elif RADIX == 1:
        ans = _kth_bits(keys, k, lo, BITS, HAS_LO) ^ _MIN
    else:
        ans = tl.full([], 0, tl.int32)
        d = tl.arange(0, 1 << RADIX)
        for i in range(BITS // RADIX):
            shift = 32 - (i + 1) * RADIX
            cand = (ans | (d << shift)) ^ _MIN  # [2**RADIX] thresholds as keys; digit 0 is ans itself
            counts = tl.sum((keys[None, :] >= cand[:, None]).to(tl.int32), axis=1)
            ans = ans | (tl.max(tl.where(counts >= k, d, 0), axis=0) << shift)  # counts fall with d
    return ans ^ _MIN


@triton.jit
def _kth_bits(keys, k, lo, BITS: tl.constexpr, HAS_LO: tl.constexpr):
    """:func:`_kth_largest` one bit a pass, from the top bit down: a pass counts the keys at or
    above the answer so far with the next bit set, and keeps the bit where at least k are. Two
    shortcuts, each exact: a pass counting exactly k keys ends the search, the k-th largest being
    the least of those k (one reduction in place of the passes left: for scores spread over many
    values, the bits below where the k-th and (k+1)-th largest differ); and with ``HAS_LO`` the
    bits that ``lo`` (at most the answer) shares with the largest key are the answer's, taken
    without a pass (one reduction for the largest key)."""
    ans = tl.zeros([], tl.int32)  # the answer's unsigned bit pattern so far
    bit = tl.full([], _MIN, tl.int32)
    n = tl.zeros([], tl.int32)  # bits decided
    exact = tl.zeros([], tl.int32)  # 1 once a pass counted exactly k keys at or above ans
    shared = tl.zeros([], tl.int32)  # the bits lo and the largest key differ in (HAS_LO)
    prefix = tl.zeros([], tl.int32)  # 1 while every bit decided so far is a shared one
    if HAS_LO:
        shared = lo ^ tl.max(keys)
        prefix += 1
    while (n < BITS) & (exact == 0):
        if (prefix != 0) & ((shared & bit) == 0):
            ans = ans | ((lo ^ _MIN) & bit)
        else:
            prefix = tl.zeros([], tl.int32)
            cand = ans | bit
            cnt = tl.sum((keys >= (cand ^ _MIN)).to(tl.int32))
            ans = tl.where(cnt >= k, cand, ans)
            exact = (cnt == k).to(tl.int32)
        bit = (bit >> 1) & 0x7FFFFFFF
        n += 1
    kth = ans ^ _MIN
    if exact != 0:
        kth = tl.min(tl.where(keys >= kth, keys, 2147483647))
    return kth


@triton.jit
def _kth_histogram(keys, k, BITS: tl.constexpr):
    """:func:`_kth_largest`'s unsigned answer pattern by 8-bit digits, top digit first: the keys
    whose higher digits equal the answer's so far are counted per digit (``tl.histogram``); the
    answer takes the largest digit with at least ``need`` keys at or above it, and ``need`` drops
    by the keys above that digit. ``need`` starts at k over every element (padding included, as
    MIN: fewer than k keys above MIN give MIN), as the counting passes do."""
    u = (keys ^ _MIN).to(tl.uint32, bitcast=True)  # signed key order as unsigned order
    d = tl.arange(0, 256)
    ans = tl.full([], 0, tl.uint32)
    need = tl.full([], 0, tl.int32) + k
    for i in tl.static_range(BITS // 8):
        shift = 24 - 8 * i
        digit = ((u >> shift) & 0xFF).to(tl.int32)
        if i == 0:
            hist = tl.histogram(digit, 256)
        else:
            hist = tl.histogram(digit, 256, mask=(u >> (shift + 8)) == (ans >> (shift + 8)))
        at_or_above = tl.cumsum(hist, 0, reverse=True)
        best = tl.max(tl.where(at_or_above >= need, d, 0), axis=0)
        need -= tl.sum(tl.where(d > best, hist, 0), axis=0)
        ans = ans | (best.to(tl.uint32) << shift)
    return ans.to(tl.int32, bitcast=True)


@triton.jit
def _emit(key, pos, thr, need, n_out, eq_seen, out, MARK: tl.constexpr):
    """Write the picks of one block in position order: ``key > thr`` and the ties ``key == thr``
    while fewer than ``need`` ties were taken. Returns the running (picks, ties seen)."""
    gt = key > thr
    eq = (key == thr) & (key != _MIN)
    rank = eq_seen + tl.cumsum(eq.to(tl.int32), 0) - 1
    sel = gt | (eq & (rank < need))
    dst = n_out + tl.cumsum(sel.to(tl.int32), 0) - 1
    if MARK:
        tl.store(out + pos, sel.to(tl.uint8), mask=sel)
    else:
        tl.store(out + dst, pos, mask=sel)
    return n_out + tl.sum(sel.to(tl.int32)), eq_seen + tl.sum(eq.to(tl.int32))


@triton.jit
def _group(src, cand, ids, g, total, T, C: tl.constexpr, GROUP: tl.constexpr,
           SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr):
    """(keys, positions, live) of elements ``g .. g + GROUP`` of the chunks listed in ``ids``, in
    order (with ``C == 1``, ``ids`` is a list of positions)."""
    e = g + tl.arange(0, GROUP)
    live = e < total
    chunk = tl.load(ids + e // C, mask=live, other=0)
    pos = chunk * C + e % C
    live = live & (pos < T)
    return _load_keys(src, cand, pos, live, SRC_KEYS, HAS_CAND), pos, live


@triton.jit
def _finish_registers(src, cand, lst, out, n_list, k, L, BLOCK: tl.constexpr,
                      SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr, MARK: tl.constexpr, RADIX: tl.constexpr):
    """(d) the list (every key above ``L`` and at least k ties at it, :func:`_build_list`) held in
    registers: its picks, ``L`` bounding the search from below."""
    offs = tl.arange(0, BLOCK)
    live = offs < n_list
    pos = tl.load(lst + offs, mask=live, other=0)
    return _pick(_load_keys(src, cand, pos, live, SRC_KEYS, HAS_CAND), pos, k, out, MARK, RADIX, L, True)


@triton.jit
def _pick(key, pos, k, out, MARK: tl.constexpr, RADIX: tl.constexpr, lo=_MIN, HAS_LO: tl.constexpr = False):
    """The picks of keys held in registers (at ``pos``): the exact k-th largest (``lo``: a key known
    not to exceed it, :func:`_kth_largest`), then one emit; their count."""
    thr = _kth_largest(key, k, 32, RADIX, lo, HAS_LO)
    n_out, _ = _emit(key, pos, thr, k - tl.sum((key > thr).to(tl.int32)), 0, 0, out, MARK)
    return n_out


@triton.jit
def _finish_streaming(src, cand, ids, out, T, total, k, C: tl.constexpr, GROUP: tl.constexpr,
                      SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr, MARK: tl.constexpr):
    """(d) re-reading, in GROUP steps, the chunks listed in ``ids`` (or with C == 1 the list)."""
    ans = 0
    bit = tl.full([], _MIN, tl.int32)
    for i in range(32):
        cand_bits = ans | bit
        bit = (bit >> 1) & 0x7FFFFFFF
        count = 0
        for g in range(0, total, GROUP):
            key, pos, live = _group(src, cand, ids, g, total, T, C, GROUP, SRC_KEYS, HAS_CAND)
            count += tl.sum((key >= (cand_bits ^ _MIN)).to(tl.int32))
        ans = tl.where(count >= k, cand_bits, ans)
    thr = ans ^ _MIN
    greater = 0
    for g in range(0, total, GROUP):
        key, pos, live = _group(src, cand, ids, g, total, T, C, GROUP, SRC_KEYS, HAS_CAND)
        greater += tl.sum((key > thr).to(tl.int32))
    n_out = 0
    eq_seen = 0
    for g in range(0, total, GROUP):
        key, pos, live = _group(src, cand, ids, g, total, T, C, GROUP, SRC_KEYS, HAS_CAND)
        n_out, eq_seen = _emit(key, pos, thr, k - greater, n_out, eq_seen, out, MARK)
    return n_out


@triton.jit
def _build_list(src, cand, ids, lst, T, total, L, k, C: tl.constexpr, GROUP: tl.constexpr,
                LIST: tl.constexpr, SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr):
    """(c): positions with key > L, then ties key == L while fewer than k; their count."""
    n_list = 0
    ties = 0
    for g in range(0, total, GROUP):
        key, pos, live = _group(src, cand, ids, g, total, T, C, GROUP, SRC_KEYS, HAS_CAND)
        eq = (key == L) & (key != _MIN)
        keep = (key > L) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) - 1 < k))
        dst = n_list + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(lst + dst, pos, mask=keep & (dst < LIST))
        n_list += tl.sum(keep.to(tl.int32))
        ties += tl.sum(eq.to(tl.int32))
    return n_list


@triton.jit
def _chunks_above(src, cand, summ, ids, T, NC, k, C: tl.constexpr, SUMMARY: tl.constexpr, BITS: tl.constexpr,
                  SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr, RADIX: tl.constexpr):
    """(a) ``L`` and (b) the ids of the chunks whose max is ``>= L`` written to ``ids``; (L, count)."""
    offs = tl.arange(0, SUMMARY)
    if C == 1:  # the keys are their own summary
        cmax = _load_keys(src, cand, offs, offs < T, SRC_KEYS, HAS_CAND)
    else:
        cmax = tl.load(summ + offs, mask=offs < NC, other=_MIN)
    L = _kth_largest(cmax, k, BITS, RADIX)
    sel = cmax >= tl.maximum(L, _MIN + 1)
    tl.debug_barrier()  # ids may alias summ: every lane has read it
    tl.store(ids + tl.cumsum(sel.to(tl.int32), 0) - 1, offs, mask=sel)
    tl.debug_barrier()
    return L, tl.sum(sel.to(tl.int32))


@triton.jit
def _fine_chunks(fine, coarse_ids, fids, n_coarse, NF, L, F: tl.constexpr, GROUP: tl.constexpr):
    """(b') the ids of the fine chunks (F per coarse chunk) whose max is ``>= L``; their count."""
    n = 0
    for g in range(0, n_coarse * F, GROUP):
        e = g + tl.arange(0, GROUP)
        f = tl.load(coarse_ids + e // F, mask=e < n_coarse * F, other=0) * F + e % F
        live = (e < n_coarse * F) & (f < NF)
        sel = live & (tl.load(fine + f, mask=live, other=_MIN) >= tl.maximum(L, _MIN + 1))
        tl.store(fids + n + tl.cumsum(sel.to(tl.int32), 0) - 1, f, mask=sel)
        n += tl.sum(sel.to(tl.int32))
    tl.debug_barrier()
    return n


# The row length and what follows it (counts, row strides, the output width) are not specialised
# on (== 1, % 16 == 0): a decode's rows grow by one entry a step, and a variant per class would be
# compiled mid-run. This kernel runs one program per row; the loads it could vectorise are few.
_ROW_SIZED = ("T", "NC", "NF", "width", "s_src", "s_cand", "s_summ", "s_fine", "s_out")


@triton.jit(do_not_specialize=_ROW_SIZED)
def _select_kernel(src, cand, summ, fine, fids, lst, out, stats, T, NC, NF, k, width,
                   s_src, s_cand, s_summ, s_fine, s_lst, s_out,
                   C: tl.constexpr, F: tl.constexpr, SUMMARY: tl.constexpr, BITS: tl.constexpr,
                   LIST: tl.constexpr, SMALL: tl.constexpr, GROUP: tl.constexpr, PAD: tl.constexpr,
                   SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr, MARK: tl.constexpr,
                   STATS: tl.constexpr, RADIX: tl.constexpr):
    wait_inputs()
    r = tl.program_id(0).to(tl.int64)
    src += r * s_src
    cand += r * s_cand
    summ += r * s_summ
    lst += r * s_lst
    out += r * s_out
    if T <= k:  # every valid entry is a pick: one pass, no threshold search
        if STATS:
            tl.store(stats + r, -1)
        n_out = 0
        for g in range(0, T, GROUP):
            pos = g + tl.arange(0, GROUP)
            n_out, _ = _emit(_load_keys(src, cand, pos, pos < T, SRC_KEYS, HAS_CAND), pos, _MIN, 0, n_out, 0, out,
                             MARK)
    elif C * F == 1 and BITS == 32:  # the keys are their own summary: its exact k-th largest is the threshold
        if STATS:
            tl.store(stats + r, -2)
        pos = tl.arange(0, SUMMARY)
        n_out = _pick(_load_keys(src, cand, pos, pos < T, SRC_KEYS, HAS_CAND), pos, k, out, MARK, RADIX)
    else:
        n_out = _select_long(src, cand, summ, fine + r * s_fine, fids + r * s_fine, lst, out, stats + r, T, NC, NF,
                             k, C, F, SUMMARY, BITS, LIST, SMALL, GROUP, SRC_KEYS, HAS_CAND, MARK, STATS, RADIX)
    _pad(out, n_out, width, PAD, MARK)


@triton.jit
def _select_long(src, cand, summ, fine, fids, lst, out, stat, T, NC, NF, k, C: tl.constexpr, F: tl.constexpr,
                 SUMMARY: tl.constexpr, BITS: tl.constexpr, LIST: tl.constexpr, SMALL: tl.constexpr,
                 GROUP: tl.constexpr, SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr, MARK: tl.constexpr,
                 STATS: tl.constexpr, RADIX: tl.constexpr):
    """Steps (a)-(d) of a row longer than its summary, in one program (pointers at the row); the
    count of picks written."""
    L, n_sel = _chunks_above(src, cand, summ, summ, T, NC, k, C * F, SUMMARY, BITS, SRC_KEYS, HAS_CAND, RADIX)
    ids = summ  # coarse chunk ids, written over the summary
    if F > 1:  # two-level summary: narrow the coarse chunks down to fine ones
        ids = fids
        n_sel = _fine_chunks(fine, summ, ids, n_sel, NF, L, F, GROUP)
    total = n_sel * C
    n_list = _build_list(src, cand, ids, lst, T, total, L, k, C, GROUP, LIST, SRC_KEYS, HAS_CAND)
    tl.debug_barrier()
    if STATS:  # the list length says which path (d) took
        tl.store(stat, n_list)
    if n_list <= SMALL:  # (d)
        n_out = _finish_registers(src, cand, lst, out, n_list, k, L, SMALL, SRC_KEYS, HAS_CAND, MARK, RADIX)
    elif n_list <= LIST:  # the list streamed
        n_out = _finish_streaming(src, cand, lst, out, T, n_list, k, 1, GROUP, SRC_KEYS, HAS_CAND, MARK)
    else:  # the list overflowed: the selected chunks streamed
        n_out = _finish_streaming(src, cand, ids, out, T, total, k, C, GROUP, SRC_KEYS, HAS_CAND, MARK)
    return n_out


@triton.jit
def _pad(out, n_out, width, PAD: tl.constexpr, MARK: tl.constexpr):
    """-1 after the ``n_out`` positions written, up to the row's ``width`` (positions, not marks)."""
    if not MARK:
        for p in range(0, width, PAD):
            j = p + tl.arange(0, PAD)
            tl.store(out + j, tl.full([PAD], -1, tl.int32), mask=(j >= n_out) & (j < width))


@triton.jit(do_not_specialize=("NF", "NC", "s_fine", "s_coarse"))  # (T and the row strides kept: the loads' vectors)
def _chunk_max_kernel(src, cand, fine, coarse, T, NF, NC, s_src, s_cand, s_fine, s_coarse, C: tl.constexpr,
                      F: tl.constexpr, CHUNKS: tl.constexpr, SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr):
    """Max key of every chunk of C positions (fine), and of every F fine chunks (coarse, F > 1)."""
    wait_inputs()
    _store_chunk_max(src, cand, fine, coarse, T, NF, NC, s_src, s_cand, s_fine, s_coarse, C, F, CHUNKS, SRC_KEYS,
                     HAS_CAND)


@triton.jit
def _store_chunk_max(src, cand, fine, coarse, T, NF, NC, s_src, s_cand, s_fine, s_coarse, C: tl.constexpr,
                     F: tl.constexpr, CHUNKS: tl.constexpr, SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr):
    """Program (row, j) of the chunk-max pass: the maxima of its ``CHUNKS`` fine chunks (and their coarse ones)."""
    r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1) * CHUNKS + tl.arange(0, CHUNKS)
    pos = chunk[:, None] * C + tl.arange(0, C)[None, :]
    cmax = tl.max(_load_keys(src + r * s_src, cand + r * s_cand, pos, pos < T, SRC_KEYS, HAS_CAND), axis=1)
    tl.store(fine + r * s_fine + chunk, cmax, mask=chunk < NF)
    if F > 1:
        up = tl.program_id(1) * (CHUNKS // F) + tl.arange(0, CHUNKS // F)
        tl.store(coarse + r * s_coarse + up, tl.max(tl.reshape(cmax, [CHUNKS // F, F]), axis=1), mask=up < NC)
