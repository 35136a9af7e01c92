"""The E2M1 word layout: packed fp4 bytes with the bits of each 4-byte word rearranged so that a
GPU decodes the word's eight codes with fewer instructions.

The standard layout (docs/ops.md) keeps code ``2i`` in the low nibble of byte ``i`` and ``2i + 1``
in its high nibble. The word layout keeps the same 4 bytes of each group of eight codes (the same
size, the same byte ranges: slicing at a multiple of 8 codes is unchanged) and moves each code's
three magnitude bits and its sign bit to the positions :data:`WORD_BITS` gives, read on the
little-endian 32-bit word of the 4 bytes. The positions are chosen so that, after one shift and one
mask, a 32-bit register holds two codes as bf16 bit patterns (magnitude at bf16 bits 6-8, sign at
bit 15, in each 16-bit half): codes 0 and 1 need the mask only, codes 2 and 3 a shift by 3, codes 4
and 5 a shift by 6, and codes 6 and 7 three shifts (``codecs_words.E2M1_WORDS_TEXT``). The four
registers then hold the eight codes in element order, two a register, as the MMA operand takes
consecutive K elements: no permute of the values or of the other operand follows.
"""
from __future__ import annotations

import torch

# WORD_BITS[j]: the word bit positions of code j's bits 0, 1, 2 (magnitude) and 3 (sign)
WORD_BITS = (
    (6, 7, 8, 15),  # code 0: the low 16-bit half's bf16 positions as they are
    (22, 23, 24, 31),  # code 1: the high half, as it is
    (3, 4, 5, 12),  # code 2: shifted left by 3
    (19, 20, 21, 28),  # code 3: the high half, shifted left by 3
    (0, 1, 2, 9),  # code 4: shifted left by 6
    (16, 17, 18, 25),  # code 5: the high half, shifted left by 6
    (10, 11, 13, 14),  # code 6: the bits left over, three shifts
    (26, 27, 29, 30),  # code 7: the high half's bits left over
)
# words rearranged at a time: a bounded temporary; on the CPU one that stays in the caches, on a
# device one large enough that each chunk's 48 elementwise launches are not the cost
_CHUNK_WORDS = 1 << 18
_DEVICE_CHUNK_WORDS = 1 << 24


def _bit_map(forward: bool) -> dict[int, int]:
    """Word bit -> word bit of one direction (forward: standard -> word layout); in the standard
    layout code j's bit i is bit 4j + i."""
    pairs = [(4 * j + i, pos) for j, bits in enumerate(WORD_BITS) for i, pos in enumerate(bits)]
    return dict(pairs if forward else [(b, a) for a, b in pairs])


def moves(forward: bool = False) -> list[tuple[int, int]]:
    """(shift, mask) pairs of one direction, for kernels that rearrange words in registers: out |=
    (word >> shift) & mask for shift >= 0, (word << -shift) & mask otherwise, one pair per distinct
    distance a bit travels."""
    by_shift: dict[int, int] = {}
    for src, dst in _bit_map(forward).items():
        by_shift[src - dst] = by_shift.get(src - dst, 0) | (1 << dst)
    return sorted(by_shift.items())


def _signed(mask: int) -> int:
    """``mask`` (a 32-bit pattern) as the int32 value with the same bits."""
    return mask - (1 << 32) if mask >= 1 << 31 else mask


_MOVES = {d: [(shift, _signed(mask)) for shift, mask in moves(d)] for d in (True, False)}


def _rearrange(data: torch.Tensor, forward: bool, name: str) -> torch.Tensor:
    if data.dtype != torch.uint8 or data.dim() == 0 or data.shape[-1] % 4:
        raise ValueError(f"{name}: expected packed fp4 bytes (uint8 [..., n], n % 4 == 0), "
                         f"got {data.dtype} {tuple(data.shape)}")
    src = data.contiguous()
    if src.storage_offset() % 4:  # an int32 view needs its first byte at a multiple of 4
        src = src.clone()
    words = src.view(-1).view(torch.int32)  # little-endian words, as the kernels read them
    out = torch.empty_like(words)
    chunk = _CHUNK_WORDS if words.device.type == "cpu" else _DEVICE_CHUNK_WORDS
    tmp = torch.empty(min(chunk, words.numel()), dtype=torch.int32, device=words.device)
    # each bit moves by one of 16 distances: out |= (word >> d) & mask per distance, on chunks so
    # the temporary stays bounded; an arithmetic right shift's sign copies land outside the mask
    for lo in range(0, words.numel(), chunk):
        part, dst = words[lo:lo + chunk], out[lo:lo + chunk]
        t = tmp[:part.numel()]
        dst.zero_()
        for shift, mask in _MOVES[forward]:
            if shift >= 0:
                torch.bitwise_right_shift(part, shift, out=t)
            else:
                torch.bitwise_left_shift(part, -shift, out=t)
            dst |= t.bitwise_and_(mask)
    return out.view(torch.uint8).view(data.shape)


def to_words(data: torch.Tensor) -> torch.Tensor:
    """Standard packed fp4 bytes (uint8 ``[..., n]``, n % 4 == 0) -> the same codes in the word
    layout (a new tensor, same shape and device)."""
    return _rearrange(data, True, "to_words")


def from_words(data: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_words`."""
    return _rearrange(data, False, "from_words")
