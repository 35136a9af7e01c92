"""Reference math of the attention ops: ``sparse_attention``, ``dense_attention``, the indexer's
``index_scores`` and the top-k selection (``topk_positions``, ``candidate_blocks``), with the row
gather of KV entries (plain, quantized or segmented) they read through.

Large intermediates are chunked over query positions so that the math stays usable on realistic
shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import formats
from .formats import QTensor
from .kv.paged import PagedKeys
from .refmath_kv import window_indices
from .refmath_wide import row_sum, wide

CHUNK_BYTES = 256 << 20  # cap on one fp32 intermediate


def _chunk(rows: int, bytes_per_row: int) -> int:
    return max(1, min(rows, CHUNK_BYTES // max(1, bytes_per_row)))


def _float(t) -> torch.Tensor:
    return formats.dequantize(t) if isinstance(t, QTensor) else t.to(torch.float32)


def gather_rows(kv, idx):
    """kv [B, T, D] (plain, QTensor or a tuple of segments), idx [B, ...] int64 -> fp32 [B, ..., D]."""
    if isinstance(kv, tuple):
        out, offset = None, 0
        for seg in kv:
            n = seg.shape[1]
            local = idx - offset
            mine = (local >= 0) & (local < n)
            if n and bool(mine.any()):
                rows = gather_rows(seg, local.clamp(0, n - 1))
                out = rows * mine.unsqueeze(-1) if out is None else torch.where(mine.unsqueeze(-1), rows, out)
            offset += n
        return out if out is not None else torch.zeros(*idx.shape, kv[0].shape[-1], device=idx.device)
    if isinstance(kv, QTensor):
        return formats.dequantize_rows(kv, idx)
    batch = torch.arange(kv.shape[0], device=idx.device).view(-1, *([1] * (idx.dim() - 1)))
    return kv[batch, idx].to(torch.float32)


def sparse_attention(q, kv, indices, sink, scale):
    B, S, H, D = q.shape
    if isinstance(indices, tuple):  # parts standing for their concatenation along K
        indices = torch.cat(indices, dim=-1)
    K = indices.shape[-1]
    T = sum(seg.shape[1] for seg in kv) if isinstance(kv, tuple) else kv.shape[1]
    if T == 0:  # empty cache (T == 0): every slot is -1, nothing to gather
        return torch.zeros_like(q)
    out = torch.empty_like(q)
    step = _chunk(S, B * K * D * 12 + B * H * K * 16)
    for s0 in range(0, S, step):
        idx = indices[:, s0 : s0 + step]
        valid = (idx >= 0).unsqueeze(2)  # [B, s, 1, K]
        # the two products accumulate wide: a head's (and a position's) bits do not depend on how
        # many heads the call has (a tensor-parallel rank has n_heads / tp) or positions
        rows = wide(gather_rows(kv, idx.clamp_min(0).long()))  # [B, s, K, D]
        qw = wide(q[:, s0 : s0 + step])
        logits = torch.einsum("bshd,bskd->bshk", qw, rows).to(torch.float32) * scale
        logits = logits.masked_fill(~valid, float("-inf"))
        # [B, s, H]; K == 0 (no slot at all) has no max to take: -inf, as for all-empty rows
        m = logits.amax(-1) if K else logits.new_full(logits.shape[:-1], float("-inf"))
        if sink is not None:
            m = torch.maximum(m, sink)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(logits - m.unsqueeze(-1))
        denom = row_sum(p)
        if sink is not None:
            denom = denom + torch.exp(sink - m)
        o = torch.einsum("bshk,bskd->bshd", wide(p), rows).to(torch.float32) / denom.clamp_min(1e-38).unsqueeze(-1)
        out[:, s0 : s0 + step] = torch.where(denom.unsqueeze(-1) > 0, o, torch.zeros_like(o)).to(q.dtype)
    return out


def prefix_indices(positions, ring_start, window, entries, visible):
    """The indices :func:`prefix_attention` implies: (window indices ``[B, S, W]``, picks
    ``[B, S, T]``) or the window indices alone (``entries`` None)."""
    idx = window_indices(positions, ring_start.view(1, -1), window)[0]
    if entries is None:
        return idx
    j = torch.arange(entries.shape[-1], device=entries.device)
    picks = torch.where(j < visible.unsqueeze(-1), entries.unsqueeze(1), -1).to(torch.int32)
    return idx, picks


def prefix_attention(q, kv, positions, ring_start, window, entries, visible, sink, scale):
    return sparse_attention(q, kv, prefix_indices(positions, ring_start, window, entries, visible), sink, scale)


def index_scores(q, k, weights, visible, weight_scale=1.0):
    B, S, Hi, _ = q.shape
    if weights.dtype != torch.float32 or weight_scale != 1.0:
        weights = weights.to(torch.float32) * weight_scale
    T = k.shape[1]
    kf = _float(k.gather() if isinstance(k, PagedKeys) else k)  # paged keys: gather, then the same math
    out = torch.empty(B, S, T, dtype=torch.float32, device=q.device)
    step = _chunk(S, B * Hi * T * 4)
    for s0 in range(0, S, step):
        dots = torch.einsum("bshd,btd->bsht", q[:, s0 : s0 + step].to(torch.float32), kf)
        out[:, s0 : s0 + step] = (dots.relu() * weights[:, s0 : s0 + step].unsqueeze(-1)).sum(2)
    hidden = torch.arange(T, device=q.device) >= visible.unsqueeze(-1)
    return out.masked_fill(hidden, float("-inf"))


def top_order(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the last dim, ties to the lower index."""
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]


