"""Shared pieces of the torch_npu adapters: the torch_npu handle, their family declaration,
operator and fallback accounting, exact decoders, row gathers.

``torch_npu`` is imported only on first use, i.e. when an Ascend op actually runs (the backend
was chosen, or an ``npu`` tensor reached it); importing this module never imports it. The adapters
reach every operator through :func:`operator`, so each call names the op it serves (``flashrt
conformance`` lists, per op, the operators used and the fallback reasons, see
:func:`flashrt.conformance.note_route`).

The decoders turn stored bytes into fp32 with integer ops and table look-ups only (no float8
arithmetic on the device, which the 910B does not have): E4M3 through a 256-entry table, UE8M0 by
building the fp32 bit pattern, E2M1 through the 16-entry table of :mod:`flashrt.formats`.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections import Counter

import torch

from flashrt import formats
from flashrt.conformance import note_route
from flashrt.families import KernelFamily, Support
from flashrt.formats import QTensor

log = logging.getLogger("flashrt")

EMULATION_ENV = "FLASHRT_NPU_EMULATION"
FALLBACKS: Counter = Counter()  # (op, reason) -> calls served by plain torch instead of an operator
_LOGGED: set = set()


NO_FLOAT64 = Support(excluded_dtypes=(torch.float64,))  # no fp64 on the AI cores: the reference serves it


def npu_family(name: str, ops: dict, description: str) -> KernelFamily:
    """A family of adapters: each op serves every valid call on the NPU but float64 inputs
    (through its operator where ops.md's semantics hold exactly, else plain torch, counted in
    :data:`FALLBACKS`)."""
    return KernelFamily(name, ops=ops, supports={op: NO_FLOAT64 for op in ops}, description=description)


def emulation() -> bool:
    """Tests run the backend on CPU tensors against the emulated torch_npu (tests/npu_emulation)."""
    return os.environ.get(EMULATION_ENV) == "1"


def torch_npu_present() -> bool:
    """torch_npu is imported already or installed (found without importing it)."""
    if "torch_npu" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def npu():
    """The torch_npu module (imported here, on first use)."""
    return importlib.import_module("torch_npu")


def operator(op: str, name: str):
    """``torch_npu.<name>``, noted as serving ``op`` on this call."""
    note_route(op, name)
    return getattr(npu(), name)


def via_torch(op: str, what: str) -> None:
    """Note that ``op`` ran (part of) its work through a torch op on the device by design, e.g.
    ``torch.topk`` (aclnnTopk) or ``F.linear`` (aclnnMatmul): not a fallback."""
    note_route(op, f"torch: {what}")


def fallback(op: str, reason: str) -> None:
    """Count (and log once) a call served by plain torch on the device instead of an operator."""
    FALLBACKS[(op, reason)] += 1
    note_route(op, f"plain torch: {reason}")
    if (op, reason) not in _LOGGED:
        _LOGGED.add((op, reason))
        log.info("flashrt: ascend %s falls back to plain torch: %s", op, reason)


def declined(op: str, name: str, reason: str) -> None:
    """Note (and log once) that the fused operator ``name`` does not serve ``op`` on this call and
    why; the call still runs on the other operators (or plain-torch steps) of its adapter."""
    note_route(op, f"not {name}: {reason}")
    if (op, name, reason) not in _LOGGED:
        _LOGGED.add((op, name, reason))
        log.info("flashrt: ascend %s does not use %s: %s", op, name, reason)


def float_of(t) -> torch.Tensor:
    """fp32 values of a plain tensor or a QTensor (decoded exactly, see :func:`dequantize`)."""
    return dequantize(t) if isinstance(t, QTensor) else t.to(torch.float32)


# ---- exact decoders ----------------------------------------------------------------------------

_E4M3_TABLES: dict = {}


def e4m3_values(t: torch.Tensor) -> torch.Tensor:
    """fp32 values of float8_e4m3fn bytes, by table look-up."""
    table = _E4M3_TABLES.get(t.device)
    if table is None:
        table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        table = _E4M3_TABLES[t.device] = table.to(t.device)
    return table[t.view(torch.uint8).long()]


def e8m0_values(t: torch.Tensor) -> torch.Tensor:
    """fp32 values 2**(b - 127) of float8_e8m0fnu bytes b, from the fp32 bit pattern."""
    b = t.view(torch.uint8).to(torch.int32)
    bits = torch.where(b > 0, b << 23, torch.full_like(b, 1 << 22))  # b == 0: 2**-127, subnormal
    return bits.view(torch.float32)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        return e8m0_values(scale)
    if scale.dtype == torch.float8_e4m3fn:
        return e4m3_values(scale)
    return scale.to(torch.float32)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``formats.dequantize`` with the exact byte decoders above (same values, no float8 math)."""
    s = formats.spec(q.fmt)
    if s.packed:
        elems = formats.e2m1_values(formats.unpack_fp4(formats.with_nibbles(q).data))
    elif s.element == "e4m3":
        elems = e4m3_values(q.data)
    else:
        elems = q.data.to(torch.float32)
    scale = _scale_values(q.scale)
    if s.tiled:
        rows, cols = q.shape[-2:]
        full = scale.repeat_interleave(s.block, -2).repeat_interleave(s.block, -1)
        return (elems * full[..., :rows, :cols]).to(dtype)
    block = elems.shape[-1] if s.row else s.block
    blocks = elems.view(*elems.shape[:-1], elems.shape[-1] // block, block)
    return (blocks * scale.unsqueeze(-1)).view(q.shape).to(dtype)


_ONE_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


def take_rows(op: str, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` along dim 0 through ``torch_npu.npu_gather_sparse_index`` (index values in
    ``[0, rows)``). One-byte float types, which the operator does not list, travel as uint8 bytes."""
    raw = table.view(torch.uint8) if table.dtype in _ONE_BYTE_FLOATS else table
    out = operator(op, "npu_gather_sparse_index")(raw, index)
    return out.view(table.dtype) if raw is not table else out


def gather_rows(op: str, kv, idx: torch.Tensor) -> torch.Tensor:
    """kv [B|1, T, D] (plain, QTensor or a tuple of segments), idx [B, ...] int64 in [0, T) ->
    fp32 [B, ..., D]. Rows are taken with :func:`take_rows` from ``[B * T, ...]`` views (index
    ``b * T + t``); quantized rows are gathered as bytes (data and scale), then decoded."""
    if isinstance(kv, tuple):
        out, offset = None, 0
        for seg in kv:
            n = seg.shape[1]
            local = idx - offset
            mine = ((local >= 0) & (local < n)).unsqueeze(-1)
            if n:
                rows = gather_rows(op, seg, local.clamp(0, n - 1))
                out = rows * mine if out is None else torch.where(mine, rows, out)
            offset += n
        return out if out is not None else torch.zeros(*idx.shape, kv[0].shape[-1], device=idx.device)
    B, T = kv.shape[0], kv.shape[1]
    flat = idx
    if B > 1:
        flat = idx + (torch.arange(idx.shape[0], device=idx.device) * T).view(-1, *([1] * (idx.dim() - 1)))
    if isinstance(kv, QTensor):
        data = take_rows(op, kv.data.reshape(B * T, *kv.data.shape[2:]), flat)
        scale = take_rows(op, kv.scale.reshape(B * T, *kv.scale.shape[2:]), flat)
        return dequantize(QTensor(data, scale, kv.fmt, tuple(idx.shape) + tuple(kv.shape[-1:])))
    return take_rows(op, kv.reshape(B * T, *kv.shape[2:]), flat).to(torch.float32)


def bf16_exact(seg, dtype: torch.dtype) -> bool:
    """A KV segment's values are exactly representable in ``dtype`` (what the operator reads)."""
    if isinstance(seg, QTensor):  # <= 7 significant bits times a power of two, or E2M1 x E4M3
        return dtype == torch.bfloat16 and seg.fmt in ("fp8", "fp4_b16", "fp4_b32", "int8")
    return seg.dtype == dtype


# ---- exact top-k selection (tie rule of docs/ops.md, independent of the operator's) -----------------


def select_top(key: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """bool mask of the ``k`` largest ``key`` entries among ``valid`` ones per row, ties to the
    lower position. Only the k-th largest *value* comes from ``torch.topk`` (values do not depend
    on how an implementation breaks ties); the tie rule is applied here with a cumulative count."""
    key = torch.where(valid, key, float("-inf"))
    thr = torch.topk(key, k, dim=-1, largest=True, sorted=False).values.amin(-1, keepdim=True)
    above = valid & (key > thr)
    tied = valid & (key == thr)
    room = k - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


def positions_of(mask: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [..., k]: the True positions of ``mask [..., T]`` in ascending order, then -1."""
    T = mask.shape[-1]
    slot = torch.where(mask, mask.cumsum(-1) - 1, k)  # unselected go to a spare slot k
    pos = torch.arange(T, device=mask.device, dtype=torch.int32).expand(mask.shape)
    out = torch.full((*mask.shape[:-1], k + 1), -1, dtype=torch.int32, device=mask.device)
    return out.scatter_(-1, slot.long(), pos)[..., :k]


def first_argmax(v: torch.Tensor) -> torch.Tensor:
    """int64 index of the largest entry of the last dim, ties to the lower index."""
    n = v.shape[-1]
    hit = v == v.amax(-1, keepdim=True)
    idx = torch.arange(n, device=v.device).expand(v.shape)
    return torch.where(hit, idx, n).amin(-1)
