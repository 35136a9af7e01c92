"""The ops with no torch_npu operator of matching semantics on Atlas A2/A3: plain torch on the NPU.

``compress_pool`` (and the pool of ``compress_decode``), ``hc_coefficients``, ``hc_collapse``,
``hc_expand`` and ``engram_gate`` are small elementwise / reduction / tiny-GEMM graphs. torch_npu 2.14.0 has the mHC operators
(``npu_mhc_pre``: the coefficients and the collapse; ``npu_mhc_sinkhorn``; ``npu_mhc_post``: the
expand), but their documentation lists the Ascend 950 only, so on the 910B these run the
reference math on the device; no operator computes compress_pool's softmax pool or engram_gate's
two-norm gate. ``engram_lookup`` gathers table bytes with ``npu_gather_sparse_index`` and decodes
them exactly; ``sample`` makes the argmax tie rule explicit. Each call is counted as a fallback
(``npu_runtime.FALLBACKS``) with its reason. ``gather_cold_rows`` reads pages in host memory,
which no torch_npu operator reads: it gathers on the host and stages the rows to the NPU;
``store_paged`` and ``resolve_paged`` go through a block table, which no operator does, and
``store_rows`` is a plain byte scatter; ``engram_hash`` and ``window_indices`` are int64
arithmetic no operator does.
"""
from __future__ import annotations

import torch

from flashrt import refmath as ref
from flashrt.formats import QTensor

from . import norm_rope
from .npu_runtime import dequantize, fallback, first_argmax, npu_family, take_rows

MHC_950_ONLY = "npu_mhc_pre / npu_mhc_sinkhorn / npu_mhc_post are documented for the Ascend 950 only, not Atlas A2/A3"
REASONS = {
    "compress_pool": "no torch_npu operator computes a softmax-weighted pool over r",
    "compress_decode": "the slot writes and the pool: no torch_npu operator computes a softmax-weighted pool "
                       "over r (the norm runs as rms_norm does)",
    "hc_coefficients": MHC_950_ONLY,
    "hc_collapse": MHC_950_ONLY,
    "hc_collapse_norm": f"the collapse: {MHC_950_ONLY} (the norm runs as rms_norm does)",
    "hc_expand": MHC_950_ONLY,
    "engram_gate": "no torch_npu operator computes engram_gate's two-norm sigmoid gate",
    "engram_hash": "no torch_npu operator computes the n-gram rolling hash (int64 multiply, xor, remainder)",
    "sample": "no operator states an argmax tie rule or draws Gumbel noise from a given generator",
    "gather_cold_rows": "the pages are in host memory, which no torch_npu operator reads: rows are gathered on "
                        "the host as bytes and staged to the NPU in one copy each",
    "store_paged": "no torch_npu operator scatters rows through a block table: the lookup and the byte "
                   "scatter run as torch operations on the NPU",
    "store_rows": "a byte scatter of rows: two torch index_put operations on the NPU (data and scale)",
    "resolve_paged": "no torch_npu operator looks entries up through a block table: the lookup runs as torch "
                     "operations on the NPU",
    "store_paged_many": "no torch_npu operator stores through a block table: each store's lookup and byte "
                        "scatter run as torch operations on the NPU",
    "window_indices": "no torch_npu operator computes sliding-window ring slots: int64 arithmetic as torch "
                      "operations on the NPU",
}


def compress_pool(kv, score):
    """``compress_pool``: plain torch (softmax over r, weighted sum), fp32 as docs/ops.md."""
    fallback("compress_pool", REASONS["compress_pool"])
    return ref.compress_pool(kv, score)


