"""``topk_positions`` as a threshold select (no sort), and the row-select driver ``select_rows``
that ``candidate_blocks`` reuses.

Scores become int32 keys whose signed order is the float order (``-0.0`` as ``+0.0``; NaN, +-inf
and non-candidates -> ``INT32_MIN``, below every finite key). Per row:

1. ``_chunk_max_kernel`` (many programs per row, one read of the row): the max key of every chunk
   of ``C`` positions, ``C`` = the smallest power of two with ``T / C <= TILES summary``. With
   ``C == 1`` this pass is skipped and the keys themselves are the summary.
2. ``_select_kernel`` (one program per row):
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
import triton
import triton.language as tl
from flashrt import profiles
from flashrt.kernels_cuda.launch import cdiv, next_pow2
from flashrt.kernels_cuda import _warmup

TILES = {
    "chunk_max": {"block": 2048, "num_warps": 4},
    # summary: most chunk maxima (held in registers); bits: exact top bits of L (32: exact; fewer:
    # a cheaper search, a lower L, longer lists); fine: largest chunk scanned for keys above L
    # (longer summary chunks are split into fine ones); small: longest list selected in registers
    # (at least 2k); list: longest list kept (streamed from L2 when longer than small; past it the
    # chunks are streamed); group: elements per step of the scanning and streaming loops
    "select": {"summary": 4096, "bits": 32, "fine": 16, "small": 1024, "list": 8192, "group": 2048,
               "num_warps": 8},
}


def _tiles() -> dict:
    """TILES with the active hardware profile's overrides (``tiles.topk`` in its YAML)."""
    return profiles.tiles("topk", TILES)
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
def _kth_largest(keys, k, BITS: tl.constexpr):
    """The k-th largest of ``keys`` (MIN when fewer than k exceed MIN), its top ``BITS`` bits
    exact and the rest zero (a lower bound when BITS < 32)."""
    ans = 0  # unsigned bit pattern of the answer, built from the top bit down
    bit = tl.full([], _MIN, tl.int32)
    for i in range(BITS):
        cand = ans | bit
        ans = tl.where(tl.sum((keys >= (cand ^ _MIN)).to(tl.int32)) >= k, cand, ans)
        bit = (bit >> 1) & 0x7FFFFFFF
    return ans ^ _MIN


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
def _finish_registers(src, cand, lst, out, n_list, k, BLOCK: tl.constexpr,
                      SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr, MARK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    live = offs < n_list
    pos = tl.load(lst + offs, mask=live, other=0)
    key = _load_keys(src, cand, pos, live, SRC_KEYS, HAS_CAND)
    thr = _kth_largest(key, k, 32)
    need = k - tl.sum((key > thr).to(tl.int32))
    n_out, _ = _emit(key, pos, thr, need, 0, 0, out, MARK)
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
                  SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr):
    """(a) ``L`` and (b) the ids of the chunks whose max is ``>= L`` written to ``ids``; (L, count)."""
    offs = tl.arange(0, SUMMARY)
    if C == 1:  # the keys are their own summary
        cmax = _load_keys(src, cand, offs, offs < T, SRC_KEYS, HAS_CAND)
    else:
        cmax = tl.load(summ + offs, mask=offs < NC, other=_MIN)
    L = _kth_largest(cmax, k, BITS)
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


