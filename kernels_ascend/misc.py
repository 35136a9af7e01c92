"""The ops with no torch_npu operator of matching semantics: plain torch on the NPU.

``compress_pool``, ``hc_coefficients``, ``hc_collapse``, ``hc_expand`` and ``engram_gate`` are
small elementwise / reduction / tiny-GEMM graphs with no fused torch_npu operator of the same
math (npu_rms_norm does not cover engram_gate's two-norm gate; no operator does mHC's Sinkhorn
normalisation), so they run the reference math on the device. ``engram_lookup`` gathers table
bytes and decodes them exactly; ``sample`` makes the argmax tie rule explicit.
"""
from __future__ import annotations

import torch

from flashrt import refmath as ref
from flashrt.formats import QTensor

from .npu_runtime import dequantize, first_argmax, npu_family


def compress_pool(kv, score):
    """``compress_pool``: plain torch (softmax over r, weighted sum), fp32 as docs/ops.md."""
    return ref.compress_pool(kv, score)


def hc_coefficients(x, fn, scale, base, iters, eps, norm_eps):
    """``hc_coefficients``: plain torch (one small GEMM, sigmoids, Sinkhorn iterations), fp32."""
    return ref.hc_coefficients(x, fn, scale, base, iters, eps, norm_eps)


def hc_collapse(x, pre):
    """``hc_collapse``: plain torch (weighted sum over the hc streams), fp32."""
    return ref.hc_collapse(x, pre)


def hc_expand(y, residual, post, comb):
    """``hc_expand``: plain torch (an einsum over the hc streams), fp32."""
    return ref.hc_expand(y, residual, post, comb)


def engram_gate(h, key, value, weight, eps):
    """``engram_gate``: plain torch, fp32 as docs/ops.md."""
    return ref.engram_gate(h, key, value, weight, eps)


def engram_lookup(table, ids):
    """``engram_lookup``: plain-torch index (aclnnIndex / gather) on the stored bytes, then exact
    decoding: the ``fp8`` rows are looked up as uint8 and turned into values through the E4M3 and
    UE8M0 tables of ``npu_runtime`` (no float8 arithmetic on the device), returned as bf16."""
    flat = ids.reshape(-1)
    rows = QTensor(table.data[flat], table.scale[flat], table.fmt, (flat.shape[0], table.shape[-1]))
    return dequantize(rows, torch.bfloat16).view(*ids.shape, table.shape[-1])


def sample(logits, temperature, generator):
    """``sample``: plain torch. Greedy and Gumbel-max take the first maximum (ties to the lower id,
    as docs/ops.md says; the NPU's argmax documents no tie rule). The exponential noise is drawn on the
    device with ``generator`` (an NPU generator on the NPU: its stream differs from a CPU one)."""
    return ref.gumbel_sample(logits, temperature, generator, argmax=first_argmax)


def gather_cold_rows(host, host_ids, picks, index, offset):
    """``gather_cold_rows``: plain torch. The picks and host page ids come to the host once (no
    torch_npu operator reads host memory from the device), the rows are gathered there as bytes
    and the staged bytes go to the NPU in one copy each; the output index is computed on the NPU."""
    return ref.gather_cold_rows(host, host_ids, picks, index, offset)


FAMILY = npu_family("misc", {name: globals()[name] for name in (
    "compress_pool", "hc_coefficients", "hc_collapse", "hc_expand", "engram_gate", "engram_lookup", "sample",
    "gather_cold_rows")},
    "ops with no matching torch_npu operator: plain torch on the NPU")
