"""Attention ops of the contract (:mod:`flashrt.ops`): sparse MQA over selected KV entries, dense
attention, the indexer's scores, the two-level top-k selection, the CSA2 compression pool and a compressor's decode step."""
from __future__ import annotations

import torch

from . import checks as c
from .checks import F32, I32, KV_FORMATS
from .dispatch import impl as _impl
from .formats import QTensor
from .kv.paged import PagedKeys


def _kv_segments(kv, env: dict, device):
    """Check ``kv`` (one ``[B, T, D]`` tensor / QTensor or a tuple of segments, a batch-1 segment
    shared by every row) against ``env``'s B and D; set ``env["T"]`` to the total length."""
    if not isinstance(kv, (tuple, list)):
        c.maybe_quantized("kv", kv, "B T D", env, KV_FORMATS, device)
        return kv
    if not kv:
        raise ValueError("kv: expected at least one segment, got an empty tuple")
    total = 0
    for i, seg in enumerate(kv):
        # a segment with batch 1 is shared by every row (e.g. the HKCP device page pool)
        shared = isinstance(seg, (torch.Tensor, QTensor)) and seg.ndim == 3 and seg.shape[0] == 1
        seg_env = {"B": 1 if shared else env["B"], "D": env["D"]}
        c.maybe_quantized(f"kv[{i}]", seg, "B T D", seg_env, KV_FORMATS, device)
        total += seg_env["T"]
    env["T"] = total
    return tuple(kv)


def sparse_attention(q, kv, indices, sink, scale: float) -> torch.Tensor:
    """MQA over selected entries: ``q [B, S, H, D]``, ``kv [B, T, D]`` plain or ``QTensor``
    (``fp8``/``fp4_b16``/``fp4_b32``), ``indices [B, S, K]`` int32 in ``[-1, T)`` (``-1`` empty,
    order irrelevant), ``sink [H]`` fp32 or None, ``scale`` float -> ``[B, S, H, D]`` ``q.dtype``.

    ``kv`` may also be a tuple of segments ``[B, T_i, D]`` (each plain or QTensor, e.g. the fp8
    window ring, the fp8 chunk and the fp4 compressed cache) standing for their concatenation
    along T (``T = sum T_i``); nothing is concatenated in memory. A segment whose batch dim is 1
    is shared by every row (the HKCP page pool). Likewise ``indices`` may be a tuple of int32
    ``[B, S, K_i]`` standing for their concatenation along K (``K = sum K_i``: a layer's window
    indices and its compressed picks).

    ``l_j = scale * <q, kv[idx_j]>`` over valid slots, ``m = max(max_j l_j, sink)``;
    ``out = sum_j exp(l_j - m) kv[idx_j] / (sum_j exp(l_j - m) + exp(sink - m))``; no valid slot
    and no sink gives zeros. Math in fp32.
    """
    env: dict = {}
    c.tensor("q", q, "B S H D", env, c.FLOATS)
    kv = _kv_segments(kv, env, q.device)
    if isinstance(indices, (tuple, list)):
        if not indices:
            raise ValueError("indices: expected at least one [B, S, K] part, got an empty tuple")
        for i, part in enumerate(indices):
            c.tensor(f"indices[{i}]", part, "B S K", {"B": env["B"], "S": env["S"]}, I32, q.device)
            c.index_range(f"indices[{i}]", part, -1, env["T"])
        indices = tuple(indices)
    else:
        c.tensor("indices", indices, "B S K", env, I32, q.device)
        c.index_range("indices", indices, -1, env["T"])
    if sink is not None:
        c.tensor("sink", sink, "H", env, F32, q.device)
    c.number("scale", scale)
    return _impl("sparse_attention", q.device)(q, kv, indices, sink, float(scale))


