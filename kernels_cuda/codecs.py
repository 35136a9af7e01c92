"""Device-side codecs of the stored formats (:mod:`flashrt.formats`), shared by every kernel file.

Element decoders (stored bytes widened to int32 unless said otherwise), all exact:

- :func:`e8m0_to_f32` UE8M0 scale bytes -> ``2**(u - 127)`` (0 -> 2**-127, 255 -> NaN);
  :func:`pow2` ``2**(biased - 127)`` for an exponent already offset (UE8M0 byte + k, in [1, 254]);
- :func:`e4m3_x256` E4M3 -> its value times 2**-8 as fp16, the 7 magnitude bits placed in fp16's
  (any architecture, no NaN codes: the dot operand path of ``linear`` / ``moe``);
  :func:`e4m3_to_f32` the fp32 value from the same bits, NaN for 0x7F / 0xFF (any architecture);
  :func:`e4m3_cvt` through the hardware conversion (float8e4nv: sm_89+; the bit decode on sm_80),
  NaN codes fixed up under the interpreter (whose conversion returns +-480 for them; the GPU's
  returns NaN);
- :func:`e2m1_x16384` E2M1 codes (sign in bit 3) -> value times 2**-14 as fp16 (the 0.5 code is an
  fp16 subnormal, kept by the fp16 -> fp32 conversion where an fp32 subnormal could be flushed);
  :func:`e2m1_to_f32` the fp32 value; :func:`e2m1_pairs_bf16` both codes of each byte times their
  UE8M0 scale as bf16, decoded in packed registers by :data:`E2M1_PAIRS_PTX` (sm_90+; under the
  interpreter only while its PTX is emulated, :func:`ptx_sm90`).

Row decoder: :func:`dequant_rows` turns a ``[R, bytes]`` tile of stored rows and its ``[R, blocks]``
scale bytes into fp32 ``[R, elements]`` for every KV / key format (codes :data:`CODES`).

Encoders (bit-exact with :mod:`flashrt.formats`): :func:`e4m3_rne` on the bits (the interpreter's
float8 conversion does not round to nearest even, and sm_80 has none), :func:`e4m3_encode` through
the hardware conversion where there is one (sm_89+), else :func:`e4m3_rne`; :func:`e2m1_code` on
the bits (for ``fp4_b16``'s E4M3 scale, by comparisons with the midpoints times the scale:
:mod:`.codecs_e2m1`); :func:`block_scale`; :func:`fake_blocks` the values a block's bytes would stand for;
:func:`to_out` rounds fp32 to an output dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

try:  # the compile target, read inside a kernel (recent Triton; older: see e4m3_cvt)
    from triton.language.target_info import cuda_capability_geq
except ImportError:
    cuda_capability_geq = None

from flashrt.jit_triton import interpreted
from flashrt.kernels_cuda.codecs_e2m1 import e2m1_code_of_scaled
from flashrt.kernels_cuda.codecs_e4m3 import e4m3_pairs_bf16

CODES = {"fp8": 1, "fp4_b16": 2, "fp4_b32": 3, "int8": 4}  # FMT constexpr of the kernels; 0 = plain float
INTERPRETED = interpreted()  # kernels run in Triton's CPU interpreter (fixed when Triton is imported)
_INTERPRETED = tl.constexpr(INTERPRETED)
# Under the interpreter, "on" while an evaluator of inline PTX is installed in it (the tests' emulator,
# tests/ptx_interpreter.py): launches then take the sm_90 PTX paths, so those run on the CPU too.
PTX_EMULATED = {"on": False}


def ptx_sm90() -> bool:
    """Whether launches take the sm_90 inline-PTX paths: compiled for an sm_90+ target, or run by the
    interpreter while its inline PTX is emulated (:data:`PTX_EMULATED`)."""
    if INTERPRETED:
        return PTX_EMULATED["on"]
    from flashrt import jit_targets

    return jit_targets.capability() >= (9, 0)


# --------------------------------------------------------------------------------------- decoders


@triton.jit
def e8m0_to_f32(u):
    """fp32 ``2**(u - 127)`` of UE8M0 bytes ``u`` (int32; 0 -> 2**-127 subnormal, 255 -> NaN)."""
    bits = tl.where(u == 0, 0x00400000, tl.where(u == 255, 0x7FC00000, u << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pow2(biased):
    """fp32 ``2**(biased - 127)`` for a biased exponent (int32) in [1, 254]: UE8M0 bytes plus offsets."""
    return (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_f16(b):
    """E4M3 bytes (int32) -> value * 2**-8 as fp16: sign to bit 15, exponent and mantissa to bits 13..7."""
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def e4m3_x256(b):
    """E4M3 as loaded (uint8 / float8e4nv) -> value * 2**-8 as fp16 (0x7F / 0xFF read as +-480, not NaN)."""
    return _e4m3_f16(b.to(tl.uint8, bitcast=True).to(tl.int32))


@triton.jit
def e4m3_to_f32(b):
    """fp32 value of E4M3 bytes ``b`` (int32; NaN for 0x7F / 0xFF), decoded on the bits (any arch)."""
    return tl.where((b & 0x7F) == 0x7F, float("nan"), _e4m3_f16(b).to(tl.float32) * 256.0)


if cuda_capability_geq is not None:
    @triton.jit
    def e4m3_cvt(x):
        """fp32 value of E4M3 bytes ``x`` (uint8 / int32; NaN for 0x7F / 0xFF) by the hardware conversion
        where the target has one (sm_89+), else decoded on the bits (:func:`e4m3_to_f32`: sm_80)."""
        if _INTERPRETED:  # the interpreter converts the NaN codes to +-480
            v = x.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            v = tl.where((x.to(tl.int32) & 0x7F) == 0x7F, float("nan"), v)
        elif cuda_capability_geq(8, 9):
            v = x.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = e4m3_to_f32(x.to(tl.uint8).to(tl.int32))
        return v
else:  # a Triton that cannot ask for the target inside a kernel: the hardware conversion (sm_89+)
    @triton.jit
    def e4m3_cvt(x):
        """fp32 value of E4M3 bytes ``x`` (uint8 / int32) by the hardware conversion (sm_89+; NaN for 0x7F / 0xFF)."""
        v = x.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if _INTERPRETED:  # the interpreter converts the NaN codes to +-480
            v = tl.where((x.to(tl.int32) & 0x7F) == 0x7F, float("nan"), v)
        return v


@triton.jit
def e2m1_x16384(c):
    """E2M1 codes (int32, low 4 bits, sign in bit 3) -> value * 2**-14 as fp16 (the code's bits in fp16's)."""
    return (((c & 8) << 12) | ((c & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)


# E2M1_PAIRS_TEXT: four fp4 bytes (eight E2M1 codes) in $4 -> their values times the scales: the low nibbles' four
# bf16 in $0 (bytes 0, 1) and $1 (bytes 2, 3), the high nibbles' in $2 and $3; $5 / $6 hold the
# bf16 scales of bytes 0, 1 / 2, 3. A code's 3 magnitude bits are moved to bf16 bits 6-8 and its sign to
# bit 15, which reads as the code's value times 2**-126 (the 0.5 code a bf16 subnormal); one multiply by
# 2**126 (0x7E80) makes it exact, one by the scale applies the block's power of two (sm_90's bf16x2
# multiplies keep subnormals). prmt's sign-replicating selectors put two bytes in the low bytes of a
# register's 16-bit halves with each byte's bit 7 (the high nibble's sign) in the eight bits above it, so
# one shift by two and one mask leave a high nibble's magnitude at bits 6-8 and its sign at bit 15; the
# low nibbles take the same steps on the word shifted by four (each byte's low nibble in its high half).
# 21 instructions for the eight codes (17 with the re-bias folded into the scales), plus moves of constants.


def _e2m1_register(out: int, src: str, sel: str, scale: int, rebias: bool = True) -> str:
    """PTX of one output register: the high nibbles of the two bytes of ``src`` that ``sel`` (a prmt
    selector replicating each byte's sign above it) picks, moved into bf16 positions (magnitude bits to
    6-8, sign to 15), times 2**126 (``rebias``; else the scale holds it), times the scales."""
    return (f"prmt.b32 x, {src}, z, {sel};\nshl.b32 x, x, 2;\nand.b32 ${out}, x, 0x81C081C0;\n"
            + (f"mul.rn.bf16x2 ${out}, ${out}, k;\n" if rebias else "")
            + f"mul.rn.bf16x2 ${out}, ${out}, ${scale};\n")


def _e2m1_pairs_text(rebias: bool) -> str:
    return ("{\n.reg .b32 x, w, z, k;\nmov.b32 z, 0;\n" + ("mov.b32 k, 0x7E807E80;\n" if rebias else "")
            + "shl.b32 w, $4, 4;\n"  # each byte's low nibble in its high half (its high nibble never read)
            + _e2m1_register(0, "w", "0x9180", 5, rebias) + _e2m1_register(1, "w", "0xB3A2", 6, rebias)  # low
            + _e2m1_register(2, "$4", "0x9180", 5, rebias) + _e2m1_register(3, "$4", "0xB3A2", 6, rebias)  # high
            + "}\n")


E2M1_PAIRS_TEXT = _e2m1_pairs_text(True)
E2M1_PAIRS_PTX = tl.constexpr(E2M1_PAIRS_TEXT)  # as a kernel reads it
# the same decode with the 2**126 re-bias in the scale operands (:func:`e8m0_bf16_x2p126`): one
# multiply a register fewer, for scale bytes up to 128
E2M1_PAIRS_FOLDED_TEXT = _e2m1_pairs_text(False)
E2M1_PAIRS_FOLDED_PTX = tl.constexpr(E2M1_PAIRS_FOLDED_TEXT)


def _e2m1_ordered_text(rebias: bool) -> str:
    """The decode with the codes in element order: $0..$3 hold byte 0's .. byte 3's low and high codes (one
    byte a register: prmt takes its low nibble from the word shifted by four and its high nibble from the
    word, each with its sign replicated above it), so interleaving the low and high codes takes no 16-bit
    permutes after the call. $5 / $6: the bf16x2 scales of bytes 0, 1 / 2, 3."""
    return ("{\n.reg .b32 x, w, k;\n" + ("mov.b32 k, 0x7E807E80;\n" if rebias else "") + "shl.b32 w, $4, 4;\n"
            + "".join(f"prmt.b32 x, w, $4, {sel};\nshl.b32 x, x, 2;\nand.b32 ${r}, x, 0x81C081C0;\n"
                      + (f"mul.rn.bf16x2 ${r}, ${r}, k;\n" if rebias else "")
                      + f"mul.rn.bf16x2 ${r}, ${r}, ${5 + r // 2};\n"
                      for r, sel in enumerate(("0xC480", "0xD591", "0xE6A2", "0xF7B3")))
            + "}\n")


E2M1_ORDERED_TEXT = _e2m1_ordered_text(True)
E2M1_ORDERED_PTX = tl.constexpr(E2M1_ORDERED_TEXT)
E2M1_ORDERED_FOLDED_TEXT = _e2m1_ordered_text(False)  # the 2**126 (or part of it) held by the scales
E2M1_ORDERED_FOLDED_PTX = tl.constexpr(E2M1_ORDERED_FOLDED_TEXT)


@triton.jit
def e8m0_bf16(u):
    """UE8M0 scale bytes (int32) -> ``2**(u - 127)`` as bf16: the byte in bf16's exponent field, 0 ->
    the subnormal 2**-127, 255 -> NaN."""
    bits = tl.where(u == 0, 0x40, tl.where(u == 255, 0x7FC0, u << 7))
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e8m0_bf16_x2p126(u):
    """UE8M0 scale bytes (int32, at most 128) -> ``2**(u - 127) * 2**126 = 2**(u - 1)`` as bf16 (exact:
    the exponent field u + 126 <= 254): the packed decode's scale with its re-bias folded in."""
    return ((u + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_ordered_bf16(byte, scale, FOLDED: tl.constexpr = False):
    """fp4 bytes (uint8, each thread's four consecutive bytes packed) and a bf16 scale per byte (same shape)
    -> (codes 0-3, codes 4-7) of each four bytes times their scales, bf16, :data:`E2M1_ORDERED_PTX`: element
    ``i`` of the first is code ``i`` of the four bytes (byte ``i // 2``'s low nibble for even ``i``), of the
    second code ``4 + i``: joined on a new last dim, the four bytes' dim split in groups of four and the
    join's dim moved before them, they read in element order (a relabelling of registers). FOLDED: no
    multiply by 2**126 (``scale`` holds what of it the caller wants)."""
    return tl.inline_asm_elementwise(E2M1_ORDERED_FOLDED_PTX if FOLDED else E2M1_ORDERED_PTX, "=r,=r,=r,=r,r,r,r",
                                     [byte, scale],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def e2m1_pairs_bf16(byte, scale, FOLDED: tl.constexpr = False):
    """fp4 bytes (uint8, two E2M1 codes each: the low nibble first) and a bf16 scale per byte (same
    shape) -> (low codes' values, high codes' values) times the scales, bf16 (exact down to bf16's
    smallest normal, 2**-126; below, bf16 subnormals), :data:`E2M1_PAIRS_PTX`. FOLDED: ``scale``
    already holds the 2**126 re-bias (:func:`e8m0_bf16_x2p126`), :data:`E2M1_PAIRS_FOLDED_PTX`."""
    return tl.inline_asm_elementwise(E2M1_PAIRS_FOLDED_PTX if FOLDED else E2M1_PAIRS_PTX, "=r,=r,=r,=r,r,r,r",
                                     [byte, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def e2m1_to_f32(c):
    """fp32 value of E2M1 codes (int32 in 0..15; code 8 is -0.0)."""
    return e2m1_x16384(c).to(tl.float32) * 16384.0


@triton.jit
def _expand(s, R: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr):
    """[R, NB] block scales -> [R, NB * BS], each repeated over its block."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (R, NB, BS)), (R, NB * BS))


# dequant_rows decodes fp4_b16 in packed registers on an sm_90+ target, and under the interpreter only
# while its PTX is emulated (inline PTX; bf16x2 multiplies that keep subnormals); a Triton that cannot
# ask for the target inside a kernel decodes code by code
if cuda_capability_geq is not None and not INTERPRETED:
    @triton.constexpr_function
    def _packed_target():
        return cuda_capability_geq(9, 0)
else:
    @triton.constexpr_function
    def _packed_target():
        return INTERPRETED and PTX_EMULATED["on"]


@triton.jit
def dequant_rows(x, u, FMT: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, PACKED: tl.constexpr = False):
    """fp32 [R, BLOCK_D] values of stored rows ``x`` [R, bytes] with scale bytes ``u`` [R, blocks]:
    plain (0: ``x`` already values), fp8 (1: E4M3, UE8M0 / 32), fp4_b16 (2: E2M1, E4M3 / 16),
    fp4_b32 (3: E2M1, UE8M0 / 32), int8 (4: UE8M0 / 32); E2M1 element 2i is the low nibble.
    E4M3 data and E4M3 scales go through the hardware conversion (sm_89+). fp4_b16 with PACKED on an
    sm_90 target: eight codes a call in packed bf16 registers (:func:`e2m1_pairs_bf16`, the scale an
    exact bf16: every product of an E2M1 code and an E4M3 scale is exact in bf16, so the values are
    the same); fp8 with PACKED there: four bytes a call (:func:`.codecs_e4m3.e4m3_pairs_bf16`, the UE8M0
    scale as bf16: the product rounded to bf16 once, as the MMA operands take the fp32 path's)."""
    PACKED_FP4_B16: tl.constexpr = PACKED and FMT == 2 and _packed_target()
    PACKED_FP8: tl.constexpr = PACKED and FMT == 1 and _packed_target()
    if FMT == 0:
        v = x.to(tl.float32)
    elif PACKED_FP8:
        scale = _expand(e8m0_bf16(u.to(tl.int32)), R, BLOCK_D // 32, 32)  # one per byte
        v = e4m3_pairs_bf16(x.to(tl.uint8), scale).to(tl.float32)
    elif PACKED_FP4_B16:
        scale = _expand(e4m3_cvt(u).to(tl.bfloat16), R, BLOCK_D // 16, 8)  # one per byte
        lo, hi = e2m1_pairs_bf16(x.to(tl.uint8), scale)
        v = tl.interleave(lo, hi).to(tl.float32)
    elif FMT == 1:
        v = e4m3_cvt(x) * _expand(e8m0_to_f32(u.to(tl.int32)), R, BLOCK_D // 32, 32)
    elif FMT == 4:
        v = x.to(tl.int8, bitcast=True).to(tl.float32) * _expand(e8m0_to_f32(u.to(tl.int32)), R, BLOCK_D // 32, 32)
    else:
        p = x.to(tl.int32)
        v = e2m1_x16384(tl.interleave(p & 15, p >> 4)).to(tl.float32)
        if FMT == 2:
            v = v * _expand(e4m3_cvt(u) * 16384.0, R, BLOCK_D // 16, 16)
        else:  # 2**14 times the element first: 2**14 times a UE8M0 scale can overflow
            v = v * 16384.0 * _expand(e8m0_to_f32(u.to(tl.int32)), R, BLOCK_D // 32, 32)
    return v


# --------------------------------------------------------------------------------------- encoders


@triton.jit
def e4m3_rne(v):
    """E4M3 byte (int32) of fp32 ``v`` with ``|v| <= 448``: nearest, ties to even, sign kept."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a_bits = bits & 0x7FFFFFFF
    lsb = (a_bits >> 20) & 1
    normal = ((a_bits + 0x7FFFF + lsb) >> 20) - (120 << 3)  # rebias 127 -> 7, 3 mantissa bits
    q = tl.minimum(a_bits.to(tl.float32, bitcast=True), 0.015625) * 512.0  # subnormal units of 2**-9
    n = q.to(tl.int32)
    frac = q - n.to(tl.float32)
    sub = n + ((frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))).to(tl.int32)
    return tl.where(a_bits < 0x3C800000, sub, normal) | sign  # 0x3C800000 = 2**-6


if cuda_capability_geq is not None:
    @triton.jit
    def e4m3_encode(v):
        """:func:`e4m3_rne` of fp32 ``v`` (``|v| <= 448``) by the hardware conversion where the target
        has one (sm_89+: ``cvt.rn.satfinite``, nearest, ties to even, the same bytes), else on the bits."""
        if _INTERPRETED:  # the interpreter's float8 conversion does not round to nearest even
            b = e4m3_rne(v)
        elif cuda_capability_geq(8, 9):
            b = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
        else:
            b = e4m3_rne(v)
        return b
else:  # a Triton that cannot ask for the target inside a kernel: on the bits everywhere
    @triton.jit
    def e4m3_encode(v):
        """:func:`e4m3_rne` of fp32 ``v`` (``|v| <= 448``)."""
        return e4m3_rne(v)


@triton.jit
def e2m1_magnitude(v):
    """E2M1 codes (int32, bit 3 clear) of fp32 ``|v|``: clamp to 6, nearest, ties to even.

    On the fp32 bits, no comparisons: from 1 up, the bits rounded to one mantissa bit (the carry
    moves into the exponent) give ``(exponent << 1 | mantissa bit)``, 2 for 1.0 ... 7 for 6.0;
    below 1 the codes are the number of halves (0, 1, 2), which the fp32 addition of 2**22 rounds
    to (its unit in the last place is 0.5; ties to even as the format's)."""
    a = tl.minimum(tl.abs(v), 6.0)
    bits = a.to(tl.int32, bitcast=True)
    big = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252  # 252 = exponent 126 << 1
    small = (a + 4194304.0).to(tl.int32, bitcast=True) - 0x4A800000  # 0x4A800000 = 2**22
    return tl.where(a >= 1.0, big, small)


@triton.jit
def e2m1_code(v):
    """E2M1 codes (int32, sign in bit 3) of fp32 ``v`` (:func:`e2m1_magnitude`, sign from bit 31)."""
    return e2m1_magnitude(v) | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def block_scale(amax, FMT: tl.constexpr):
    """(stored byte int32, scale fp32, 1 / scale fp32) for fp32 block maxima (FMT as :data:`CODES`);
    ``1 / scale`` exact for the power-of-two scales, correctly rounded for ``fp4_b16``'s E4M3 one."""
    if FMT == 2:  # fp4_b16: e4m3(max(amax, 6 * 2**-9) / 6), clamped to 448
        v = tl.math.div_rn(tl.maximum(amax, 0.01171875), tl.full(amax.shape, 6.0, tl.float32))
        byte = e4m3_rne(tl.minimum(v, 448.0))
        scale = e4m3_to_f32(byte)
        return byte, scale, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
    if FMT == 1:  # fp8: 2**ceil(log2(max(amax, 1e-4) / 448))
        v = tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
    else:  # fp4_b32: 2**ceil(log2(max(amax, 6 * 2**-126) / 6))
        v = tl.math.div_rn(tl.maximum(amax, 7.052966104933725e-38), tl.full(amax.shape, 6.0, tl.float32))
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 1), 254)  # the floors keep e >= 1
    recip_bits = tl.where(e >= 254, 0x00200000, (254 - e) << 23)  # 2**(127 - e), 2**-127 subnormal
    return e, e8m0_to_f32(e), recip_bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_block_codes(x, scale, recip, FMT: tl.constexpr):
    """E2M1 codes of ``x`` over its blocks' ``scale`` / ``recip`` (broadcast to ``x``'s shape): FMT
    ``fp4_b16`` by comparisons with the midpoints times the E4M3 scale (:mod:`.codecs_e2m1`),
    ``fp4_b32`` from the exact product with the power of two's reciprocal."""
    if FMT == 2:
        c = e2m1_code_of_scaled(x, scale)
    else:
        c = e2m1_code(x * recip)
    return c


@triton.jit
def store_blocks(data_ptr, offset, x, scale, recip, mask, FMT: tl.constexpr, BLK: tl.constexpr, N: tl.constexpr):
    """Store ``N`` blocks of fp32 ``x [N, BLK]`` in format FMT (``fp8``, ``fp4_b16``, ``fp4_b32``)
    with their :func:`block_scale` ``scale`` / ``recip`` [N]: block ``i``'s bytes start at byte
    ``offset[i]`` of ``data_ptr`` (E4M3 bytes, or E2M1 codes packed two a byte, low nibble first)."""
    if FMT == 1:
        v = tl.minimum(tl.maximum(x * recip[:, None], -448.0), 448.0)
        e = tl.arange(0, BLK)
        tl.store(data_ptr + offset[:, None] + e[None, :], e4m3_encode(v).to(tl.uint8), mask=mask[:, None])
    else:
        lo, hi = tl.split(tl.reshape(e2m1_block_codes(x, scale[:, None], recip[:, None], FMT), (N, BLK // 2, 2)))
        h = tl.arange(0, BLK // 2)
        tl.store(data_ptr + offset[:, None] + h[None, :], (lo | (hi << 4)).to(tl.uint8), mask=mask[:, None])


@triton.jit
def fake_blocks(x, scale, recip, FMT: tl.constexpr):
    """fp32 values that :func:`store_blocks`' bytes of ``x [N, BLK]`` stand for (FMT ``fp8``,
    ``fp4_b16``, ``fp4_b32``): each element encoded as it stores it, decoded and times its block's
    ``scale``, exactly what ``_dequantize_kernel`` makes of those bytes (a quantization and a
    dequantization in registers). E4M3 on the bits (:func:`e4m3_rne`, the same bytes as
    :func:`e4m3_encode`): with the hardware conversion here the fused rope-and-fake-quantize kernel
    did not match the unfused kernels on the H200 (docs/performance.md, the quantize encoders)."""
    if FMT == 1:
        v = e4m3_to_f32(e4m3_rne(tl.minimum(tl.maximum(x * recip[:, None], -448.0), 448.0)))
    else:
        v = e2m1_to_f32(e2m1_block_codes(x, scale[:, None], recip[:, None], FMT))
    return v * scale[:, None]


@triton.jit
def quant_fp8(x):
    """``fp8`` blocks of fp32 ``x`` [R, G, 32] -> (E4M3 bytes int32 [R, G, 32], UE8M0 bytes int32 [R, G])."""
    byte, _, recip = block_scale(tl.max(tl.abs(x), axis=2), 1)
    return e4m3_encode(tl.minimum(tl.maximum(x * recip[:, :, None], -448.0), 448.0)), byte


@triton.jit
def to_out(v, OUT: tl.constexpr):
    """fp32 -> OUT rounding to nearest even (by hand for bf16 under the interpreter, which truncates)."""
    if _INTERPRETED and OUT == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        v = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return v.to(OUT)