def topk_positions(scores, k, candidates):
    T = scores.shape[-1]
    valid = torch.isfinite(scores)
    if candidates is not None:
        valid &= candidates
    order = top_order(torch.where(valid, scores, float("-inf")), min(k, T))
    pos = torch.where(valid.gather(-1, order), order, T)
    pos = torch.sort(pos, dim=-1).values
    return torch.where(pos == T, -1, pos).to(torch.int32)


def block_scores(scores, visible, block_size):
    """(block maxima of the finite scores [B, S, nb] with the block of ``visible - 1`` at +inf,
    that pinned mask). ``scores`` [B, S, T] with T > 0."""
    B, S, T = scores.shape
    nb = -(-T // block_size)
    s = torch.where(torch.isfinite(scores), scores, float("-inf"))
    s = F.pad(s, (0, nb * block_size - T), value=float("-inf"))
    blocks = s.view(B, S, nb, block_size).amax(-1)  # [B, S, nb]
    last = ((visible.long() - 1).clamp_min(0) // block_size).unsqueeze(-1)
    pinned = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, last, True) & (visible > 0).unsqueeze(-1)
    return blocks.masked_fill(pinned, float("inf")), pinned


def candidate_blocks(scores, visible, topk_blocks, block_size):
    T = scores.shape[-1]
    if T == 0:  # no positions, no blocks (visible is 0)
        return torch.zeros_like(scores, dtype=torch.bool)
    blocks, pinned = block_scores(scores, visible, block_size)
    nb = blocks.shape[-1]
    order = top_order(blocks, min(topk_blocks, nb))
    keep = torch.zeros_like(pinned).scatter_(-1, order, torch.isfinite(blocks.gather(-1, order)) | pinned.gather(-1, order))
    return keep.repeat_interleave(block_size, -1)[..., :T]


def dense_attention(q, k, v, scale):
    """Softmax over every key in fp32, chunked over query positions."""
    B, S, H, D = q.shape
    T = k.shape[1]
    kf, vf = k.to(torch.float32).transpose(1, 2), v.to(torch.float32).transpose(1, 2)  # [B, H, T, D]
    out = torch.empty_like(q)
    step = _chunk(S, B * H * T * 4)
    for s0 in range(0, S, step):
        qf = q[:, s0:s0 + step].to(torch.float32).transpose(1, 2)  # [B, H, s, D]
        p = torch.softmax(torch.matmul(qf, kf.transpose(-1, -2)) * scale, dim=-1)
        out[:, s0:s0 + step] = torch.matmul(p, vf).transpose(1, 2).to(q.dtype)
    return out
