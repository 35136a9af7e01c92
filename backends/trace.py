"""Trace backend: shape-only ops on ``meta`` tensors that record each call into a :class:`Graph`.

Run any graph on meta tensors inside ``with trace.record() as graph:`` (:mod:`flashrt.tracing`) and every op call is kept
with its input and output shapes and dtypes, FLOPs, and bytes read and written; nothing is
allocated. ``flashrt plan`` builds on this.

Counting rules (the minimum work each op must do):

- Bytes: every input read once and every output written once, at its stored size (a QTensor
  counts data + scale). Gathers read only the rows they gather (paged ``index_scores`` keys: the
  ``B*T`` rows they map plus the block table, not the whole pool): ``sparse_attention`` reads
  ``B*S*K`` KV rows (every slot assumed valid; with KV segments, ``min(K, T_i)`` rows of each), ``engram_lookup`` ``B*S*C`` table rows,
  ``moe_experts`` the weights of ``min(E, N*k)`` experts (and the shared one), ``gather_cold_rows`` ``B*N`` host rows.
- FLOPs: a multiply-add is 2. ``linear`` ``2*M*in*out``; ``sparse_attention`` ``4*B*S*H*K*D``
  (``prefix_attention`` as the sparse call it stands for: ``K`` = window + entries);
  ``index_scores`` ``2*B*S*T*Hi*(Di+1)``; ``moe_experts`` ``N*(k+shared)*(6*D*I + 4*I)``; ``moe_route``
  ``2*N*D*E + 3*N*E``; ``hc_coefficients`` ``2*B*S*hcD*(M+1) + 4*B*S*hc*hc*iters``;
  ``grouped_linear`` ``2*rows*in*G*out``; ``hc_collapse`` ``2*B*S*hc*D``; ``hc_collapse_norm``
  ``2*B*S*hc*D + 4*B*S*D``; ``hc_expand`` ``2*B*S*hc*D*(hc+1)``; ``compress_pool``
  ``5*B*G*r*D``; ``compress_decode`` ``5*B*r*D + 4*B*D`` (the pool and the norm; the new rows it
  writes into the state count as outputs); ``engram_gate`` ``9*B*S*hc*D``; ``engram_hash`` ``2*B*S*L*N`` (multiply,
  xor) plus ``B*S*L*C`` remainders; elementwise ops per element: ``rms_norm`` 4,
  ``rope`` 3, ``quantize`` 3, ``norm_rope_quantize`` 10, ``dequantize`` and ``engram_lookup`` 1,
  ``sample`` 3 per logit.
  Selection and copy ops (``topk_positions``, ``candidate_blocks``, ``gather_cold_rows``,
  ``store_paged``, ``store_rows``, ``resolve_paged``) count 0 FLOPs; the stores count as writing
  their source rows, not the pool; ``resolve_paged`` reads one block-table entry a pick;
  ``window_indices`` counts its ``L*B*S*W`` int32 outputs and reads its inputs, no FLOPs.
"""
from __future__ import annotations

import torch

from flashrt.formats import QTensor, expected_layout, spec
from flashrt.hookspecs import Backend, hookimpl
from flashrt.kv.paged import PagedKeys
from flashrt.ops import OPS as OP_NAMES
from flashrt.tracing import Call, Graph, TensorInfo, Totals, emit as _emit, info, record  # noqa: F401 (re-exported)


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _nbytes(t) -> int:
    return info(t).nbytes if t is not None else 0


def _row_bytes(t) -> int:
    """Stored bytes of one row (last dim) of a plain or quantized tensor."""
    rows = 1
    for n in t.shape[:-1]:
        rows *= n
    return _nbytes(t) // max(rows, 1)


def rms_norm(x, weight, eps):
    out = _meta(x.shape, x.dtype)
    _emit("rms_norm", (x, weight), (out,), 4 * x.numel())
    return out


def rope(x, freqs_cis, inverse):
    out = _meta(x.shape, x.dtype)
    _emit("rope", (x, freqs_cis), (out,), 3 * x.numel())
    return out


def norm_rope_quantize(x, weight, eps, freqs_cis, fmt, dequantize_to=None):
    if fmt is None:  # no quantization: the roped rows in x.dtype
        out = _meta(x.shape, x.dtype)
        _emit("norm_rope_quantize", (x, freqs_cis) if weight is None else (x, weight, freqs_cis), (out,), 10 * x.numel())
        return out
    data_shape, scale_shape = expected_layout(fmt, x.shape)
    s = spec(fmt)
    q = QTensor(_meta(data_shape, s.data_dtype), _meta(scale_shape, s.scale_dtype), fmt, x.shape)
    if dequantize_to is not None:  # the fake quantization: the values, not the stored rows
        q = _meta(x.shape, dequantize_to)
    _emit("norm_rope_quantize", (x, freqs_cis) if weight is None else (x, weight, freqs_cis), (q,), 10 * x.numel())
    return q