def compress_decode(kv, score, kv_state, score_state, positions, weight, eps, dtype):
    """``compress_decode``: the slot writes and :func:`compress_pool` in plain torch (counted under
    this op), then ``rms_norm`` (npu_rms_norm where it serves the call), in sequence."""
    fallback("compress_decode", REASONS["compress_decode"])
    r = kv_state.shape[1]
    rows, slot = torch.arange(kv.shape[0], device=kv.device), positions % r
    kv_state[rows, slot] = kv
    score_state[rows, slot] = score
    latent = norm_rope.rms_norm(ref.compress_pool(kv_state.unsqueeze(1), score_state.unsqueeze(1)).to(dtype),
                                weight, eps)
    done = positions + 1
    return latent, (done // r - 1).unsqueeze(1), (done % r == 0).unsqueeze(1)


def hc_coefficients(x, fn, scale, base, iters, eps, norm_eps):
    """``hc_coefficients``: plain torch (one small GEMM, sigmoids, Sinkhorn iterations), fp32."""
    fallback("hc_coefficients", REASONS["hc_coefficients"])
    return ref.hc_coefficients(x, fn, scale, base, iters, eps, norm_eps)


def hc_collapse(x, pre):
    """``hc_collapse``: plain torch (weighted sum over the hc streams), fp32."""
    fallback("hc_collapse", REASONS["hc_collapse"])
    return ref.hc_collapse(x, pre)


def hc_collapse_norm(x, pre, weight, eps):
    """``hc_collapse_norm``: the collapse in plain torch (counted under this op), then ``rms_norm``
    (npu_rms_norm where it serves the call)."""
    fallback("hc_collapse_norm", REASONS["hc_collapse_norm"])
    return norm_rope.rms_norm(ref.hc_collapse(x, pre), weight, eps)


def hc_expand(y, residual, post, comb):
    """``hc_expand``: plain torch (an einsum over the hc streams), fp32."""
    fallback("hc_expand", REASONS["hc_expand"])
    return ref.hc_expand(y, residual, post, comb)


def engram_gate(h, key, value, weight, eps):
    """``engram_gate``: plain torch, fp32 as docs/ops.md."""
    fallback("engram_gate", REASONS["engram_gate"])
    return ref.engram_gate(h, key, value, weight, eps)


def engram_lookup(table, ids):
    """``engram_lookup`` -> ``torch_npu.npu_gather_sparse_index`` on the stored bytes, then exact
    decoding: the ``fp8`` rows (data and scales, as uint8) are gathered by ``ids`` (int64 in
    ``[0, rows)``, the operator's index range) and turned into values through the E4M3 and UE8M0
    tables of ``npu_runtime`` (no float8 arithmetic on the device), returned as bf16."""
    flat = ids.reshape(-1)
    data, scale = take_rows("engram_lookup", table.data, flat), take_rows("engram_lookup", table.scale, flat)
    rows = QTensor(data, scale, table.fmt, (flat.shape[0], table.shape[-1]))
    return dequantize(rows, torch.bfloat16).view(*ids.shape, table.shape[-1])


def sample(logits, temperature, generator):
    """``sample``: plain torch. Greedy and Gumbel-max take the first maximum (ties to the lower id,
    as docs/ops.md says; the NPU's argmax documents no tie rule). The exponential noise is drawn on the
    device with ``generator`` (an NPU generator on the NPU: its stream differs from a CPU one)."""
    fallback("sample", REASONS["sample"])
    return ref.gumbel_sample(logits, temperature, generator, argmax=first_argmax)


def gather_cold_rows(host, host_ids, picks, index, offset):
    """``gather_cold_rows``: plain torch. The picks and host page ids come to the host once, the rows
    are gathered there as bytes and the staged bytes go to the NPU in one copy each; the output index
    is computed on the NPU."""
    fallback("gather_cold_rows", REASONS["gather_cold_rows"])
    return ref.gather_cold_rows(host, host_ids, picks, index, offset)


def store_paged(pool, table, entry, mask, values, page_entries, trash_row):
    """``store_paged``: plain torch on the NPU (block-table lookup, then one byte scatter each for
    data and scale), exactly the reference."""
    fallback("store_paged", REASONS["store_paged"])
    return ref.store_paged(pool, table, entry, mask, values, page_entries, trash_row)


def store_paged_many(stores, entry, mask):
    """``store_paged_many``: the reference's ``store_paged`` of each store, as torch operations on the NPU."""
    fallback("store_paged_many", REASONS["store_paged_many"])
    return ref.store_paged_many(stores, entry, mask)


def engram_hash(seq, multipliers, primes, offsets, pad):
    """``engram_hash``: plain torch on the NPU, exactly the reference."""
    fallback("engram_hash", REASONS["engram_hash"])
    return ref.engram_hash(seq, multipliers, primes, offsets, pad)


def store_rows(dst, batch, slot, src, keep=None):
    """``store_rows``: plain torch on the NPU (one byte scatter each for data and scale), exactly the reference."""
    fallback("store_rows", REASONS["store_rows"])
    return ref.store_rows(dst, batch, slot, src, keep)


def resolve_paged(table, picks, page_entries, offset=0):
    """``resolve_paged``: plain torch on the NPU (gather, then the row arithmetic), exactly the reference."""
    fallback("resolve_paged", REASONS["resolve_paged"])
    return ref.resolve_paged(table, picks, page_entries, offset)


def window_indices(positions, ring_start, window):
    """``window_indices``: plain torch on the NPU, exactly the reference."""
    fallback("window_indices", REASONS["window_indices"])
    return ref.window_indices(positions, ring_start, window)


FAMILY = npu_family("misc", {name: globals()[name] for name in (
    "compress_pool", "compress_decode", "hc_coefficients", "hc_collapse", "hc_collapse_norm", "hc_expand",
    "engram_gate", "engram_lookup", "engram_hash", "sample", "gather_cold_rows", "store_paged", "store_rows",
    "resolve_paged", "window_indices", "store_paged_many")},
    "ops with no matching torch_npu operator (plain torch on the NPU) and engram_lookup (npu_gather_sparse_index)")
PLANS = {name: (lambda *args, why=why: why) for name, why in REASONS.items()}
PLANS["engram_lookup"] = lambda *args: None
