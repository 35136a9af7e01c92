"""The semantics of record: every op of the contract (:mod:`flashrt.ops`) in plain torch, on any device.

The reference backend (``flashrt.backends.reference``) binds these functions as its ops; backend
adapters that fall back to plain torch on their device (``flashrt.kernels_ascend``) call them too,
so both share one implementation. Inputs arrive validated by :mod:`flashrt.ops`. Math runs in
fp32; large intermediates are chunked over query positions so that the math stays usable on
realistic shapes.

GEMMs, last-dim sums and the transcendental pointwise functions are evaluated wide (fp64 on CPU and
CUDA) and rounded to fp32, so that a row (a position, a head) gets the same bits whatever the other
rows of the call: a one-token decode step, a speculative verify chunk, a prefill and a
tensor-parallel rank's share of the heads agree bit for bit.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from . import formats
from .formats import QTensor
from .kv.paged import PagedKeys

CHUNK_BYTES = 256 << 20  # cap on one fp32 intermediate


def _chunk(rows: int, bytes_per_row: int) -> int:
    return max(1, min(rows, CHUNK_BYTES // max(1, bytes_per_row)))


# A GEMM's blocking depends on how many rows it has, so in fp32 one row rounds differently in a
# one-token step and in a chunk (a verify step, a prefill). Accumulating in fp64 and rounding to
# fp32 gives each row the same fp32 result whatever the other rows of the call (up to exact
# rounding ties): decode steps, verify chunks and prefills agree bit for bit. Devices without
# fast fp64 (NPUs) keep fp32.
_WIDE_DEVICES = ("cpu", "cuda")


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64) if t.device.type in _WIDE_DEVICES else t.to(torch.float32)


def _linear_wide(x, weight) -> torch.Tensor:
    """``x @ weight.T`` accumulated wide (fp64 where :data:`_WIDE_DEVICES`), not rounded."""
    return F.linear(_wide(x), _wide(weight))


def _linear32(x, weight) -> torch.Tensor:
    """``x @ weight.T`` of fp32-valued operands -> fp32, each row independent of the others."""
    return _linear_wide(x, weight).to(torch.float32)


def _row_sum(t: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dim, the same for a row whatever the other rows (a reduction's
    vectorization, and so its order, depends on the tensor's shape)."""
    return _wide(t).sum(-1).to(torch.float32)


def _mean_sq(t: torch.Tensor) -> torch.Tensor:
    """``mean(t ** 2)`` over the last dim (kept), row-invariant as :func:`_row_sum`."""
    return (_wide(t).pow(2).sum(-1, keepdim=True) / t.shape[-1]).to(torch.float32)


def _pointwise(fn, t: torch.Tensor) -> torch.Tensor:
    """``fn(t)`` -> fp32, the same for an element wherever it sits in the tensor: CPU kernels run a
    transcendental function (sigmoid, silu, softplus) vectorized over a tensor's body and scalar
    over its tail, which round differently; evaluated wide and rounded to fp32 they agree."""
    return fn(_wide(t)).to(torch.float32)


def _float(t) -> torch.Tensor:
    return formats.dequantize(t) if isinstance(t, QTensor) else t.to(torch.float32)


def rms_norm(x, weight, eps):
    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(_mean_sq(xf) + eps) * weight.to(torch.float32)
    return y.to(x.dtype)


