"""Device-side decoders of packed fp4 in the E2M1 word layout (:mod:`flashrt.e2m1_words`).

- :func:`e2m1_words_bf16`: the packed decode (:func:`.codecs.e2m1_ordered_bf16`'s contract: four bytes
  in, their eight codes' values times their scales out in element order, codes 0-3 and 4-7, bf16) on
  bytes stored in the word layout, by :data:`E2M1_WORDS_PTX` (sm_90+; the interpreter while its PTX is
  emulated): two output registers take one shift and one mask each, one only the mask, the last three
  shifts, against a byte permute, a shift and a mask a register and a shift a word for the standard
  nibbles (no byte permutes here).
- :func:`e2m1_words_nibbles`: bytes in the word layout back to the standard nibbles, in registers
  (any architecture and the interpreter: the paths that decode code by code).
"""
from __future__ import annotations

import triton
import triton.language as tl

from flashrt.e2m1_words import moves


def _register(out: int, shift: int, scale: int, rebias: bool) -> str:
    """One output register: the word shifted left by ``shift`` (0: as it is), masked to bf16 bits 6-8
    and 15 of both halves, times 2**126 (``rebias``), times the scales."""
    src = "$4"
    text = ""
    if shift:
        text, src = f"shl.b32 t, $4, {shift};\n", "t"
    return (text + f"and.b32 ${out}, {src}, 0x81C081C0;\n" + (f"mul.rn.bf16x2 ${out}, ${out}, k;\n" if rebias else "")
            + f"mul.rn.bf16x2 ${out}, ${out}, ${scale};\n")


def _words_text(rebias: bool) -> str:
    """$4: a word of four bytes in the word layout; $5 / $6: the bf16 scales of bytes 0, 1 / 2, 3.
    Out: $0 codes 0, 1; $1 codes 2, 3; $2 codes 4, 5; $3 codes 6, 7 (code 2i: byte i's low nibble in
    the standard layout), each a bf16 pair. Codes 6 and 7 keep their magnitude bits 0-1 four places
    above bf16's, bit 2 five above and the sign one below."""
    return ("{\n.reg .b32 t, u, v" + (", k;\nmov.b32 k, 0x7E807E80;\n" if rebias else ";\n")
            + _register(0, 0, 5, rebias) + _register(1, 3, 5, rebias) + _register(2, 6, 6, rebias)
            + "shr.b32 t, $4, 4;\nand.b32 t, t, 0x00C000C0;\nshr.b32 u, $4, 5;\nand.b32 u, u, 0x01000100;\n"
            + "or.b32 t, t, u;\nshl.b32 v, $4, 1;\nand.b32 v, v, 0x80008000;\nor.b32 $3, t, v;\n"
            + ("mul.rn.bf16x2 $3, $3, k;\n" if rebias else "") + "mul.rn.bf16x2 $3, $3, $6;\n}\n")


E2M1_WORDS_TEXT = _words_text(True)
E2M1_WORDS_PTX = tl.constexpr(E2M1_WORDS_TEXT)
E2M1_WORDS_FOLDED_TEXT = _words_text(False)  # the 2**126 re-bias held by the scales (codecs.e8m0_bf16_x2p126)
E2M1_WORDS_FOLDED_PTX = tl.constexpr(E2M1_WORDS_FOLDED_TEXT)


@triton.jit
def e2m1_words_bf16(byte, scale, FOLDED: tl.constexpr = False):
    """fp4 bytes in the word layout (uint8, each thread's four consecutive bytes one word) and a bf16
    scale per byte -> (codes 0-3, codes 4-7) of each word times the scales, as
    :func:`.codecs.e2m1_ordered_bf16` returns them for the standard bytes (bytes 0, 1 take the first
    scale of each pair, bytes 2, 3 the second: a word's eight codes share one scale in the weights)."""
    return tl.inline_asm_elementwise(E2M1_WORDS_FOLDED_PTX if FOLDED else E2M1_WORDS_PTX, "=r,=r,=r,=r,r,r,r",
                                     [byte, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


def _signed(mask: int) -> int:
    return mask - (1 << 32) if mask >= 1 << 31 else mask


_MOVES = moves(forward=False)
SHIFTS = tl.constexpr(tuple(s for s, _ in _MOVES))  # word layout -> standard: a bit's right shift
MASKS = tl.constexpr(tuple(_signed(m) for _, m in _MOVES))  # the standard bits each shift fills (int32)
N_MOVES = tl.constexpr(len(_MOVES))


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def e2m1_words_nibbles(b, R: tl.constexpr, L: tl.constexpr):
    """Bytes ``b`` [R, L] (int32 0..255, L % 4 == 0; each 4 consecutive bytes one word) in the word
    layout -> the same codes' standard bytes (int32 [R, L])."""
    lane = tl.arange(0, 4) * 8
    word = tl.reduce(tl.reshape(b, (R, L // 4, 4)) << lane[None, None, :], 2, _or)
    std = tl.zeros([R, L // 4], tl.int32)
    for i in tl.static_range(N_MOVES):
        if SHIFTS[i] >= 0:
            std = std | ((word >> SHIFTS[i]) & MASKS[i])
        else:
            std = std | ((word << -SHIFTS[i]) & MASKS[i])
    return tl.reshape((std[:, :, None] >> lane[None, None, :]) & 0xFF, (R, L))
