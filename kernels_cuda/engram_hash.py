"""``engram_hash`` in one launch: every n-gram size, head and Engram layer of a chunk's positions.

A program owns ``BLOCK_R`` (sequence, position) rows of one Engram layer (grid axis 1). It walks
the shifts ``j = 0 .. N-1`` (the token ``j`` back, read from ``seq``; ``N`` is a constexpr): a row
is blocked from the first -1 on, its value is then ``pad``; the rolling hash is the int64 xor of
``value * multipliers[l, j]`` (the product wraps, as torch's does), and after each shift ``j >= 1``
it writes the ``H`` heads of n-gram size ``j + 1``: ``remainder(hash, prime) + offset``. Triton's
``%`` truncates towards zero, so a negative remainder gets the prime added (torch.remainder's
non-negative result for a positive prime). Bit-exact with ``refmath.engram_hash``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt import refmath
from flashrt.kernels_cuda.launch import cdiv, dense, next_pow2
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs


@triton.jit
def _engram_hash_kernel(seq_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, R, S, T, L, H, pad,
                        N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    wait_inputs()
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (sequence, position)
    layer = tl.program_id(1).to(tl.int64)
    rm = r < R
    b, s = r // S, r % S
    k = tl.arange(0, BLOCK_H)
    km = k < H
    C = (N - 1) * H
    blocked = tl.zeros([BLOCK_R], dtype=tl.int1)
    rolling = tl.zeros([BLOCK_R], dtype=tl.int64)
    for j in tl.static_range(N):
        tok = tl.load(seq_ptr + b * T + (N - 1 - j) + s, mask=rm, other=0)
        blocked = blocked | (tok == -1)
        value = tl.where(blocked, pad.to(tl.int64), tok)
        rolling = rolling ^ (value * tl.load(mult_ptr + layer * N + j))
        if j > 0:
            col = (j - 1) * H + k
            prime = tl.load(primes_ptr + layer * C + col, mask=km, other=1)
            offset = tl.load(offsets_ptr + layer * C + col, mask=km, other=0)
            rem = rolling[:, None] % prime[None, :]
            rem = tl.where(rem < 0, rem + prime[None, :], rem)
            tl.store(out_ptr + (r[:, None] * L + layer) * C + col[None, :], rem + offset[None, :],
                     mask=rm[:, None] & km[None, :])


def engram_hash(seq, multipliers, primes, offsets, pad: int, tiles: dict) -> torch.Tensor:
    """``flashrt.ops.engram_hash`` with the tiles ``tiles`` (``in_kernel`` off: plain torch)."""
    if not tiles["in_kernel"]:
        return refmath.engram_hash(seq, multipliers, primes, offsets, pad)
    B, T = seq.shape
    L, N = multipliers.shape
    C = primes.shape[1]
    H, S = C // (N - 1), T - (N - 1)
    out = torch.empty(B, S, L, C, dtype=torch.int64, device=seq.device)
    if out.numel():
        block_r = min(tiles["BLOCK_R"], next_pow2(B * S))
        _engram_hash_kernel[(cdiv(B * S, block_r), L)](
            dense(seq), dense(multipliers), dense(primes), dense(offsets), out, B * S, S, T, L, H, pad,
            N=N, BLOCK_R=block_r, BLOCK_H=next_pow2(H), num_warps=tiles["num_warps"], **pdl.options(seq.device))
    return out
