"""Split-K reduction inside the GEMM launch: the last program of an output tile sums the partials.

A GEMM with few output tiles (decode) splits K over programs. Instead of writing fp32 partials and
summing them with two more launches (``sum`` and a cast), each program of a tile stores its fp32
partial into a workspace ``[splits, M, N]``, then takes a ticket from the tile's counter (an atomic
add, acquire-release at GPU scope, after a barrier so every thread's stores are ordered before it).
The program that draws the last ticket reads the partials in split order (a deterministic sum),
rounds once to the output dtype, stores the tile, and puts the counter back to zero, so the
counters are ready for the next launch without a memset (and inside a CUDA graph).

The counters live in one zero-filled int32 pool per device and stream, shared by every launch on
that stream: launches on one stream run one after another and each leaves its counters at zero,
while kernels of two streams may run at once (graphs/mix_stream.py), so each stream has its own
pool. A stream's pool is made at its first launch; when that launch is being captured into a CUDA
graph, the pool comes from the graph's memory pool and its zero fill is a node of the graph, which
every replay runs before the stream's first kernel (harmless: the counters are zero there anyway).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.kernels_cuda.codecs import to_out
from flashrt.kernels_cuda.launch import cdiv, split_k

POOL = 1 << 14  # counters allocated per device (tiles of one split launch must fit; more: no fused reduction)
_POOLS: dict = {}


def counters(device: torch.device) -> torch.Tensor:
    """The zero-filled int32 ticket counters of ``device``'s current stream (allocated once per stream)."""
    key = (device.type, device.index, _raw_stream(device) if device.type == "cuda" else 0)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = torch.zeros(POOL, dtype=torch.int32, device=device)
    return pool


def _raw_stream(device: torch.device) -> int:
    """The handle of ``device``'s current CUDA stream (the call Triton's launcher makes per launch)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


def outputs(plan: dict, m: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, workspace, counters) of a GEMM launch of ``plan`` (its ``split``, ``reduce`` and
    ``out_dtype``): out [1 or splits, m, n]; the fp32 workspace [splits, m, n] and the ticket counters
    only where the split meets in the kernel (else out stands in for both)."""
    out = torch.empty(1 if plan["reduce"] else plan["split"], m, n, dtype=plan["out_dtype"], device=device)
    if not plan["reduce"]:
        return out, out, out
    return out, torch.empty(plan["split"], m, n, dtype=torch.float32, device=device), counters(device)


def result(out: torch.Tensor, plan: dict, dtype: torch.dtype) -> torch.Tensor:
    """The [m, n] result of a launch's :func:`outputs`: the one split or the in-kernel sum as it is,
    else the fp32 partials summed and cast to ``dtype``."""
    return out[0] if plan["split"] == 1 or plan["reduce"] else out.sum(0).to(dtype)


def fits(tiles: int) -> bool:
    """Whether a launch with ``tiles`` output tiles can reduce in place (one counter per tile)."""
    return tiles <= POOL


def splits(out_tiles: int, k: int, block_k: int, sms: int, forced=None, min_blocks: int | None = 4,
           per_sm: int | None = None) -> tuple[int, int]:
    """(K splits, K per split: whole ``block_k`` blocks) of a GEMM launch with ``out_tiles`` output
    tiles over ``k`` (:func:`flashrt.kernels_cuda.launch.split_k`'s rule, ``min_blocks`` K blocks a
    split at least, aiming at ``per_sm`` programs an SM where set); the last split may be shorter."""
    blocks = cdiv(k, block_k)
    k_split = cdiv(blocks, split_k(out_tiles, blocks, forced, sms, min_blocks, per_sm)) * block_k
    return cdiv(k, k_split), k_split


def narrow_block_n(block_n: int, n: int, other_tiles: int, sms: int, min_block_n: int | None) -> int:
    """``block_n`` halved, down to ``min_block_n`` (None: ``block_n`` as it is), while the launch's
    ``other_tiles`` x ``cdiv(n, block_n)`` output tiles at the halved width still fit in ``sms``
    programs: small output widths get more, narrower column tiles, and a K split (which needs
    fewer tiles than SMs) can still fill the rest."""
    if min_block_n is None:
        return block_n
    while block_n // 2 >= max(32, int(min_block_n)) and other_tiles * cdiv(n, block_n // 2) <= sms:
        block_n //= 2
    return block_n


@triton.jit
def last_ticket(counter, n, mask=None):
    """Take a ticket from ``counter`` once this program's stores are published (a barrier, then an
    atomic add, acquire-release at GPU scope): true where it is the last of ``n`` tickets, i.e. every
    other partial is stored and visible. A block of counters takes one ticket each where ``mask``;
    the result is only meaningful there."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, mask=mask, sem="acq_rel", scope="gpu") == n - 1


@triton.jit
def reset_ticket(counter, mask=None):
    """Put ``counter`` back to zero (by the program that drew the last ticket, where ``mask``), so the
    pool is ready for the next launch."""
    tl.atomic_xchg(counter, 0, mask=mask, sem="relaxed", scope="gpu")


@triton.jit
def store_tile(acc, out_ptr, ws_ptr, cnt_ptr, tile, split, n_splits, rows, cols, ok, stride_om, M, N,
               OUT: tl.constexpr, REDUCE: tl.constexpr):
    """Store fp32 ``acc`` (rows x cols of the output, mask ``ok``) rounded to ``OUT``; with REDUCE,
    as partial ``split`` of ``n_splits``, the last program of ``tile`` storing the ordered sum."""
    r64 = rows.to(tl.int64)
    if REDUCE:
        part = ws_ptr + r64[:, None] * N + cols[None, :]
        tl.store(part + split.to(tl.int64) * M * N, acc, mask=ok)
        if last_ticket(cnt_ptr + tile, n_splits):
            total = tl.zeros(acc.shape, tl.float32)
            for s in range(n_splits):
                total += tl.load(part + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + r64[:, None] * stride_om + cols[None, :], to_out(total, OUT), mask=ok)
            reset_ticket(cnt_ptr + tile)
    else:
        tl.store(out_ptr + r64[:, None] * stride_om + cols[None, :], to_out(acc, OUT), mask=ok)