def quantize(x, fmt):
    data_shape, scale_shape = expected_layout(fmt, x.shape)
    s = spec(fmt)
    q = QTensor(_meta(data_shape, s.data_dtype), _meta(scale_shape, s.scale_dtype), fmt, x.shape)
    _emit("quantize", (x,), (q,), 3 * x.numel())
    return q


def dequantize(q, dtype):
    out = _meta(q.shape, dtype)
    _emit("dequantize", (q,), (out,), out.numel())
    return out


def linear(x, weight, out_dtype=None):
    out_features, in_features = weight.shape
    out = _meta((*x.shape[:-1], out_features), out_dtype or x.dtype)
    _emit("linear", (x, weight), (out,), 2 * (x.numel() // in_features) * in_features * out_features)
    return out


def grouped_linear(x, weight):
    out = _meta((*x.shape[:-2], weight.shape[0]), x.dtype)
    _emit("grouped_linear", (x, weight), (out,), 2 * (x.numel() // x.shape[-1]) * weight.shape[1] * weight.shape[0] // x.shape[-2])
    return out


def sparse_attention(q, kv, indices, sink, scale):
    parts = indices if isinstance(indices, tuple) else (indices,)
    return _attention("sparse_attention", q, kv, sum(p.shape[-1] for p in parts), parts, sink)


def _attention(op, q, kv, K, parts, sink):
    """An attention call of ``K`` slots a query: each query reads K rows, from a segment at most T_i
    of them (an upper bound when K < sum T_i)."""
    B, S, H, D = q.shape
    out = _meta(q.shape, q.dtype)
    segments = kv if isinstance(kv, tuple) else (kv,)
    rows = sum(min(K, seg.shape[1]) * _row_bytes(seg) for seg in segments) if len(segments) > 1 else K * _row_bytes(kv)
    read = _nbytes(q) + sum(map(_nbytes, parts)) + _nbytes(sink) + B * S * rows
    _emit(op, (q, *segments, *parts, sink), (out,), 4 * B * S * H * K * D, read)
    return out


def prefix_attention(q, kv, positions, ring_start, window, entries, visible, sink, scale):
    # counted as the sparse_attention it stands for: each query's window and every entry it may see
    K = window + (entries.shape[-1] if entries is not None else 0)
    parts = (positions, ring_start) + ((entries, visible) if entries is not None else ())
    return _attention("prefix_attention", q, kv, K, parts, sink)


def index_scores(q, k, weights, visible, weight_scale=1.0):
    B, S, Hi, Di = q.shape
    T = k.shape[1]
    out = _meta((B, S, T), torch.float32)
    if isinstance(k, PagedKeys):  # reads the B*T rows it maps (and its block table), not the whole pool
        read = sum(map(_nbytes, (q, weights, visible, k.block_table))) + B * T * _row_bytes(k.pool)
        _emit("index_scores", (q, k.pool, k.block_table, weights, visible), (out,), 2 * B * S * T * Hi * (Di + 1), read)
        return out
    _emit("index_scores", (q, k, weights, visible), (out,), 2 * B * S * T * Hi * (Di + 1))
    return out


def topk_positions(scores, k, candidates):
    B, S, T = scores.shape
    out = _meta((B, S, min(k, T)), torch.int32)
    _emit("topk_positions", (scores, candidates), (out,), 0)
    return out


def candidate_blocks(scores, visible, topk_blocks, block_size):
    out = _meta(scores.shape, torch.bool)
    _emit("candidate_blocks", (scores, visible), (out,), 0)
    return out


def compress_pool(kv, score):
    B, G, r, D = kv.shape
    out = _meta((B, G, D), torch.float32)
    _emit("compress_pool", (kv, score), (out,), 5 * B * G * r * D)
    return out


def compress_decode(kv, score, kv_state, score_state, positions, weight, eps, dtype):
    B, r, D = kv_state.shape
    latent, entry, mask = _meta((B, 1, D), dtype), _meta((B, 1), torch.int64), _meta((B, 1), torch.bool)
    # reads the new rows, the state, the positions and the norm weight; writes the new rows into the state too
    _emit("compress_decode", (kv, score, kv_state, score_state, positions, weight), (kv, score, latent, entry, mask),
          5 * B * r * D + 4 * B * D)
    return latent, entry, mask


def hc_coefficients(x, fn, scale, base, iters, eps, norm_eps):
    B, S, hc, D = x.shape
    pre, post = _meta((B, S, hc), torch.float32), _meta((B, S, hc), torch.float32)
    comb = _meta((B, S, hc, hc), torch.float32)
    flops = 2 * B * S * hc * D * (fn.shape[0] + 1) + 4 * B * S * hc * hc * iters
    _emit("hc_coefficients", (x, fn, scale, base), (pre, post, comb), flops)
    return pre, post, comb


def hc_collapse(x, pre):
    B, S, hc, D = x.shape
    out = _meta((B, S, D), x.dtype)
    _emit("hc_collapse", (x, pre), (out,), 2 * B * S * hc * D)
    return out


def hc_collapse_norm(x, pre, weight, eps):
    B, S, hc, D = x.shape
    out = _meta((B, S, D), x.dtype)
    _emit("hc_collapse_norm", (x, pre, weight), (out,), 2 * B * S * hc * D + 4 * B * S * D)
    return out


def hc_expand(y, residual, post, comb):
    B, S, hc, D = residual.shape
    out = _meta(residual.shape, y.dtype)
    _emit("hc_expand", (y, residual, post, comb), (out,), 2 * B * S * hc * D * (hc + 1))
    return out


def engram_lookup(table, ids):
    out = _meta((*ids.shape, table.shape[-1]), torch.bfloat16)
    read = _nbytes(ids) + ids.numel() * _row_bytes(table)
    _emit("engram_lookup", (table, ids), (out,), out.numel(), read)
    return out


def engram_gate(h, key, value, weight, eps):
    out = _meta(h.shape, h.dtype)
    _emit("engram_gate", (h, key, value, weight), (out,), 9 * h.numel())
    return out


def engram_hash(seq, multipliers, primes, offsets, pad):
    (B, T), (L, N), C = seq.shape, multipliers.shape, primes.shape[1]
    S = T - (N - 1)
    out = _meta((B, S, L, C), torch.int64)
    _emit("engram_hash", (seq, multipliers, primes, offsets), (out,), B * S * L * (2 * N + C))
    return out


def moe_route(x, weight, bias, topk, score_func, norm_topk, route_scale):
    N, D = x.shape
    E = weight.shape[0]
    w, idx = _meta((N, topk), torch.float32), _meta((N, topk), torch.int32)
    _emit("moe_route", (x, weight, bias), (w, idx), 2 * N * D * E + 3 * N * E)
    return w, idx


def moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit, add=None, out_dtype=torch.float32, shared=None):
    N, D = x.shape
    E, I, _ = w1.shape
    k = indices.shape[-1]
    out = _meta((N, D), out_dtype)
    used = min(E, N * k)
    read = _nbytes(x) + _nbytes(weights) + _nbytes(indices) + used * sum(_nbytes(w) // E for w in (w1, w3, w2))
    inputs = (x, weights, indices, w1, w3, w2) + ((add,) if add is not None else ()) + tuple(shared or ())
    read += (_nbytes(add) if add is not None else 0) + sum(_nbytes(w) for w in shared or ())
    slots = k + (shared is not None)
    _emit("moe_experts", inputs, (out,), N * slots * (6 * D * I + 4 * I), read)
    return out


def sample(logits, temperature, generator):
    out = _meta(logits.shape[:1], torch.int64)
    extra = (temperature,) if isinstance(temperature, torch.Tensor) else ()
    _emit("sample", (logits, *extra), (out,), 3 * logits.numel())
    return out


def gather_cold_rows(host, host_ids, picks, index, offset):
    B, N = picks.shape
    data = _meta((1, B * N, host.data.shape[-1]), host.data.dtype)
    scale = _meta((1, B * N, host.scale.shape[-1]), host.scale.dtype)
    staging = QTensor(data, scale, host.fmt, (1, B * N, host.shape[-1]))
    out = _meta((B, N), torch.int32)
    read = sum(map(_nbytes, (host_ids, picks, index))) + B * N * _row_bytes(host)
    _emit("gather_cold_rows", (host, host_ids, picks, index), (staging, out), 0, read)
    return staging, out


def store_rows(dst, batch, slot, src, keep=None):
    _emit("store_rows", (batch, slot, src) + (() if keep is None else (keep,)), (src,), 0)  # the rows' bytes into dst
    return dst


def resolve_paged(table, picks, page_entries, offset=0):
    out = _meta(picks.shape, torch.int32)
    _emit("resolve_paged", (picks,), (out,), 0, _nbytes(picks) + picks.numel() * table.element_size())
    return out


def window_indices(positions, ring_start, window):
    (B, S), L = positions.shape, ring_start.shape[0]
    out = _meta((L, B, S, window), torch.int32)
    _emit("window_indices", (positions, ring_start), (out,), 0, _nbytes(positions) + _nbytes(ring_start))
    return out


def store_paged_many(stores, entry, mask):
    return tuple(store_paged(pool, table, entry, mask, values, P, trash) for pool, table, values, P, trash in stores)


def store_paged(pool, table, entry, mask, values, page_entries, trash_row):
    read = sum(map(_nbytes, (table, entry, mask, values)))
    _emit("store_paged", (table, entry, mask, values), (values,), 0, read)  # writes the values' bytes into the pool
    return pool


def dense_attention(q, k, v, scale):
    B, S, H, D = q.shape
    out = _meta(q.shape, q.dtype)
    _emit("dense_attention", (q, k, v), (out,), 4 * B * S * k.shape[1] * H * D)
    return out


OPS = {name: globals()[name] for name in OP_NAMES}


@hookimpl
def flashrt_backend():
    return Backend(
        name="trace",
        device_types=("meta",),
        ops=OPS,
        priority=100,
        description="shape-only on meta tensors; records FLOPs and bytes into a Graph",
    )
