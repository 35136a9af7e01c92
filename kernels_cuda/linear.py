"""``linear`` with a block-scaled weight (``fp8_w`` / ``fp4_w``): fp8 activations, fp32 accumulation.

``x`` is quantized to fp8 per 32 (UE8M0) by ``_act_quant_kernel``; ``_linear_kernel`` then computes
``dequant(xq) @ dequant(w).T`` tile by tile. Two ways to run the MMA (constexpr ``PROMOTE``):

- promote (``fp8_w`` on sm_89 / sm_90): ``tl.dot`` on the raw E4M3 operands one 32-wide K slice at a
  time; each slice's product is scaled by ``sx[row] * sw[col]`` and added to the fp32 accumulator;
- dequant (``fp4_w`` everywhere, ``fp8_w`` on sm_80): both operands are dequantized in registers
  (exact in bf16: E4M3 / E2M1 times a power of two) and one bf16 ``tl.dot`` per K block accumulates.

E4M3 data reaches the kernels as float8e4nv on sm_89+ and as uint8 below (Triton rejects the fp8 type
there); the dequant path decodes the bytes by placing them in fp16 bits, the promote path feeds them
to the dot as they are. Under the Triton
interpreter the dot operands are fp32 (constexpr ``DOT``) and the fp32 -> bf16 / E4M3 roundings are
done in integer arithmetic (the interpreter truncates where a GPU rounds to nearest even). Few
output tiles (decode) split K over programs and sum fp32 partials.
``moe.py`` reuses ``act_quant``, ``_k_loop``, ``_quant_fp8`` and ``_to_out``.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flashrt.backends.cuda import interpreter
from flashrt.formats import QTensor
from flashrt import profiles

WEIGHT_FORMATS = ("fp8_w", "fp4_w")
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

TILES = {
    "act_quant": dict(BLOCK_R=16, GROUPS=4, num_warps=4),
    # (largest M the rule serves or None, tile): the first matching rule applies
    "linear": (
        (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
        (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
        (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)),
    ),
    "group_m": 8,
    "split_k": None,  # None: split K when the output tiles do not fill the SMs; or a forced count
    "fp8_mma": None,  # None: fp8 tl.dot where the device has it (sm_89+); True / False force a path
}


def _tiles() -> dict:
    """TILES with the active hardware profile's overrides (``tiles.linear`` in its YAML)."""
    return profiles.tiles("linear", TILES)


@functools.cache
def supports_fp8_mma() -> bool:
    """tl.dot on E4M3 operands (sm_89+); the interpreter runs that path with fp32 operands."""
    if interpreter():
        return True
    return torch.cuda.get_device_capability() >= (8, 9)


@functools.cache
def num_sms() -> int:
    return 1 if interpreter() else torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def mma_mode(fmt: str):
    """(PROMOTE, DOT dtype) for a weight format on this device."""
    forced = _tiles()["fp8_mma"]
    promote = fmt == "fp8_w" and (supports_fp8_mma() if forced is None else bool(forced))
    if interpreter():
        return promote, tl.float32
    return promote, (tl.float8e4nv if promote else tl.bfloat16)


def pick_tile(rules, rows: int) -> dict:
    """The first tile rule serving ``rows`` (BLOCK_N, BLOCK_K: multiples of 32, the scale blocks)."""
    tile = next(t for limit, t in rules if limit is None or rows <= limit)
    assert tile["BLOCK_N"] % 32 == 0 and tile["BLOCK_K"] % 32 == 0, tile
    return tile


# --------------------------------------------------------------------------------------- helpers