def rope(x, freqs_cis, inverse):
    rot = 2 * freqs_cis.shape[-1]
    if rot < x.shape[-1]:  # the last 2P channels rotate, the rest is copied
        return torch.cat([x[..., :-rot], rope(x[..., -rot:], freqs_cis, inverse)], dim=-1)
    # contiguous: view_as_complex needs even strides, which a sliced x (e.g. q[..., -R:]) may lack
    xc = torch.view_as_complex(x.to(torch.float32).contiguous().reshape(*x.shape[:-1], x.shape[-1] // 2, 2))
    f = freqs_cis.conj() if inverse else freqs_cis
    if x.dim() == 4:  # [B, S, H, R/2]: broadcast over heads
        f = f.unsqueeze(-2)
    return torch.view_as_real(xc * f).flatten(-2).to(x.dtype)


def quantize(x, fmt):
    return formats.quantize(x, fmt)


def dequantize(q, dtype):
    return formats.dequantize(q, dtype)


_WEIGHT_CACHE: dict[int, tuple] = {}  # id(data) -> (weakref(data), scale, shape, fp32 values)


def dequantized_weight(w: QTensor) -> torch.Tensor:
    """fp32 values of a quantized weight, kept while its storage lives (weights are immutable)."""
    key = id(w.data)
    hit = _WEIGHT_CACHE.get(key)
    if hit is None or hit[0]() is not w.data or hit[1] is not w.scale or hit[2] != tuple(w.shape):
        hit = (weakref.ref(w.data), w.scale, tuple(w.shape), formats.dequantize(w))
        _WEIGHT_CACHE[key] = hit
        weakref.finalize(w.data, _WEIGHT_CACHE.pop, key, None)
    return hit[3]


def activation_format(weight: QTensor) -> str:
    """What a quantized weight's input is quantized to: per-token int8 for ``int8_w``, else fp8."""
    return "int8_t" if weight.fmt == "int8_w" else "fp8"


def _linear_acc(x, weight) -> torch.Tensor:
    """``x @ weight.T`` accumulated wide, not rounded (fp8 activations for QTensor weights)."""
    if isinstance(weight, QTensor):
        xq = formats.dequantize(formats.quantize(x, activation_format(weight)))
        return _linear_wide(xq, dequantized_weight(weight))
    return _linear_wide(x, weight)


def linear_fp32(x, weight) -> torch.Tensor:
    """``x @ weight.T`` rounded once to fp32 from the wide accumulation (fp8 activations for
    QTensor weights)."""
    return _linear_acc(x, weight).to(torch.float32)


def linear(x, weight):
    """``linear_fp32`` in ``x.dtype``; an fp64 ``x`` gets the wide accumulation itself, not rounded
    to fp32: partial sums that tensor-parallel ranks add up (in fp64) and round once, as one
    process's whole sum is rounded."""
    if x.dtype == torch.float64:
        return _linear_acc(x, weight).to(torch.float64)
    return linear_fp32(x, weight).to(x.dtype)


def _gather_rows(kv, idx):
    """kv [B, T, D] (plain, QTensor or a tuple of segments), idx [B, ...] int64 -> fp32 [B, ..., D]."""
    if isinstance(kv, tuple):
        out, offset = None, 0
        for seg in kv:
            n = seg.shape[1]
            local = idx - offset
            mine = (local >= 0) & (local < n)
            if n and bool(mine.any()):
                rows = _gather_rows(seg, local.clamp(0, n - 1))
                out = rows * mine.unsqueeze(-1) if out is None else torch.where(mine.unsqueeze(-1), rows, out)
            offset += n
        return out if out is not None else torch.zeros(*idx.shape, kv[0].shape[-1], device=idx.device)
    if isinstance(kv, QTensor):
        return formats.dequantize_rows(kv, idx)
    batch = torch.arange(kv.shape[0], device=idx.device).view(-1, *([1] * (idx.dim() - 1)))
    return kv[batch, idx].to(torch.float32)


def sparse_attention(q, kv, indices, sink, scale):
    B, S, H, D = q.shape
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
        rows = _wide(_gather_rows(kv, idx.clamp_min(0).long()))  # [B, s, K, D]
        qw = _wide(q[:, s0 : s0 + step])
        logits = torch.einsum("bshd,bskd->bshk", qw, rows).to(torch.float32) * scale
        logits = logits.masked_fill(~valid, float("-inf"))
        # [B, s, H]; K == 0 (no slot at all) has no max to take: -inf, as for all-empty rows
        m = logits.amax(-1) if K else logits.new_full(logits.shape[:-1], float("-inf"))
        if sink is not None:
            m = torch.maximum(m, sink)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(logits - m.unsqueeze(-1))
        denom = _row_sum(p)
        if sink is not None:
            denom = denom + torch.exp(sink - m)
        o = torch.einsum("bshk,bskd->bshd", _wide(p), rows).to(torch.float32) / denom.clamp_min(1e-38).unsqueeze(-1)
        out[:, s0 : s0 + step] = torch.where(denom.unsqueeze(-1) > 0, o, torch.zeros_like(o)).to(q.dtype)
    return out


def index_scores(q, k, weights, visible):
    B, S, Hi, _ = q.shape
    T = k.shape[1]
    kf = _float(k.gather() if isinstance(k, PagedKeys) else k)  # paged keys: gather, then the same math
    out = torch.empty(B, S, T, dtype=torch.float32, device=q.device)
    step = _chunk(S, B * Hi * T * 4)
    for s0 in range(0, S, step):
        dots = torch.einsum("bshd,btd->bsht", q[:, s0 : s0 + step].to(torch.float32), kf)
        out[:, s0 : s0 + step] = (dots.relu() * weights[:, s0 : s0 + step].unsqueeze(-1)).sum(2)
    hidden = torch.arange(T, device=q.device) >= visible.unsqueeze(-1)
    return out.masked_fill(hidden, float("-inf"))


def _top_order(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the last dim, ties to the lower index."""
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]


def topk_positions(scores, k, candidates):
    T = scores.shape[-1]
    valid = torch.isfinite(scores)
    if candidates is not None:
        valid &= candidates
    order = _top_order(torch.where(valid, scores, float("-inf")), min(k, T))
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
    order = _top_order(blocks, min(topk_blocks, nb))
    keep = torch.zeros_like(pinned).scatter_(-1, order, torch.isfinite(blocks.gather(-1, order)) | pinned.gather(-1, order))
    return keep.repeat_interleave(block_size, -1)[..., :T]


def compress_pool(kv, score):
    return (torch.softmax(score, dim=2) * kv).sum(2)


def hc_coefficients(x, fn, scale, base, iters, eps, norm_eps):
    B, S, hc, _ = x.shape
    v = x.to(torch.float32).flatten(2)
    m = _linear32(v, fn) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm_eps)
    pre = _pointwise(torch.sigmoid, m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * _pointwise(torch.sigmoid, m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).view(B, S, hc, hc)
    comb = torch.softmax(comb, -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse(x, pre):
    return (pre.unsqueeze(-1) * x.to(torch.float32)).sum(2).to(x.dtype)


def hc_expand(y, residual, post, comb):
    mixed = torch.einsum("bsjk,bsjd->bskd", comb, residual.to(torch.float32))
    return (post.unsqueeze(-1) * y.to(torch.float32).unsqueeze(2) + mixed).to(y.dtype)


def engram_lookup(table, ids):
    return formats.dequantize_rows(table, ids, torch.bfloat16)


def engram_gate(h, key, value, weight, eps):
    hf, kf = h.to(torch.float32), key.to(torch.float32)
    r = torch.rsqrt(_mean_sq(hf)[..., 0] + eps) * torch.rsqrt(_mean_sq(kf)[..., 0] + eps)
    d = _row_sum(hf * weight.to(torch.float32) * kf) * r / math.sqrt(h.shape[-1])
    g = _pointwise(torch.sigmoid, torch.copysign(d.abs().clamp_min(1e-6).sqrt(), d))
    return (hf + g.unsqueeze(-1) * value.to(torch.float32).unsqueeze(2)).to(h.dtype)


_SCORE = {
    "softmax": lambda z: torch.softmax(z, -1),
    "sigmoid": lambda z: _pointwise(torch.sigmoid, z),
    "sqrtsoftplus": lambda z: _pointwise(F.softplus, z).sqrt(),
}


def engram_hash(seq, multipliers, primes, offsets, pad):
    N, H = multipliers.shape[1], primes.shape[1] // (multipliers.shape[1] - 1)
    S = seq.shape[1] - (N - 1)
    blocked = torch.zeros(seq.shape[0], S, dtype=torch.bool, device=seq.device)
    rolling, cols = None, []
    for shift in range(N):  # shift: the token ``shift`` positions back; DEAD there or newer blocks it
        src = seq[:, N - 1 - shift: N - 1 - shift + S]
        blocked = blocked | (src == -1)
        prod = torch.where(blocked, pad, src).unsqueeze(-1) * multipliers[:, shift]  # [B, S, L], wraps
        rolling = prod if rolling is None else torch.bitwise_xor(rolling, prod)
        if shift:
            cols.append(rolling.unsqueeze(-1).expand(-1, -1, -1, H))
    return torch.remainder(torch.cat(cols, dim=-1), primes) + offsets


def moe_route(x, weight, bias, topk, score_func, norm_topk, route_scale):
    s = _SCORE[score_func](_linear32(x, weight))
    indices = _top_order(s if bias is None else s + bias, topk)
    w = s.gather(-1, indices)
    if norm_topk and topk > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * route_scale, indices.to(torch.int32)


def _project(x, w, e: int) -> torch.Tensor:
    """``linear(x, w[e])`` of a stacked [E, out, in] weight, in ``x.dtype``."""
    if isinstance(w, QTensor):  # fp8 activations, as linear() does for a quantized weight
        xq = formats.dequantize(formats.quantize(x, activation_format(w)))
        return _linear32(xq, dequantized_weight(w)[e]).to(x.dtype)
    return _linear32(x, w[e]).to(x.dtype)


def swiglu(gate, up, weight, limit: float) -> torch.Tensor:
    """fp32 ``silu(min(gate, L)) * clamp(up, -L, L) * weight`` (no clamp when ``L == 0``);
    ``weight`` [n] is the routing weight, applied before W2 as the published model does."""
    gate, up = gate.to(torch.float32), up.to(torch.float32)
    if limit > 0:
        gate, up = gate.clamp_max(limit), up.clamp(-limit, limit)
    return _pointwise(F.silu, gate) * up * weight.unsqueeze(-1)


def experts_loop(x, weights, indices, w1, w3, w2, swiglu_limit, project=_project):
    """``moe_experts`` as a loop over the experts used, ``project(x, w, e)`` being ``linear(x, w[e])``
    in ``x.dtype`` (a backend passes its own, e.g. decoding weight bytes without float8 math)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(indices).tolist():
        tok, slot = torch.nonzero(indices == e, as_tuple=True)
        xe = x[tok]
        h = swiglu(project(xe, w1, e), project(xe, w3, e), weights[tok, slot], swiglu_limit)
        out.index_add_(0, tok, project(h.to(x.dtype), w2, e).to(torch.float32))
    return out


def moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit):
    return experts_loop(x, weights, indices, w1, w3, w2, swiglu_limit)


def gumbel_sample(logits, temperature, generator, argmax=lambda t: t.argmax(-1)):
    """Greedy where ``temperature == 0``, else ``argmax(p / E)``, ``E ~ Exp(1)`` (Gumbel-max)."""
    lf = logits.to(torch.float32)
    greedy = argmax(lf)
    if not isinstance(temperature, torch.Tensor):
        if temperature == 0:
            return greedy
        temperature = torch.full(lf.shape[:1], float(temperature), device=lf.device)
    p = torch.softmax(lf / temperature.clamp_min(1e-5).unsqueeze(-1), -1)
    noise = torch.empty_like(p).exponential_(1, generator=generator)
    return torch.where(temperature == 0, greedy, argmax(p / noise))


def sample(logits, temperature, generator):
    return gumbel_sample(logits, temperature, generator)



def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` as uint8 ``[rows, n * itemsize]`` (stored bytes, any dtype)."""
    return t.reshape(-1, t.shape[-1]).view(torch.uint8)


def cold_picks(host_ids, picks, pages_per_row: int, page_entries: int):
    """(cold mask [B, N], flat host row of each pick [B, N], 0 where not cold) of ``gather_cold_rows``."""
    e = picks.long()
    page = (e.clamp_min(0) // page_entries).clamp_max(pages_per_row - 1)
    hp = host_ids.gather(1, page)
    cold = (e >= 0) & (hp >= 0)
    return cold, torch.where(cold, hp * page_entries + e.clamp_min(0) % page_entries, 0)


def gather_cold_rows(host, host_ids, picks, index, offset):
    B, N = picks.shape
    dev, at = picks.device, host.data.device
    cold, src = cold_picks(host_ids, picks, host_ids.shape[1], host.shape[1])
    keep, src = cold.reshape(-1, 1).to(at), src.reshape(-1).to(at)
    staged = []
    for part in (host.data, host.scale):
        rows = torch.where(keep, _byte_rows(part)[src], 0)
        staged.append(rows.to(dev).view(part.dtype).view(1, B * N, part.shape[-1]))
    slots = offset + torch.arange(B * N, device=dev, dtype=torch.int64).view(B, N)
    out = torch.where(cold, slots, index.long()).to(torch.int32)
    return QTensor(staged[0], staged[1], host.fmt, (1, B * N, host.shape[-1])), out


def paged_rows(table, entry, mask, page_entries: int, trash_row: int):
    """int64 [B * n]: the pool row of each (row, entry) pair of ``store_paged``; pairs not stored
    (``mask`` false, or a page id < 0) point at ``trash_row``."""
    P, e = page_entries, entry.long().clamp_min(0)
    page = table.gather(1, (e // P).clamp_max(table.shape[1] - 1)).long()
    return torch.where(mask & (page >= 0), page * P + e % P, trash_row).reshape(-1)


def store_rows(dst, batch, slot, src):
    for d, v in ((dst.data, src.data), (dst.scale, src.scale)):
        d.view(torch.uint8)[batch, slot] = v.view(torch.uint8)  # float8 has no index_put
    return dst


def resolve_paged(table, picks, page_entries, offset=0):
    P, e = page_entries, picks.long()
    page = table.gather(1, (e.clamp_min(0) // P).clamp_max(table.shape[1] - 1)).long()
    return torch.where((e >= 0) & (page >= 0), page * P + e.clamp_min(0) % P + offset, -1).to(torch.int32)


def store_paged(pool, table, entry, mask, values, page_entries, trash_row):
    B, n = entry.shape
    rows = paged_rows(table, entry, mask, page_entries, trash_row)
    for dst, src in ((pool.data, values.data), (pool.scale, values.scale)):
        dst.view(torch.uint8)[0, rows] = src.reshape(B * n, -1).view(torch.uint8)  # float8 has no index_put
    return pool


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
