"""``linear`` of an ``fp8_w`` weight at a few rows on the tensor cores, the weights as the MMA's M side
(sm_80+, written in Gluon): the rule knob ``gemv_mma``.

``out[m, n] = sum over 32-wide K slices j of (xq[m, j] . w[n, j]) * sx[m, j] * sw[n // 32, j]``, where
``xq`` / ``sx`` are the activations quantized to E4M3 with a UE8M0 scale per 32 (what ``linear.act_quant``
makes; the kernel quantizes the float activations itself) and ``w`` / ``sw`` the weight's E4M3 bytes
with a UE8M0 scale per 32 x 32 tile.

A GEMV on the CUDA cores spends an instruction or more on every weight byte (the load, the conversion,
a multiply-add per activation row), and a 16-row MMA tile with the activations as its rows wastes 15
of them at one token. Here each warp owns 16 weight rows as the M of ``mma.sync`` m16n8k16 (fp16
operands, fp32 accumulation) and the activation rows (up to ``TOKENS``, 8 or 16) are its N. The weight
bytes and float activations come through a shared ring by asynchronous copies (``cp.async``, 16 bytes a
copy, ``STAGES - 1`` slots of ``SUB`` K slices ahead), are read from there in the MMA operands' layout,
the weights converted by the device two E4M3 bytes an instruction to fp16 and the activations quantized
slice by slice (both exact in fp16), and each 32-wide K slice's product, taken into a fresh accumulator,
is added to the fp32 sum times its two scales. One instruction of the MMA covers 256 weight bytes.

With the activations handed over dequantized (``DQ``: the bf16 or fp32 values of their fp8 round trip, made
by a launch before; the rule knob ``gemv_mma_dq``, up to 64 rows) no program quantizes them again: the MMA
takes bf16 operands, the weight bytes decoded by the packed E4M3 decode (``codecs_e4m3``) times their tile
scale (its 2**120 re-bias folded into the scale where the weight's scale bytes are at most 134, DQ 1; else
multiplied apart, DQ 2), the activation values as they are (exact in bf16), summed in one fp32 accumulator.
The work a slice is then the weights' decode and the MMAs, whatever the rows; the activations' copies and
MMAs grow with them (N up to 64).

A program is ``num_warps`` x 16 weight rows and one K split. The splits of a tile meet in the tile's
last program (the ticket of :mod:`.splitk`: a workspace of fp32 partials summed in split order, so the
result is deterministic).
"""
from __future__ import annotations

import torch
import triton

from flashrt.kernels_cuda import pdl, splitk
from flashrt.kernels_cuda.attention_ws import AVAILABLE
from flashrt.kernels_cuda.launch import cdiv

