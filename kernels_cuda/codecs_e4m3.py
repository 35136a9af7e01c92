"""Device-side packed decode of E4M3 weight bytes (``fp8_w``) to bf16, for the dequantizing MMA loops.

:func:`e4m3_pairs_bf16`: four E4M3 bytes and their four bf16 scales -> four bf16 values, by
:data:`E4M3_PAIRS_PTX` (sm_90+: bf16x2 multiplies that keep subnormals; the interpreter while its PTX
is emulated). A byte's seven magnitude bits are moved to bf16 bits 4-10 and its sign to bit 15, which
reads as its value times 2**-120 (the subnormal codes as bf16 subnormals; a byte permute that replicates
the sign and one shift and one mask a register of two values), one multiply by 2**120 makes it exact
and one by the scale applies the block's power of two (or one multiply by the scale times 2**120,
for scale bytes up to :data:`FOLD_MAX_SCALE`): the products are exact, as the fp32 path's are, so
the bits are the same. The codes 0x7F / 0xFF read as +-480, as :func:`.codecs.e4m3_x256`
reads them for the MMA operands (the load's NaN / Inf check refuses a weight holding them).
"""
from __future__ import annotations

import triton
import triton.language as tl


def _register(out: int, sel: str, scale: int, rebias: bool) -> str:
    """One output register: two of the bytes (``sel``: prmt's selector) as bf16, times 2**120 (``rebias``;
    else the scale holds it), times the scales. The selector puts each byte in the low byte of a 16-bit half
    and its sign bit in all eight bits above it, so one shift by four and one mask leave the seven magnitude
    bits at bf16 bits 4-10 and the sign at bit 15."""
    return (f"prmt.b32 x, $2, z, {sel};\nshl.b32 x, x, 4;\nand.b32 ${out}, x, 0x87F087F0;\n"
            + (f"mul.rn.bf16x2 ${out}, ${out}, k;\n" if rebias else "") + f"mul.rn.bf16x2 ${out}, ${out}, ${scale};\n")


def _pairs_text(rebias: bool, k: int = 0x7B80) -> str:
    """$2: four E4M3 bytes; $3 / $4: the bf16 scales of bytes 0, 1 / 2, 3; out: $0 bytes 0, 1 and $1
    bytes 2, 3 as bf16 pairs. ``k``: the bf16 bits of the re-bias multiplier (2**120 gives the values)."""
    return ("{\n.reg .b32 x, z" + (f", k;\nmov.b32 k, {k << 16 | k:#010x};\n" if rebias else ";\n")
            + "mov.b32 z, 0;\n" + _register(0, "0x9180", 3, rebias) + _register(1, "0xB3A2", 4, rebias) + "}\n")


E4M3_PAIRS_TEXT = _pairs_text(True)
E4M3_PAIRS_PTX = tl.constexpr(E4M3_PAIRS_TEXT)
# the same with the 2**120 in the scale operands (:func:`e8m0_bf16_x2p120`): one multiply a register
# fewer, for scale bytes up to FOLD_MAX_SCALE
E4M3_PAIRS_FOLDED_TEXT = _pairs_text(False)
E4M3_PAIRS_FOLDED_PTX = tl.constexpr(E4M3_PAIRS_FOLDED_TEXT)
# the values times 2**-63 (a re-bias by 2**57): the warp-specialized attention's rows (attention_ws, PACKED)
E4M3_PAIRS_DOWN63_TEXT = _pairs_text(True, 0x5C00)
E4M3_PAIRS_DOWN63_PTX = tl.constexpr(E4M3_PAIRS_DOWN63_TEXT)
FOLD_MAX_SCALE = 134  # the largest UE8M0 byte whose 2**(u - 127) * 2**120 bf16 holds exactly (u + 120 <= 254)


@triton.jit
def e8m0_bf16_x2p120(u):
    """UE8M0 scale bytes (int32, at most FOLD_MAX_SCALE) -> ``2**(u - 127) * 2**120`` as bf16 (exact)."""
    return ((u + 120) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e4m3_pairs_bf16(byte, scale, FOLDED: tl.constexpr = False, DOWN63: tl.constexpr = False):
    """E4M3 bytes (uint8; each thread's four consecutive bytes packed) and a bf16 scale per byte (same
    shape) -> their values times the scales, bf16. FOLDED: ``scale`` holds the 2**120
    (:func:`e8m0_bf16_x2p120`); DOWN63: the values times 2**-63 (:data:`E4M3_PAIRS_DOWN63_TEXT`)."""
    return tl.inline_asm_elementwise(E4M3_PAIRS_DOWN63_PTX if DOWN63 else
                                     (E4M3_PAIRS_FOLDED_PTX if FOLDED else E4M3_PAIRS_PTX), "=r,=r,r,r,r",
                                     [byte, scale], dtype=tl.bfloat16, is_pure=True, pack=4)
