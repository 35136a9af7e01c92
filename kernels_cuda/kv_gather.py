"""``gather_cold_rows`` (HKCP cold fetch): the picked KV entries that live on host pages, gathered
by the GPU straight from pinned host memory (zero-copy) into a device staging segment.

``_cold_gather_kernel``: one program per ``BLOCK`` picks of the flat ``[B * N]`` picks (``N``
picks per row, logical entries, ``-1`` empty). For pick ``i`` of row ``b``: host page
``hp = host_ids[b, e // P]``; when ``e >= 0`` and ``hp >= 0`` (a cold entry) its stored row
(data and scale bytes, as 32-bit words when they divide) is copied from host row ``hp * P + e % P``
to staging row ``i`` and the output index ``i`` becomes ``offset + i`` (its place after the device
pool in the attention's segments); other picks copy their input index and leave their (zeroed)
staging row alone. No host sync: the block table, the picks and the indices stay on the device.

Pinned memory from torch's host allocator is mapped into the device address space (CUDA unified
addressing: host memory allocated through ``cudaHostAlloc`` / ``cudaMallocHost`` is directly
accessible from every device that supports unified addressing), and Triton's launcher resolves
the device address of a pointer argument. Triton refuses CPU tensors as arguments, so the pinned
tensor goes in as a small object with ``data_ptr()`` and ``dtype``. :func:`zero_copy_ok` checks
once per process, on a small pinned tensor, that this reads the right bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt import profiles, refmath
from flashrt.dtypes import MAIN_KV_FORMAT
from flashrt.families import KernelFamily, Support
from flashrt.formats import QTensor
from flashrt.kv.util import empty_qtensor
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.codecs import INTERPRETED as _INTERPRETED
from flashrt.kernels_cuda.launch import cdiv, dense, next_pow2
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

BLOCK = 32  # picks per program
_CHECKED: dict[int, bool] = {}  # device index -> zero-copy self-check passed


@triton.jit
def _cold_gather_kernel(pick_ptr, hid_ptr, host_ptr, hscale_ptr, out_ptr, oscale_ptr, idx_ptr, oidx_ptr,
                        total, N, W, P, offset, ROW: tl.constexpr, SROW: tl.constexpr,
                        BLOCK: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr):
    wait_inputs()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    e = tl.load(pick_ptr + i, mask=ok, other=-1)
    page = tl.minimum(tl.maximum(e, 0) // P, W - 1)
    hp = tl.load(hid_ptr + (i // N).to(tl.int64) * W + page, mask=ok, other=-1)
    cold = ok & (e >= 0) & (hp >= 0)
    src = hp.to(tl.int64) * P + tl.maximum(e, 0) % P
    dst = i.to(tl.int64)
    c = tl.arange(0, BR)
    m = cold[:, None] & (c < ROW)[None, :]
    tl.store(out_ptr + dst[:, None] * ROW + c[None, :], tl.load(host_ptr + src[:, None] * ROW + c[None, :], mask=m), mask=m)
    c = tl.arange(0, BS)
    m = cold[:, None] & (c < SROW)[None, :]
    tl.store(oscale_ptr + dst[:, None] * SROW + c[None, :], tl.load(hscale_ptr + src[:, None] * SROW + c[None, :], mask=m),
             mask=m)
    old = tl.load(idx_ptr + i, mask=ok, other=-1)
    tl.store(oidx_ptr + i, tl.where(cold, offset + i, old), mask=ok)


class HostPointer:
    """A pinned host tensor as a Triton pointer argument (Triton refuses CPU tensors)."""

    def __init__(self, t: torch.Tensor):
        self.tensor, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes as ``[rows, words]``: int32 words when ``n % 4 == 0``, else bytes."""
    b = t.view(torch.uint8).reshape(-1, t.shape[-1] * t.element_size())
    return b.view(torch.int32) if b.shape[-1] % 4 == 0 else b


def _arg(t: torch.Tensor):
    return t if _INTERPRETED or t.device.type != "cpu" else HostPointer(t)