def prefix_attention(q, kv, positions, ring_start, window: int, entries, visible, sink, scale: float) -> torch.Tensor:
    """:func:`sparse_attention` of a chunk whose queries each attend to their whole causal window and
    to a prefix of the compressed entries (a prompt chunk while the index top-k takes every visible
    entry): the indices are implied, not passed.

    ``kv`` as for :func:`sparse_attention`, laid out ``[ring (window rows) ‖ chunk (S rows) ‖ ...]``;
    ``positions`` int64 ``[B, S]`` >= 0, each row consecutive; ``ring_start`` int64 ``[B]``;
    ``window`` W >= 1; ``entries`` int32 ``[B, T]`` in ``[-1, total)``: where compressed entry ``j``
    of row ``b`` is in ``kv`` (-1: nowhere), with ``visible`` int32 ``[B, S]`` in ``[0, T]`` (query
    ``(b, s)`` sees entries ``0 .. visible[b, s] - 1``), or both None (window only). Exactly
    ``sparse_attention(q, kv, (window_indices(positions, ring_start[None], W)[0], picks), sink,
    scale)`` with ``picks[b, s, j] = entries[b, j]`` where ``j < visible[b, s]``, else -1.
    """
    env: dict = {}
    c.tensor("q", q, "B S H D", env, c.FLOATS)
    kv = _kv_segments(kv, env, q.device)
    c.tensor("positions", positions, "B S", env, (torch.int64,), q.device)
    c.tensor("ring_start", ring_start, "B", env, (torch.int64,), q.device)
    c.integer("window", window, 1, 2 ** 31 - 1 - env["S"])
    c.index_range("positions", positions, 0, 2 ** 62)
    if (entries is None) != (visible is None):
        raise ValueError("entries, visible: expected both tensors or both None, got "
                         f"{type(entries).__name__} and {type(visible).__name__}")
    if entries is not None:
        c.tensor("entries", entries, "B E", env, I32, q.device)
        c.index_range("entries", entries, -1, env["T"])
        c.tensor("visible", visible, "B S", env, I32, q.device)
        c.index_range("visible", visible, 0, env["E"] + 1)
    if sink is not None:
        c.tensor("sink", sink, "H", env, F32, q.device)
    c.number("scale", scale)
    return _impl("prefix_attention", q.device)(q, kv, positions, ring_start, int(window), entries, visible, sink,
                                               float(scale))


def index_scores(q, k, weights, visible, weight_scale: float = 1.0) -> torch.Tensor:
    """Indexer scores: ``q [B, S, Hi, Di]``, ``k [B, T, Di]`` plain or ``QTensor`` or
    :class:`flashrt.kv.paged.PagedKeys`, ``weights [B, S, Hi]`` float, ``visible [B, S]`` int32 in
    ``[0, T]``, ``weight_scale`` a float -> fp32 ``[B, S, T]``.

    With ``w = weights.to(fp32) * weight_scale`` (an fp32 product, as torch computes it),
    ``score[b,s,t] = sum_h relu(<q[b,s,h], k[b,t]>) * w[b,s,h]`` for ``t < visible[b,s]``,
    else ``-inf``. Math in fp32.

    Paged ``k`` (HKCP index K): ``PagedKeys(pool, block_table, page_size, length)`` with ``pool``
    ``[1, pages * page_size, Di]`` (plain or QTensor), ``block_table`` int32 ``[B, max_pages]``
    in ``[0, pages)`` and ``T = length``; ``k[b, t]`` is pool row
    ``block_table[b, t // page_size] * page_size + t % page_size``. Backends read the rows in
    place (no gathered copy of the keys, except as a fallback).
    """
    env: dict = {}
    c.tensor("q", q, "B S Hi Di", env, c.FLOATS)
    if isinstance(k, PagedKeys):
        c.paged_keys("k", k, "B T Di", env, KV_FORMATS, q.device)
    else:
        c.maybe_quantized("k", k, "B T Di", env, KV_FORMATS, q.device)
    c.tensor("weights", weights, "B S Hi", env, c.FLOATS, q.device)
    c.tensor("visible", visible, "B S", env, I32, q.device)
    c.number("weight_scale", weight_scale)
    c.index_range("visible", visible, 0, env["T"] + 1)
    return _impl("index_scores", q.device)(q, k, weights, visible, float(weight_scale))


def topk_positions(scores, k: int, candidates=None) -> torch.Tensor:
    """``scores [B, S, T]`` fp32, ``k >= 1``, ``candidates [B, S, T]`` bool or None ->
    int32 ``[B, S, min(k, T)]``.

    The positions of the ``k`` largest finite scores of each row (only where ``candidates``, when
    given), in ascending position order, then ``-1`` for each pick left over. Ties between equal
    scores go to the lower position.
    """
    env: dict = {}
    c.tensor("scores", scores, "B S T", env, F32)
    c.integer("k", k, 1)
    if candidates is not None:
        c.tensor("candidates", candidates, "B S T", env, (torch.bool,), scores.device)
    return _impl("topk_positions", scores.device)(scores, k, candidates)


