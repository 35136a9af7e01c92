"""E2M1 encoders for ``fp4_b16`` that compare with the block's midpoints instead of dividing by its scale.

``fp4_b16`` codes an element ``x`` of a block with E4M3 scale ``s`` as the E2M1 value nearest the
correctly rounded quotient ``fl(x / s)`` (ties to even, clamped to 6). For each E2M1 midpoint ``M``
(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) the product ``M * s`` is exact in fp32 and in bf16 (at most 3
significant bits times 4, exponents far inside both ranges), and ``fl(x / s)`` is above / equal to /
below ``M`` exactly when ``x`` is above / equal to / below ``M * s``: for ``x != M * s`` the fp32
numbers next to ``M * s``, divided by ``s``, lie more than half a unit of ``M``'s last place from
``M``. So comparing ``|x|`` with the products decides the code. Ties go to the even code: the
midpoints below codes 2, 4 and 6 count as reached when equal, so they are compared with the number
just below them. Three comparisons find the code (a binary search over the seven midpoints); NaN
compares false (code 0 with its sign, as the reference, whose clamp keeps NaN, reaches no midpoint).

- :func:`e2m1_code_of_scaled`: fp32 ``x``, any target and the interpreter;
- :func:`e2m1_bytes_bf16x2`: bf16 ``x``, two elements a call of :data:`E2M1_MIDPOINTS_PTX` (sm_90:
  ``set.gt.u32.bf16x2`` sets each 16-bit half to all ones where it is above, ``lop3`` picks each
  half's next threshold), giving the pair's byte: the same codes.
"""
from __future__ import annotations

import triton
import triton.language as tl

# $0: out (the byte of the pair: element 2j's code in the low nibble); $1: two bf16 elements;
# $2..$8: the thresholds T0..T6 (each bf16 twice), T1, T3 and T5 already the number below their midpoint
E2M1_MIDPOINTS_TEXT = """{
.reg .b32 a, m2, m1, m0, t, u, c;
and.b32 a, $1, 0x7FFF7FFF;
set.gt.u32.bf16x2 m2, a, $5;
lop3.b32 t, m2, $7, $3, 0xCA;
set.gt.u32.bf16x2 m1, a, t;
lop3.b32 t, m1, $8, $6, 0xCA;
lop3.b32 u, m1, $4, $2, 0xCA;
lop3.b32 t, m2, t, u, 0xCA;
set.gt.u32.bf16x2 m0, a, t;
and.b32 c, m2, 0x00040004;
lop3.b32 c, m1, 0x00020002, c, 0xEA;
lop3.b32 c, m0, 0x00010001, c, 0xEA;
shr.b32 t, $1, 12;
lop3.b32 c, t, 0x00080008, c, 0xEA;
shr.b32 t, c, 12;
lop3.b32 $0, c, 0xF, t, 0xEA;
}
"""
E2M1_MIDPOINTS_PTX = tl.constexpr(E2M1_MIDPOINTS_TEXT)  # as a kernel reads it


@triton.jit
def _below(t):
    """The fp32 number just below positive normal ``t``: ``a > _below(t)`` is ``a >= t`` for fp32 ``a``."""
    return (t.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_code_of_scaled(x, scale):
    """E2M1 codes (int32, sign in bit 3, from ``x``) of fp32 ``x / scale`` for an E4M3 ``scale``
    (broadcast to ``x``): the code's bits by three comparisons with the midpoints times ``scale``."""
    a = tl.abs(x)
    hi = a > _below(1.75 * scale)
    b1 = a > tl.where(hi, _below(3.5 * scale), _below(0.75 * scale))
    b0 = a > tl.where(hi, tl.where(b1, 5.0 * scale, 2.5 * scale), tl.where(b1, 1.25 * scale, 0.25 * scale))
    code = hi.to(tl.int32) * 4 + b1.to(tl.int32) * 2 + b0.to(tl.int32)
    return code | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _bf16(t, BELOW: tl.constexpr):
    """fp32 ``t`` (exact in bf16) as bf16, or the bf16 number just below it (BELOW)."""
    b = t.to(tl.bfloat16)
    if BELOW:
        b = (b.to(tl.int16, bitcast=True) - 1).to(tl.bfloat16, bitcast=True)
    return b


@triton.jit
def e2m1_bytes_bf16x2(x, scale):
    """bf16 ``x`` (pairs of consecutive elements in a thread's registers) and fp32 E4M3 ``scale``
    (broadcast to ``x``) -> int16, the pair's byte (low element's code in the low nibble) in the
    elements ``2j``, zero in ``2j + 1`` (sm_90; under the interpreter only while its PTX is emulated)."""
    return tl.inline_asm_elementwise(
        E2M1_MIDPOINTS_PTX, "=r,r,r,r,r,r,r,r,r",
        [x, _bf16(0.25 * scale, False), _bf16(0.75 * scale, True), _bf16(1.25 * scale, False),
         _bf16(1.75 * scale, True), _bf16(2.5 * scale, False), _bf16(3.5 * scale, True), _bf16(5.0 * scale, False)],
        dtype=tl.int16, is_pure=True, pack=2)