@triton.jit
def _pow2(biased):
    """2**(biased - 127) as fp32 for a biased exponent (int32) in [1, 254]: UE8M0 bytes plus offsets."""
    return (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_x256(b):
    """E4M3 (uint8 or float8e4nv) -> value * 2**-8 as fp16: sign to bit 15, exponent and mantissa to bits 13..7."""
    b = b.to(tl.uint8, bitcast=True).to(tl.int32)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e4m3_bits(r, OUT: tl.constexpr):
    """fp32 values that are E4M3 values -> their E4M3 bytes as OUT (uint8 / float8e4nv): _e4m3_x256 inverted."""
    h = (r * 0.00390625).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (((h >> 8) & 0x80) | ((h >> 7) & 0x7F)).to(tl.uint8).to(OUT, bitcast=True)


@triton.jit
def _e4m3_operand(b, DOT: tl.constexpr):
    """Raw (unscaled) E4M3 dot operand: the loaded fp8 as it is for an fp8 dot, decoded otherwise."""
    if DOT == tl.float8e4nv:
        return b.to(tl.float8e4nv, bitcast=True)
    return (_e4m3_x256(b).to(tl.float32) * 256.0).to(DOT)


@triton.jit
def _to_out(v, OUT: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """fp32 -> OUT, rounding to nearest even (by hand for bf16 under the interpreter, which truncates)."""
    if MANUAL_BF16:
        b = v.to(tl.int32, bitcast=True)
        v = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return v.to(OUT)


@triton.jit
def _rne_e4m3(y):
    """fp32 holding the E4M3 nearest (ties to even) to ``y`` (|y| <= 448)."""
    bits = y.to(tl.int32, bitcast=True)
    ey = tl.maximum((bits >> 23) & 0xFF, 121)  # subnormals: step 2**-9
    quantum = ((ey - 3) << 23).to(tl.float32, bitcast=True)
    r = y * ((257 - ey) << 23).to(tl.float32, bitcast=True)  # |r| < 16, exact
    r = ((r + 12582912.0) - 12582912.0) * quantum  # round to an integer, ties to even (1.5 * 2**23)
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # keep -0.0


@triton.jit
def _quant_fp8(v):
    """v [R, G, 32] fp32 -> (E4M3 values [R, G, 32] fp32, scale [R, G] fp32) per block of 32.

    scale = smallest power of two >= max(amax, 1e-4) / 448, from the exponent bits of amax:
    amax = (1 + f) 2**(e - 127) needs 2**(e - 135), doubled when 1 + f > 1.75 (448 = 1.75 * 2**8).
    """
    amax = tl.maximum(tl.max(tl.abs(v), axis=2), 1e-4)
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    scale = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    y = tl.clamp(v * inv[:, :, None], -448.0, 448.0)
    return _rne_e4m3(y), scale


@triton.jit
def _e2m1_x16384(c):
    """E2M1 codes (int32, sign in bit 3) -> value * 2**-14 as fp16 (the code's bits in fp16's)."""
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _w_block(w_ptr, sw_ptr, n0, N, k0, k_hi, stride_wn, stride_swn,
             FP4: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dequantized weight rows [n0, n0 + BLOCK_N) x K block [k0, k0 + BLOCK_K) as DOT."""
    G: tl.constexpr = BLOCK_K // 32
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kg = k0 + tl.arange(0, G) * 32
    ok = (offs_n < N)[:, None] & (kg < k_hi)[None, :]  # [BN, G]
    if FP4:
        j = tl.arange(0, 16)
        ptrs = w_ptr + offs_n[:, None, None] * stride_wn + (kg // 2)[None, :, None] + j[None, None, :]
        byte = tl.load(ptrs, mask=ok[:, :, None], other=0).to(tl.int32)
        s = tl.load(sw_ptr + offs_n[:, None] * stride_swn + (kg // 32)[None, :], mask=ok, other=0).to(tl.int32)
        s = _pow2(s + 14)[:, :, None]  # 2**(b - 127) * 2**14
        lo = _e2m1_x16384(byte & 15).to(tl.float32) * s
        hi = _e2m1_x16384(byte >> 4).to(tl.float32) * s
        v = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # element 2i low nibble, 2i + 1 high
    else:
        j = tl.arange(0, 32)
        ptrs = w_ptr + offs_n[:, None, None] * stride_wn + kg[None, :, None] + j[None, None, :]
        w = _e4m3_x256(tl.load(ptrs, mask=ok[:, :, None], other=0.0)).to(tl.float32)
        s = tl.load(sw_ptr + (offs_n // 32)[:, None] * stride_swn + (kg // 32)[None, :], mask=ok, other=0)
        v = tl.reshape(w * _pow2(s.to(tl.int32) + 8)[:, :, None], (BLOCK_N, BLOCK_K))  # 2**(b - 127) * 2**8
    return v.to(DOT)


@triton.jit
def _a_block(a_rows, sa_rows, row_ok, k0, k_hi, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dequantized activations [BLOCK_M, BLOCK_K] at k0 as DOT (a_rows / sa_rows: row pointers)."""
    G: tl.constexpr = BLOCK_K // 32
    kg = k0 + tl.arange(0, G) * 32
    ok = row_ok[:, None] & (kg < k_hi)[None, :]
    a = tl.load(a_rows[:, None, None] + kg[None, :, None] + tl.arange(0, 32)[None, None, :],
                mask=ok[:, :, None], other=0.0)
    sa = tl.load(sa_rows[:, None] + (kg // 32)[None, :], mask=ok, other=0.0) * 256.0
    return tl.reshape(_e4m3_x256(a).to(tl.float32) * sa[:, :, None], (BLOCK_M, BLOCK_K)).to(DOT)


@triton.jit
def _col_scale(sw_ptr, n0, N, k1, k_hi, stride_swn, BLOCK_N: tl.constexpr):
    """fp8_w tile scale of each column n0 + [0, BLOCK_N) at K offset k1: one scalar load per 32."""
    grp = tl.arange(0, BLOCK_N) // 32
    out = tl.zeros([BLOCK_N], tl.float32)
    for g in tl.static_range(BLOCK_N // 32):
        nb = n0 // 32 + g
        ok = (nb * 32 < N) & (k1 < k_hi)
        byte = tl.load(sw_ptr + nb * stride_swn + k1 // 32, mask=ok, other=127).to(tl.int32)
        out = tl.where(grp == g, tl.where(byte == 0, 0x400000, byte << 23).to(tl.float32, bitcast=True), out)
    return out


@triton.jit
def _promote(acc, a, sa, w_ptr, sw_ptr, n0, N, k1, k_hi, stride_wn, stride_swn,
             DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc + (a @ w[:, k1:k1+32].T) * sa[:, None] * sw[None, :] with raw E4M3 dot operands."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = k1 + tl.arange(0, 32)
    ok = (offs_n < N)[:, None] & (offs_k < k_hi)[None, :]
    b = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=ok, other=0.0)
    part = tl.dot(a, tl.trans(_e4m3_operand(b, DOT)))
    sw = _col_scale(sw_ptr, n0, N, k1, k_hi, stride_swn, BLOCK_N)
    return acc + part * (sa[:, None] * sw[None, :])


@triton.jit
def _k_loop(a_rows, sa_rows, row_ok, w_ptr, sw_ptr, w3_ptr, sw3_ptr, n0, N, k_lo, k_hi, stride_wn, stride_swn,
            FP4: tl.constexpr, PROMOTE: tl.constexpr, DUAL: tl.constexpr, DOT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] of xq @ w.T over K in [k_lo, k_hi) (and of xq @ w3.T when DUAL)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if PROMOTE:
            for kk in tl.static_range(BLOCK_K // 32):
                k1 = k0 + kk * 32
                offs_k = k1 + tl.arange(0, 32)
                a = tl.load(a_rows[:, None] + offs_k[None, :], mask=row_ok[:, None] & (offs_k < k_hi)[None, :], other=0.0)
                sa = tl.load(sa_rows + k1 // 32, mask=row_ok & (tl.full([BLOCK_M], k1, tl.int32) < k_hi), other=0.0)
                a = _e4m3_operand(a, DOT)
                acc = _promote(acc, a, sa, w_ptr, sw_ptr, n0, N, k1, k_hi, stride_wn, stride_swn, DOT, BLOCK_N)
                if DUAL:
                    acc3 = _promote(acc3, a, sa, w3_ptr, sw3_ptr, n0, N, k1, k_hi, stride_wn, stride_swn, DOT, BLOCK_N)
        else:
            a = _a_block(a_rows, sa_rows, row_ok, k0, k_hi, DOT, BLOCK_M, BLOCK_K)
            b = _w_block(w_ptr, sw_ptr, n0, N, k0, k_hi, stride_wn, stride_swn, FP4, DOT, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, tl.trans(b), acc)
            if DUAL:
                b3 = _w_block(w3_ptr, sw3_ptr, n0, N, k0, k_hi, stride_wn, stride_swn, FP4, DOT, BLOCK_N, BLOCK_K)
                acc3 = tl.dot(a, tl.trans(b3), acc3)
    return acc, acc3


# --------------------------------------------------------------------------------------- kernels


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                      BLOCK_R: tl.constexpr, GROUPS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kg = (tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)) * 32
    ok = (rows < M)[:, None] & (kg < K)[None, :]
    r64 = rows.to(tl.int64)
    offs = kg[None, :, None] + tl.arange(0, 32)[None, None, :]
    x = tl.load(x_ptr + r64[:, None, None] * stride_xm + offs, mask=ok[:, :, None], other=0.0).to(tl.float32)
    q, s = _quant_fp8(x)
    tl.store(q_ptr + r64[:, None, None] * stride_qm + offs, _e4m3_bits(q, q_ptr.dtype.element_ty), mask=ok[:, :, None])
    tl.store(s_ptr + r64[:, None] * stride_sm + (kg // 32)[None, :], s, mask=ok)


@triton.jit
def _linear_kernel(xq_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, k_split,
                   stride_xm, stride_sxm, stride_wn, stride_swn, stride_om, stride_os,
                   FP4: tl.constexpr, PROMOTE: tl.constexpr, DOT: tl.constexpr, MANUAL_BF16: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # grouped order: GROUP_M row tiles share each weight tile in L2
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    n0 = ((pid % width) // size_m) * BLOCK_N
    k_lo = tl.program_id(1) * k_split
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r64 = rows.to(tl.int64)
    acc, _ = _k_loop(xq_ptr + r64 * stride_xm, sx_ptr + r64 * stride_sxm, rows < M, w_ptr, sw_ptr, w_ptr, sw_ptr,
                     n0, N, k_lo, tl.minimum(k_lo + k_split, K), stride_wn, stride_swn,
                     FP4, PROMOTE, False, DOT, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ptrs = out_ptr + tl.program_id(1) * stride_os + r64[:, None] * stride_om + offs_n[None, :]
    ok = (rows < M)[:, None] & (offs_n < N)[None, :]
    tl.store(ptrs, _to_out(acc, out_ptr.dtype.element_ty, MANUAL_BF16), mask=ok)


# --------------------------------------------------------------------------------------- launchers


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float (K % 32 == 0) -> (E4M3 [M, K] as ``fp8_operand``, fp32 scales [M, K / 32]): ``fp8``."""
    assert x.dim() == 2 and x.shape[1] % 32 == 0 and x.dtype in FLOATS, (x.shape, x.dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    q = fp8_operand(torch.empty(m, k, dtype=torch.uint8, device=x.device))
    s = torch.empty(m, k // 32, dtype=torch.float32, device=x.device)
    t = _tiles()["act_quant"]
    grid = (triton.cdiv(m, t["BLOCK_R"]), triton.cdiv(k // 32, t["GROUPS"]))
    _act_quant_kernel[grid](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), BLOCK_R=t["BLOCK_R"],
                            GROUPS=t["GROUPS"], num_warps=t["num_warps"])
    return q, s


def fp8_operand(t: torch.Tensor) -> torch.Tensor:
    """E4M3 data as the kernels take it: float8_e4m3fn where Triton has the type (sm_89+), else uint8."""
    return t.view(torch.float8_e4m3fn if supports_fp8_mma() else torch.uint8)


def weight_operands(w: QTensor):
    """(data, scale as uint8) of a weight QTensor for the kernels, last dim contiguous."""
    data = fp8_operand(w.data) if w.fmt == "fp8_w" else w.data
    data = data if data.stride(-1) == 1 else data.contiguous()
    scale = w.scale.view(torch.uint8)
    return data, (scale if scale.stride(-1) == 1 else scale.contiguous())


def _split_k(tiles: int, k: int, block_k: int) -> int:
    blocks = triton.cdiv(k, block_k)
    forced = _tiles()["split_k"]
    if forced is not None:
        return max(1, min(int(forced), blocks))
    if tiles >= num_sms():
        return 1
    return max(1, min(triton.cdiv(2 * num_sms(), tiles), blocks // 4))  # keep >= 4 K blocks per split


def linear(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """x [..., in] float, weight fp8_w / fp4_w [out, in] -> [..., out] in x.dtype."""
    assert isinstance(weight, QTensor) and weight.fmt in WEIGHT_FORMATS and weight.ndim == 2, weight
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or n == 0 or k == 0:
        return x.new_zeros(*x.shape[:-1], n)
    xq, sx = act_quant(x2)
    data, scale = weight_operands(weight)
    promote, dot = mma_mode(weight.fmt)
    t = pick_tile(_tiles()["linear"], m)
    tiles = triton.cdiv(m, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"])
    split = _split_k(tiles, k, t["BLOCK_K"])
    k_split = triton.cdiv(triton.cdiv(k, split), t["BLOCK_K"]) * t["BLOCK_K"]
    split = triton.cdiv(k, k_split)
    out = torch.empty(split, m, n, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    _linear_kernel[(tiles, split)](
        xq, sx, data, scale, out, m, n, k, k_split, xq.stride(0), sx.stride(0), data.stride(0), scale.stride(0),
        out.stride(1), out.stride(0), FP4=weight.fmt == "fp4_w", PROMOTE=promote, DOT=dot,
        MANUAL_BF16=interpreter() and out.dtype == torch.bfloat16, GROUP_M=_tiles()["group_m"], **t)
    out = out[0] if split == 1 else out.sum(0).to(x.dtype)
    return out.view(*x.shape[:-1], n)


def supports_linear(x, weight) -> bool:
    """Quantized 2-D weights only: a plain weight is torch.matmul's job (declined)."""
    return isinstance(weight, QTensor) and weight.fmt in WEIGHT_FORMATS and weight.ndim == 2 and x.dtype in FLOATS


OPS = {"linear": linear}
SUPPORTS = {"linear": supports_linear}