def candidate_blocks(scores, visible, topk_blocks: int, block_size: int) -> torch.Tensor:
    """First level of the two-level top-k: ``scores [B, S, T]`` fp32, ``visible [B, S]`` int32 in
    ``[0, T]`` -> bool ``[B, S, T]``.

    Blocks of ``block_size`` consecutive positions (the last one may be partial) are scored by
    the max of their finite scores. The block holding position ``visible - 1`` (when
    ``visible > 0``) is pinned: it is always kept and counts as one of the ``topk_blocks``, as in
    the published model. The remaining picks go to the best blocks whose score is finite (ties to
    the lower block). Every position of a kept block is marked.
    """
    env: dict = {}
    c.tensor("scores", scores, "B S T", env, F32)
    c.tensor("visible", visible, "B S", env, I32, scores.device)
    c.integer("topk_blocks", topk_blocks, 1)
    c.integer("block_size", block_size, 1)
    c.index_range("visible", visible, 0, env["T"] + 1)
    return _impl("candidate_blocks", scores.device)(scores, visible, topk_blocks, block_size)


def compress_pool(kv, score) -> torch.Tensor:
    """CSA2 compression: ``kv, score [B, G, r, D]`` fp32 -> fp32 ``[B, G, D]``,
    per channel ``sum_r softmax_r(score) * kv``."""
    env: dict = {}
    c.tensor("kv", kv, "B G r D", env, F32)
    c.tensor("score", score, "B G r D", env, F32, kv.device)
    return _impl("compress_pool", kv.device)(kv, score)


def compress_decode(kv, score, kv_state, score_state, positions, weight, eps: float, dtype: torch.dtype):
    """A compressor's decode step (one token per row) in one op: the token's projections enter the
    row's pending group, the group is pooled and normalised.

    ``kv, score`` fp32 ``[B, D]`` (the token's ``wkv`` and ``wgate`` rows), ``kv_state,
    score_state`` fp32 ``[B, r, D]`` with ``r >= 2`` (the pending groups, **written in place**:
    row ``b``'s slot ``positions[b] % r`` takes ``kv[b]`` and ``score[b]``), ``positions`` int64
    ``[B]`` >= 0, ``weight [D]`` float, ``eps >= 0``, ``dtype`` a float dtype ->
    ``(latent, entry, mask)``: ``latent [B, 1, D]`` ``dtype`` =
    ``rms_norm(compress_pool(kv_state, score_state).to(dtype), weight, eps)`` over the updated
    state (every slot, complete or not), ``entry`` int64 ``[B, 1]`` = ``(positions + 1) // r - 1``
    (the group's index) and ``mask`` bool ``[B, 1]`` = ``(positions + 1) % r == 0`` (the group is
    complete: only then is the entry meaningful)."""
    env: dict = {}
    c.tensor("kv", kv, "B D", env, F32)
    c.tensor("score", score, "B D", env, F32, kv.device)
    c.tensor("kv_state", kv_state, "B r D", env, F32, kv.device)
    c.tensor("score_state", score_state, "B r D", env, F32, kv.device)
    if env["r"] < 2:
        raise ValueError(f"kv_state: expected r >= 2 slots a group, got shape {tuple(kv_state.shape)}")
    c.tensor("positions", positions, "B", env, (torch.int64,), kv.device)
    c.tensor("weight", weight, "D", env, c.FLOATS, kv.device)
    c.number("eps", eps, 0.0)
    c.choice("dtype", dtype, c.FLOATS)
    c.index_range("positions", positions, 0, 2 ** 62)
    return _impl("compress_decode", kv.device)(kv, score, kv_state, score_state, positions, weight, float(eps), dtype)


def dense_attention(q, k, v, scale: float) -> torch.Tensor:
    """Bidirectional attention (every query sees every key; e.g. the ViT over an image's patches):
    ``q [B, S, H, D]``, ``k, v [B, T, H, D]`` (``T >= 1``), all one float dtype, ``scale`` float
    -> ``[B, S, H, D]`` ``q.dtype``.

    ``out[b, s, h] = sum_t softmax_t(scale * <q[b, s, h], k[b, t, h]>) v[b, t, h]``. Math in fp32.
    """
    env: dict = {}
    c.tensor("q", q, "B S H D", env, c.FLOATS)
    c.tensor("k", k, "B T H D", env, c.FLOATS, q.device)
    c.tensor("v", v, "B T H D", env, c.FLOATS, q.device)
    c.same_dtype("k", k, q.dtype)
    c.same_dtype("v", v, q.dtype)
    if env["T"] < 1:
        raise ValueError(f"k: expected at least one key (T >= 1), got shape {tuple(k.shape)}")
    c.number("scale", scale)
    return _impl("dense_attention", q.device)(q, k, v, float(scale))