@triton.jit
def _select_kernel(src, cand, summ, fine, fids, lst, out, stats, T, NC, NF, k, width,
                   s_src, s_cand, s_summ, s_fine, s_lst, s_out,
                   C: tl.constexpr, F: tl.constexpr, SUMMARY: tl.constexpr, BITS: tl.constexpr,
                   LIST: tl.constexpr, SMALL: tl.constexpr, GROUP: tl.constexpr, PAD: tl.constexpr,
                   SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr, MARK: tl.constexpr,
                   STATS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    src += r * s_src
    cand += r * s_cand
    summ += r * s_summ
    lst += r * s_lst
    out += r * s_out
    L, n_sel = _chunks_above(src, cand, summ, summ, T, NC, k, C * F, SUMMARY, BITS, SRC_KEYS, HAS_CAND)
    ids = summ  # coarse chunk ids, written over the summary
    if F > 1:  # two-level summary: narrow the coarse chunks down to fine ones
        ids = fids + r * s_fine
        n_sel = _fine_chunks(fine + r * s_fine, summ, ids, n_sel, NF, L, F, GROUP)
    total = n_sel * C
    n_list = _build_list(src, cand, ids, lst, T, total, L, k, C, GROUP, LIST, SRC_KEYS, HAS_CAND)
    tl.debug_barrier()
    if STATS:  # the list length says which path (d) took
        tl.store(stats + r, n_list)
    if n_list <= SMALL:  # (d)
        n_out = _finish_registers(src, cand, lst, out, n_list, k, SMALL, SRC_KEYS, HAS_CAND, MARK)
    elif n_list <= LIST:  # the list streamed
        n_out = _finish_streaming(src, cand, lst, out, T, n_list, k, 1, GROUP, SRC_KEYS, HAS_CAND, MARK)
    else:  # the list overflowed: the selected chunks streamed
        n_out = _finish_streaming(src, cand, ids, out, T, total, k, C, GROUP, SRC_KEYS, HAS_CAND, MARK)
    if not MARK:
        for p in range(0, width, PAD):
            j = p + tl.arange(0, PAD)
            tl.store(out + j, tl.full([PAD], -1, tl.int32), mask=(j >= n_out) & (j < width))


@triton.jit
def _chunk_max_kernel(src, cand, fine, coarse, T, NF, NC, s_src, s_cand, s_fine, s_coarse, C: tl.constexpr,
                      F: tl.constexpr, CHUNKS: tl.constexpr, SRC_KEYS: tl.constexpr, HAS_CAND: tl.constexpr):
    """Max key of every chunk of C positions (fine), and of every F fine chunks (coarse, F > 1)."""
    r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1) * CHUNKS + tl.arange(0, CHUNKS)
    pos = chunk[:, None] * C + tl.arange(0, C)[None, :]
    cmax = tl.max(_load_keys(src + r * s_src, cand + r * s_cand, pos, pos < T, SRC_KEYS, HAS_CAND), axis=1)
    tl.store(fine + r * s_fine + chunk, cmax, mask=chunk < NF)
    if F > 1:
        up = tl.program_id(1) * (CHUNKS // F) + tl.arange(0, CHUNKS // F)
        tl.store(coarse + r * s_coarse + up, tl.max(tl.reshape(cmax, [CHUNKS // F, F]), axis=1), mask=up < NC)


def _pow2(n: int) -> int:
    return next_pow2(max(1, int(n)))


def select_rows(src: torch.Tensor, cand, k: int, out: torch.Tensor, mark: bool = False, stats=None) -> None:
    """Top-``k`` of every row of ``src`` ([R, T]: fp32 scores, or int32 keys as made by ``_keys``),
    only where ``cand`` ([R, T] uint8, or None) is nonzero, ties to the lower position.

    ``mark=False``: ``out`` int32 [R, >= k] gets the positions ascending, then -1 up to its width.
    ``mark=True``: ``out`` uint8 [R, T], zero on entry, gets 1 at every pick.
    ``stats``: int32 [R] or None; gets each row's list length (tests and tuning: longer than the
    register block ``max(TILES small, 2k)`` means the list was streamed, than ``TILES list`` that
    the chunks were).
    """
    R, T = src.shape
    assert src.stride(1) == 1 and (cand is None or (cand.stride(1) == 1 and cand.shape == src.shape))
    assert src.dtype in (torch.float32, torch.int32) and out.stride(1) == 1 and 1 <= k <= T
    tiles, chunk_tiles = _tiles()["select"], _tiles()["chunk_max"]
    coarse = _pow2(cdiv(T, tiles["summary"]))  # chunk size of the summary searched for L
    C = min(coarse, tiles["fine"])  # chunk size of the scan; F fine chunks per coarse chunk
    F, NC, NF = coarse // C, cdiv(T, coarse), cdiv(T, C)
    has_cand, src_keys = cand is not None, src.dtype == torch.int32
    cand_t = cand if has_cand else src
    summ = torch.empty(R, NC, dtype=torch.int32, device=src.device)  # coarse maxima, then their ids
    fine = torch.empty(R, NF, dtype=torch.int32, device=src.device) if F > 1 else summ
    fids = torch.empty(R, NF, dtype=torch.int32, device=src.device) if F > 1 else summ
    if coarse > 1:
        chunks = max(chunk_tiles["block"], coarse) // C
        _chunk_max_kernel[(R, cdiv(NF, chunks))](
            src, cand_t, fine, summ, T, NF, NC, src.stride(0), cand_t.stride(0), fine.stride(0), summ.stride(0),
            C=C, F=F, CHUNKS=chunks, SRC_KEYS=src_keys, HAS_CAND=has_cand, num_warps=chunk_tiles["num_warps"])
    LIST = min(tiles["list"], _pow2((k - 1) * C * F + k))
    small = min(max(tiles["small"], _pow2(2 * k)), LIST)  # a list of k + k ties stays in registers
    lst = torch.empty(R, LIST, dtype=torch.int32, device=src.device)
    width = 0 if mark else out.shape[1]
    _select_kernel[(R,)](src, cand_t, summ, fine, fids, lst, out, stats if stats is not None else summ, T, NC, NF,
                         k, width, src.stride(0), cand_t.stride(0), summ.stride(0), fine.stride(0), lst.stride(0),
                         out.stride(0), C=C, F=F, SUMMARY=_pow2(NC), BITS=tiles["bits"], LIST=LIST, SMALL=small,
                         GROUP=max(C * F, tiles["group"]), PAD=min(1024, _pow2(width)), SRC_KEYS=src_keys,
                         HAS_CAND=has_cand, MARK=mark, STATS=stats is not None, num_warps=tiles["num_warps"])


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
    select_rows(src, cand, width, out.view(B * S, width))
    return out


def supports_topk(scores, k, candidates=None) -> bool:
    return scores.dim() == 3 and scores.shape[-1] < 2**30 and scores.dtype == torch.float32


def warmup_cases(device, d: dict, dtype):
    """topk_positions over a step's index scores, with and without candidate blocks."""
    for n in _warmup.TOKENS:
        for T in _warmup.CONTEXTS:
            scores, k = torch.randn(1, n, T, device=device), min(d["index_topk"], T)
            yield _warmup.Launch("topk_positions", topk_positions, (scores, k, None))
            cand = torch.rand(1, n, T, device=device) < 0.5
            yield _warmup.Launch("topk_positions candidates", topk_positions, (scores, k, cand))


def warmup(profile) -> dict:
    """Compile this module's kernels for the shipped models' shapes (``flashrt jit warmup``)."""
    return _warmup.run(warmup_cases, profile)


OPS = {"topk_positions": topk_positions}
SUPPORTS = {"topk_positions": supports_topk}