ROWS_A_WARP = 16  # weight rows a warp: the M of one mma.sync
MIN_SLICES = 4  # K slices a split at least

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from flashrt.kernels_cuda.attention_ws import _async_load, _sync
    from flashrt.kernels_cuda.codecs import e8m0_bf16, e8m0_to_f32
    from flashrt.kernels_cuda.codecs_e4m3 import e4m3_pairs_bf16, e8m0_bf16_x2p120
    from flashrt.kernels_cuda.pdl import wait_inputs

    @gluon.constexpr_function
    def _copy_layout(SLOT, VEC, num_warps):
        """Copies of 16 bytes (``VEC`` elements) a thread over [rows, SLOT] elements, the warps along the rows."""
        return gl.BlockedLayout([1, VEC], [32 * VEC // SLOT, SLOT // VEC], [num_warps, 1], [1, 0])

    @gluon.jit
    def _copy(w_slot, x_slot, w_src, x_src, k, k_hi, w_rows, w_cols, x_cols):
        """Start the asynchronous copies of the K slices from ``k`` (the weight bytes, the float
        activations) into a ring slot; nothing from ``k_hi`` on (those slices are not read)."""
        _async_load(w_slot, w_src + k, mask=w_rows & (k + w_cols < k_hi)[None, :])
        _async_load(x_slot, x_src + k, mask=(k + x_cols < k_hi)[None, :])

    @gluon.jit
    def block_exp(amax):
        """fp32 block maxima -> (the UE8M0 scale byte, int32; the scale's inverse, fp32): ``act_quant``'s
        block rule, the scale 2**ceil(log2(max(amax, 1e-4) / 448)) with the quotient correctly rounded."""
        v = gl.div_rn(gl.maximum(amax, 1e-4), gl.full(amax.shape, 448.0, gl.float32, amax.type.layout))
        bits = v.to(gl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(gl.int32)
        e = gl.minimum(gl.maximum(e, 1), 254)
        return e, gl.where(e >= 254, 0x00200000, (254 - e) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _quant_fp8(x):
        """fp32 activations [32, TOKENS] (a K slice of each row) -> (their ``fp8`` values as fp16, exact;
        the UE8M0 scale byte of each row, int32 [TOKENS]): :func:`block_exp`'s scale, each value times the
        scale's inverse rounded to E4M3 (nearest, ties to even) by the device."""
        e, recip = block_exp(gl.max(gl.abs(x), axis=0))
        # |x| / scale <= 448 by the scale's rule (a power of two: the product is exact), so no clamp is needed
        q = (x * recip[None, :]).to(gl.float8e4nv)
        return q.to(gl.float16), e

    @gluon.jit
    def _dequantized_product(w_slot, x_slot, u: gl.constexpr, sw, acc, a_l: gl.constexpr, b_l: gl.constexpr,
                             DQ: gl.constexpr):
        """``acc`` plus K slice ``u`` of a ring slot's product on bf16 operands: the E4M3 weight bytes times
        their tile scale bytes ``sw`` (int32 [BLOCK_N] in ``SliceLayout(1, a_l)``; DQ 1: the 2**120 folded
        into the scale, DQ 2: multiplied apart) and the activations' round-trip values as bf16 (exact)."""
        byte = w_slot.slice(32 * u, 32, dim=1).load(a_l)
        scale = e8m0_bf16_x2p120(sw) if DQ == 1 else e8m0_bf16(sw)
        a = e4m3_pairs_bf16(byte, gl.broadcast(scale[:, None], byte)[0], DQ == 1)
        b = x_slot.slice(32 * u, 32, dim=1).permute((1, 0)).load(b_l).to(gl.bfloat16)
        return mma_v2(a, b, acc)

    @gluon.jit
    def meet_splits(acc, part, dst, ok, cnt, split, n_splits, MN):
        """The K splits of an output tile meet as :mod:`.splitk` has them meet, in Gluon (its helpers make
        layout-free tensors): split ``split``'s fp32 partial ``acc`` goes to ``part`` (pointers like ``acc``
        into split 0's [M, N] of a workspace of ``MN``-element splits); the program drawing the tile's last
        ticket from ``cnt`` sums the splits in order into ``dst`` (its dtype) and puts the counter back to 0."""
        gl.store(part + split.to(gl.int64) * MN, acc, mask=ok)
        _sync()  # every thread's partial is stored before the ticket publishes them
        if gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
            total = gl.zeros_like(acc)
            for s in range(n_splits):
                total += gl.load(part + s * MN, mask=ok, other=0.0, cache_modifier=".cg")
            gl.store(dst, total.to(dst.dtype.element_ty), mask=ok)
            gl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _mma_gemv_kernel(x_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, k_split, n_splits,
                         stride_xm, stride_wn, stride_swn, stride_swk, stride_om,
                         TOKENS: gl.constexpr, KW: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr,
                         EVEN: gl.constexpr, EVEN_K: gl.constexpr, REDUCE: gl.constexpr, num_warps: gl.constexpr,
                         DQ: gl.constexpr = 0):
        """One program: weight rows ``[tile * 16 * num_warps, +16 * num_warps)`` over the K split
        ``split``; ``x`` [M, K] float, quantized here per K slice as ``act_quant`` would; ``out`` [M, N]
        (stride ``stride_om``), ``ws`` [n_splits, M, N] fp32 and ``cnt`` (a ticket counter a tile)
        where REDUCE; DQ (1, 2): ``x`` holds the values of its fp8 round trip (bf16 or fp32), multiplied as
        they are (:func:`_dequantized_product`). The weight bytes and activations come through a shared ring of
        STAGES slots of
        SUB K slices by asynchronous copies issued STAGES - 1 slots ahead; the weight scale bytes are
        loaded where a slice is used. EVEN: N a multiple of the program's rows (no row mask); EVEN_K:
        every split whole slots. Activation rows past M read row M - 1 again (not stored)."""
        wait_inputs()
        BLOCK_N: gl.constexpr = 16 * num_warps
        SLOT: gl.constexpr = 32 * SUB  # K elements a ring slot: SUB slices of 32
        x_t: gl.constexpr = x_ptr.dtype.element_ty
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
        # the copies, spread over the program's threads (a barrier follows them before any slot is read)
        wc_l: gl.constexpr = _copy_layout(SLOT, 16, num_warps)
        xc_l: gl.constexpr = _copy_layout(SLOT, 128 // x_t.primitive_bitwidth, num_warps)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        tile = gl.program_id(0)
        split = gl.program_id(1)
        n0 = tile * BLOCK_N
        k_lo = split * k_split
        k_hi = gl.minimum(k_lo + k_split, K)

        w_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, SLOT], flat)
        x_ring = gl.allocate_shared_memory(x_t, [STAGES, TOKENS, SLOT], flat)
        rows_w = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wc_l))
        cols_w = gl.arange(0, SLOT, layout=gl.SliceLayout(0, wc_l))
        w_src = w_ptr + rows_w.to(gl.int64)[:, None] * stride_wn + cols_w[None, :]
        w_rows = ((rows_w < N) | EVEN)[:, None]
        ms_x = gl.minimum(gl.arange(0, TOKENS, layout=gl.SliceLayout(1, xc_l)), M - 1)
        cols_x = gl.arange(0, SLOT, layout=gl.SliceLayout(0, xc_l))
        x_src = x_ptr + ms_x.to(gl.int64)[:, None] * stride_xm + cols_x[None, :]
        rows_c = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        ms_c = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, mma))
        sw_ptrs = sw_ptr + (rows_c // 32).to(gl.int64) * stride_swn
        sw_rows = (rows_c < N) | EVEN
        rows_a = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))  # the A operand's rows (DQ's scales)
        sa_ptrs = sw_ptr + (rows_a // 32).to(gl.int64) * stride_swn
        sa_rows = (rows_a < N) | EVEN

        for i in gl.static_range(STAGES - 1):
            _copy(w_ring.index(i), x_ring.index(i), w_src, x_src, k_lo + SLOT * i, k_hi, w_rows, cols_w, cols_x)
            async_copy.commit_group()
        zero = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)
        acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)
        j = 0
        for k0 in range(k_lo, k_hi, SLOT):
            ahead = j + STAGES - 1
            _copy(w_ring.index(ahead % STAGES), x_ring.index(ahead % STAGES), w_src, x_src, k0 + SLOT * (STAGES - 1),
                  k_hi, w_rows, cols_w, cols_x)
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)  # this thread's copies of slot j have landed
            _sync()  # and every thread's
            w_slot = w_ring.index(j % STAGES)
            x_slot = x_ring.index(j % STAGES)
            for u in gl.static_range(SUB):
                k = k0 + 32 * u
                if EVEN_K or k < k_hi:
                    if DQ:
                        sw = gl.load(sa_ptrs + (k // 32) * stride_swk, mask=sa_rows, other=0).to(gl.int32)
                        acc = _dequantized_product(w_slot, x_slot, u, sw, acc, a_l, b_l, DQ)
                    else:
                        sw = gl.load(sw_ptrs + (k // 32) * stride_swk, mask=sw_rows, other=0).to(gl.int32)
                        w = w_slot.slice(32 * u, 32, dim=1).load(a_l)
                        xq, sx = _quant_fp8(x_slot.slice(32 * u, 32, dim=1).permute((1, 0)).load(b_l)
                                            .to(gl.float32))
                        part = mma_v2(w.to(gl.float8e4nv, bitcast=True).to(gl.float16), xq, zero)
                        sx_f = (gl.convert_layout(sx, gl.SliceLayout(0, mma)) << 23).to(gl.float32, bitcast=True)
                        acc = acc + part * (e8m0_to_f32(sw)[:, None] * sx_f[None, :])
            _sync()  # every warp has read the slot before a later trip's copies refill it
            j += 1

        c_ok = (rows_c < N)[:, None] & (ms_c < M)[None, :]
        if REDUCE:
            meet_splits(acc, ws_ptr + ms_c.to(gl.int64)[None, :] * N + rows_c[:, None],
                        out_ptr + ms_c.to(gl.int64)[None, :] * stride_om + rows_c[:, None], c_ok, cnt_ptr + tile,
                        split, n_splits, M * N)
        else:
            gl.store(out_ptr + ms_c.to(gl.int64)[None, :] * stride_om + rows_c[:, None],
                     acc.to(out_ptr.dtype.element_ty), mask=c_ok)


def operand_kw(kw: int) -> int:
    """``kw`` consecutive K elements a thread in the fp16 MMA operands, or 4 where this Triton may refuse
    more: Triton 3.9 requires an MMA's K (16) to be at least 4 x kWidth, while 3.6 takes 8 (64-bit shared
    loads of the weights); 4 from 3.7 on, the versions between not having been checked."""
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    return kw if kw <= 4 or version < (3, 7) else 4


MAX_ROWS = 16  # activation rows a launch that quantizes them itself
MAX_ROWS_DQ = 64  # activation rows a launch over their round trip's values (DQ)


def tokens_for(m: int) -> int:
    """The MMA's N for ``m`` activation rows: 8, 16, 32 or 64, the least power of two from 8 that holds them."""
    return max(8, 1 << (m - 1).bit_length())


def plan(m: int, n: int, k: int, dtype: torch.dtype, tile: dict, sms: int, dq: bool = False) -> dict:
    """The launch of ``m`` rows (at most :data:`MAX_ROWS`, or :data:`MAX_ROWS_DQ` with ``dq``: the
    activations' round trip by a launch before) of ``dtype`` against an [n, k] fp8_w weight under ``tile``
    (``num_warps``, ``KW``: the operands' consecutive K elements a thread, ``per_sm``: programs aimed at
    an SM, reached by splitting K into runs of whole 32-wide slices, at least :data:`MIN_SLICES` a split);
    ``split``, ``reduce`` and ``out_dtype`` as :func:`.splitk.outputs` takes them."""
    assert m <= (MAX_ROWS_DQ if dq else MAX_ROWS), (m, dq)
    warps = tile.get("num_warps", 4)
    tiles = cdiv(n, ROWS_A_WARP * warps)
    slices = cdiv(k, 32)
    sub = tile.get("SUB", 4)
    split = max(1, min(cdiv(slices, max(MIN_SLICES, sub)), (sms * tile.get("per_sm", 8)) // tiles))
    k_split = cdiv(cdiv(slices, split), sub) * sub * 32
    split = cdiv(k, k_split)
    reduce = split > 1 and splitk.fits(tiles)
    return dict(grid=(tiles, split), split=split, k_split=k_split, reduce=reduce, dq=dq,
                out_dtype=dtype if split == 1 or reduce else torch.float32,
                constexprs=dict(TOKENS=tokens_for(m), KW=operand_kw(tile.get("KW", 4)), STAGES=tile.get("STAGES", 4),
                                SUB=sub, EVEN=n % (ROWS_A_WARP * warps) == 0, EVEN_K=k % (32 * sub) == 0,
                                REDUCE=reduce, num_warps=warps))


def launch(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, p: dict, fold: bool = False,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """[M, N] in ``dtype`` (default x's) of float activations ``x`` [M, K] (last dim dense; where the plan is
    ``dq``, the values of their fp8 round trip) and an fp8_w weight's ``data`` / ``scale`` (uint8 views)
    under plan ``p``; ``fold``: the weight's scale bytes are at most ``codecs_e4m3.FOLD_MAX_SCALE`` (a dq
    decode with its re-bias in the scales)."""
    m, n = x.shape[0], data.shape[0]
    out, ws, cnt = splitk.outputs(p, m, n, x.device)
    dq = dict(DQ=1 if fold else 2) if p["dq"] else {}  # passed only when on: the other variants' keys stay
    _mma_gemv_kernel[p["grid"]](
        x, data, scale, out, ws, cnt, m, n, x.shape[1], p["k_split"], p["split"], x.stride(0), data.stride(0),
        scale.stride(0), scale.stride(1), out.stride(-2), **p["constexprs"], **dq, **pdl.options(x.device))
    return splitk.result(out, p, dtype or x.dtype)