def gather_cold_rows(host: QTensor, host_ids: torch.Tensor, picks: torch.Tensor, index: torch.Tensor,
                     offset: int) -> tuple[QTensor, torch.Tensor]:
    """``flashrt.ops.gather_cold_rows``: (staging ``[1, B * N, D]`` in ``host``'s format, int32
    index ``[B, N]``) on the device of ``picks``. ``host`` [pages, P, D] pinned on the CPU (or on
    the device); pages whose data or scale is not contiguous take the plain-torch gather."""
    if not (host.data.is_contiguous() and host.scale.is_contiguous()):  # rows are addressed as flat words
        return refmath.gather_cold_rows(host, host_ids, picks, index, offset)
    B, N = picks.shape
    P, total = host.shape[1], B * N
    picks, host_ids, index = dense(picks), dense(host_ids), dense(index)
    data, scale = byte_rows(host.data), byte_rows(host.scale)
    out = torch.zeros(total, data.shape[1], dtype=data.dtype, device=picks.device)
    oscale = torch.zeros(total, scale.shape[1], dtype=scale.dtype, device=picks.device)
    oidx = torch.empty_like(index)
    if total:
        _cold_gather_kernel[(cdiv(total, BLOCK),)](
            picks, host_ids, _arg(data), _arg(scale), out, oscale, index, oidx, total, N, host_ids.shape[1], P,
            offset, ROW=data.shape[1], SROW=scale.shape[1], BLOCK=BLOCK, BR=next_pow2(data.shape[1]),
            BS=next_pow2(scale.shape[1]), num_warps=4, **pdl.options(picks.device))
    staged = [o.view(torch.uint8).view(t.dtype).view(1, total, t.shape[-1]) for o, t in ((out, host.data),
                                                                                           (oscale, host.scale))]
    return QTensor(staged[0], staged[1], host.fmt, (1, total, host.shape[-1])), oidx


def on_a_zero_copy_device(host, host_ids, picks, index, offset) -> bool:
    """The device's zero-copy self-check passed (the verdict is per device: dispatch resolves per device)."""
    return zero_copy_ok(picks.device)


def zero_copy_ok(device: torch.device) -> bool:
    """Whether the kernel reads pinned host memory correctly on ``device`` (checked once)."""
    if _INTERPRETED or device.type != "cuda":
        return _INTERPRETED
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _CHECKED:
        try:
            host = QTensor(torch.randint(0, 256, (2, 4, 8), dtype=torch.uint8).pin_memory(),
                           torch.randint(0, 120, (2, 4, 1), dtype=torch.uint8).pin_memory().view(torch.float8_e4m3fn),
                           "fp4_b16", (2, 4, 16))
            picks = torch.tensor([[5, -1, 2, 7]], dtype=torch.int32, device=device)
            ids = torch.tensor([[1, 0]], dtype=torch.long, device=device)
            index = torch.full((1, 4), -1, dtype=torch.int32, device=device)
            got, index = gather_cold_rows(host, ids, picks, index, 100)
            rows = torch.tensor([0 * 4 + 1, 0, 1 * 4 + 2, 0 * 4 + 3])  # logical page 0 is host page 1, 1 is 0
            want = host.data.view(8, 8)[rows]
            ok = torch.equal(got.data[0, [0, 2, 3]].cpu(), want[[0, 2, 3]]) and index.tolist() == [[100, -1, 102, 103]]
        except Exception:  # a launcher or driver that refuses host pointers: use the copy path
            ok = False
        _CHECKED[key] = ok
    return _CHECKED[key]


def warmup_cases(device, d: dict, dtype):
    """The cold fetch of a decode step: top-k picks of 1 and 8 sequences from host pages of the
    main KV format (``hkcp_page_entries`` rows a page), pinned when the device is a GPU."""
    P, D = profiles.active_profile().hkcp_page_entries, d["head_dim"]
    host = empty_qtensor(MAIN_KV_FORMAT, (4, P, D), "cpu")
    if device.type == "cuda":
        host = QTensor(host.data.pin_memory(), host.scale.pin_memory(), host.fmt, host.shape)
    for B in (1, 8):
        picks = torch.full((B, d["index_topk"]), -1, dtype=torch.int32, device=device)
        ids = torch.full((B, 4), -1, dtype=torch.long, device=device)
        yield _warmup.Launch("gather_cold_rows", gather_cold_rows, (host, ids, picks, picks.clone(), 0))


FAMILY = KernelFamily(
    "kv_gather", ops={"gather_cold_rows": gather_cold_rows},
    supports={"gather_cold_rows": Support(extra=on_a_zero_copy_device)}, zero_copy={"gather_cold_rows": zero_copy_ok},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="HKCP cold fetch: picked host-page rows read in place from pinned memory")
