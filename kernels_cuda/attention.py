"""Sparse MQA attention over gathered, quantized KV rows (``flashrt.ops.sparse_attention``).

One program per (query ``b, s``, block of heads, K split). All heads of a query share the same
gathered latent rows (MQA), so each selected row is loaded and dequantized ONCE per program and
serves every head of the block: ``q [H_BLOCK, D] @ kv [K_BLOCK, D]^T`` and ``p @ kv`` via
``tl.dot``, online softmax (base 2) over K in blocks. KV segments (a tuple stands for their
concatenation along T) are read as stored: plain float, ``fp8`` (E4M3 + UE8M0 per 32),
``fp4_b16`` (E2M1 + E4M3 per 16), ``fp4_b32`` (E2M1 + UE8M0 per 32); a global index is mapped to
its segment by comparing with the segment starts (segments in one quantized format share one
dequant path); a K block only converts the formats it touches. With few queries the K blocks
are split over programs (flash-decoding): each writes ``(acc / l, m, l)`` and ``_combine_kernel``
merges them with the sink. Dots: bf16 MMA for bf16 q, 3 bf16 MMAs (``bf16x3``) for fp16 / fp32 q.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from flashrt.formats import QTensor
from flashrt import profiles

TILES = {  # H_BLOCK >= 16 (tl.dot); sm_90 smem: H_BLOCK * D * 2 (q) + 2 * K_BLOCK * D * 2 (kv) + stages
    "attention": {"H_BLOCK": 64, "K_BLOCK": 32, "num_warps": 8, "num_stages": 2},  # bf16 q
    # fp16 / fp32 q: fp32 dot operands at this input precision ("bf16x3": 3 bf16 MMAs, ~2**-16)
    "attention_fp32": {"H_BLOCK": 64, "K_BLOCK": 16, "num_warps": 8, "num_stages": 1, "precision": "bf16x3"},
    "combine": {"H_BLOCK": 16, "num_warps": 4},
    # split-K: splits = min(programs // (B*S*head blocks), max_splits, K blocks // min_blocks);
    # programs 0 = the device's SM count
    "split": {"programs": 0, "min_blocks": 4, "max_splits": 16},
}


def _tiles() -> dict:
    """TILES with the active hardware profile's overrides (``tiles.attention`` in its YAML)."""
    return profiles.tiles("attention", TILES)
MAX_D = 512
MAX_SEGMENTS = 3
FMT_CODES = {"fp8": 1, "fp4_b16": 2, "fp4_b32": 3}  # 0 = plain float
PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = 1.4426950408889634


@triton.jit
def _e8m0(u):
    """fp32 2**(u - 127) of UE8M0 bytes ``u`` (int32)."""
    return tl.where(u == 0, 5.877471754111438e-39, (u << 23).to(tl.float32, bitcast=True))


@triton.jit
def _expand(s, BK: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr):
    """[BK, NB] block scales -> [BK, NB * BS], each repeated over its block."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BK, NB, BS)), (BK, NB * BS))


@triton.jit
def _mask(hit, col, N: tl.constexpr, BLOCK: tl.constexpr):
    """[rows, 1] row mask, or [rows, BLOCK] with the columns >= N masked when BLOCK > N."""
    m = hit[:, None]
    if N != BLOCK:
        m = m & (col < N)[None, :]
    return m


@triton.jit
def _load_rows(rows, srows, hit, FMT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Stored (data, scale bytes) of the ``hit`` rows; zeros elsewhere. Plain rows: (data, data)."""
    W: tl.constexpr = BLOCK_D // 2 if FMT >= 2 else BLOCK_D  # fp4: two elements per byte
    BS: tl.constexpr = 16 if FMT == 2 else 32
    c = tl.arange(0, W)
    x = tl.load(rows[:, None] + c[None, :], mask=_mask(hit, c, D * W // BLOCK_D, W), other=0)
    u = x
    if FMT != 0:
        nb = tl.arange(0, BLOCK_D // BS)
        u = tl.load(srows[:, None] + nb[None, :], mask=_mask(hit, nb, D // BS, BLOCK_D // BS), other=0)
    return x, u


@triton.jit
def _convert(x, u, FMT: tl.constexpr, BK: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 [BK, BLOCK_D] values of stored rows: plain, fp8 (E4M3, UE8M0 / 32), fp4_b16 (E2M1,
    E4M3 / 16) or fp4_b32 (E2M1, UE8M0 / 32); E2M1 element 2i is the low nibble."""
    if FMT == 0:
        v = x.to(tl.float32)
    elif FMT == 1:
        v = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v = v * _expand(_e8m0(u.to(tl.int32)), BK, BLOCK_D // 32, 32)
    else:
        p = x.to(tl.int32)
        c = tl.interleave(p & 15, p >> 4)
        # E2M1 -> fp16 bits (sign to bit 15, exponent+mantissa to bits 11..9): value * 2**-14
        v = (((c & 8) << 12) | ((c & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        if FMT == 2:
            v = v * _expand(u.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0, BK, BLOCK_D // 16, 16)
        else:
            v = v * 16384.0 * _expand(_e8m0(u.to(tl.int32)), BK, BLOCK_D // 32, 32)
    return v


@triton.jit
def _locate(idx, b, base, sbase, sb, st, ssb, sst, start, length):
    """(data offsets, scale offsets, hit mask) [BK] of the global ``idx`` that fall in a segment."""
    local = idx - start
    hit = (local >= 0) & (local < length)
    r = tl.where(hit, local, 0).to(tl.int64)
    return base + b * sb + r * st, sbase + b * ssb + r * sst, hit


@triton.jit
def _merge(o, so, h, o2, so2, h2):
    """Rows of a second segment in the same format, addressed from the first one's pointers.
    An arithmetic blend (not tl.where) keeps the offsets' divisibility, so loads stay vectorized."""
    pick = h2.to(tl.int64)
    return o + pick * (o2 - o), so + pick * (so2 - so), h | h2


@triton.jit
def _dequant(kv, rows, srows, hit, FMT: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Add the ``hit`` rows, stored in format ``FMT``, to the fp32 tile ``kv``. The loads stay
    outside the branch (the pipeliner can prefetch them); the conversion only runs for the
    formats a block touches."""
    x, u = _load_rows(rows, srows, hit, FMT, D, BLOCK_D)
    if tl.max(hit.to(tl.int32), axis=0) > 0:
        kv += _convert(x, u, FMT, BK, BLOCK_D)
    return kv


@triton.jit
def _gather_kv(idx, b, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
               d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
               d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
               FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, ROLE1: tl.constexpr,
               ROLE2: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 [BK, BLOCK_D] rows ``idx`` of the concatenated segments (zeros where idx is empty).

    Segment i's row r of batch b is at ``d_i + o_i + b * sb_i + r * st_i`` (scales alike).
    ROLE1: -1 absent, 0 same quantized format as segment 0 (one dequant path), 1 own path;
    ROLE2: -1 absent, 0 / 1 merged into segment 0 / 1, 2 own path. A merged segment is passed
    with its target's pointers and its offset from them in ``o_i`` / ``so_i``.
    """
    r0, q0, h0 = _locate(idx, b, o0, so0, sb0, st0, ssb0, sst0, start0, len0)
    r1, q1, h1 = _locate(idx, b, o1, so1, sb1, st1, ssb1, sst1, start1, len1)
    r2, q2, h2 = _locate(idx, b, o2, so2, sb2, st2, ssb2, sst2, start2, len2)
    if ROLE2 == 0:
        r0, q0, h0 = _merge(r0, q0, h0, r2, q2, h2)
    if ROLE2 == 1:
        r1, q1, h1 = _merge(r1, q1, h1, r2, q2, h2)
    if ROLE1 == 0:
        r0, q0, h0 = _merge(r0, q0, h0, r1, q1, h1)
    kv = _dequant(tl.zeros([BK, BLOCK_D], tl.float32), d0 + r0, s0 + q0, h0, FMT0, D, BK, BLOCK_D)
    if ROLE1 == 1:
        kv = _dequant(kv, d1 + r1, s1 + q1, h1, FMT1, D, BK, BLOCK_D)
    if ROLE2 == 2:
        kv = _dequant(kv, d2 + r2, s2 + q2, h2, FMT2, D, BK, BLOCK_D)
    return kv


@triton.jit
def _finish(acc, m, l, sk, HAS_SINK: tl.constexpr):
    """Normalize ``acc`` (base-2 running max ``m``, sum ``l``), the sink only in the denominator."""
    if HAS_SINK:
        m_f = tl.maximum(m, sk)
        m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
        alpha = tl.exp2(m - m_f)
        l = l * alpha + tl.exp2(sk - m_f)
        acc = acc * alpha[:, None]
    return tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)


@triton.jit
def _attend(q, kv, idx, m_i, l_i, acc, qk_scale, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """One K block of the online softmax (base 2; empty slots masked) -> (m, l, acc)."""
    s = tl.dot(q, tl.trans(kv), input_precision=PREC) * qk_scale
    s = tl.where((idx >= 0)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _sparse_attention_kernel(
        q_ptr, idx_ptr, sink_ptr, out_ptr, pacc_ptr, pml_ptr,
        d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
        d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
        d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
        S, H, K, blocks_per_split, qk_scale, D: tl.constexpr,
        FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, ROLE1: tl.constexpr, ROLE2: tl.constexpr,
        HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
        H_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    bs, split = tl.program_id(0).to(tl.int64), tl.program_id(2)
    h = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
    d = tl.arange(0, BLOCK_D)
    mask_hd = _mask(h < H, d, D, BLOCK_D)
    offs_q = (bs * H + h)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + offs_q, mask=mask_hd, other=0.0).to(DOT_DTYPE)
    m_i = tl.full([H_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([H_BLOCK], tl.float32)
    acc = tl.zeros([H_BLOCK, BLOCK_D], tl.float32)
    kb_lo = split * blocks_per_split
    for kb in range(kb_lo, tl.minimum(kb_lo + blocks_per_split, tl.cdiv(K, K_BLOCK))):
        offs_k = kb * K_BLOCK + tl.arange(0, K_BLOCK)
        idx = tl.load(idx_ptr + bs * K + offs_k, mask=offs_k < K, other=-1)
        kv = _gather_kv(idx, bs // S, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
                        d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
                        d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
                        FMT0, FMT1, FMT2, ROLE1, ROLE2, D, K_BLOCK, BLOCK_D)
        m_i, l_i, acc = _attend(q, kv.to(DOT_DTYPE), idx, m_i, l_i, acc, qk_scale, DOT_DTYPE, PREC)
    if SPLIT:  # partials [splits, B*S, H, D] = acc / l and [.., 2] = (m, l); the sink joins in _combine_kernel
        row = (split * tl.num_programs(0) + bs) * H + h
        o = _finish(acc, m_i, l_i, 0.0, False)
        tl.store(pacc_ptr + row[:, None] * D + d[None, :], o.to(pacc_ptr.dtype.element_ty), mask=mask_hd)
        tl.store(pml_ptr + row * 2, m_i, mask=h < H)
        tl.store(pml_ptr + row * 2 + 1, l_i, mask=h < H)
    else:
        sk = tl.load(sink_ptr + h, mask=h < H, other=0.0) * 1.4426950408889634 if HAS_SINK else 0.0
        out = _finish(acc, m_i, l_i, sk, HAS_SINK)
        tl.store(out_ptr + offs_q, out.to(out_ptr.dtype.element_ty), mask=mask_hd)


@triton.jit
def _combine_kernel(pacc_ptr, pml_ptr, sink_ptr, out_ptr, NSPLIT, H, D, HAS_SINK: tl.constexpr,
                    H_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    bs, nbs = tl.program_id(0).to(tl.int64), tl.num_programs(0)
    h = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
    d = tl.arange(0, BLOCK_D)
    mask_hd = (h < H)[:, None] & (d < D)[None, :]
    m = tl.full([H_BLOCK], float("-inf"), tl.float32)
    for j in range(NSPLIT):
        m = tl.maximum(m, tl.load(pml_ptr + ((j * nbs + bs) * H + h) * 2, mask=h < H, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([H_BLOCK], tl.float32)
    acc = tl.zeros([H_BLOCK, BLOCK_D], tl.float32)
    for j in range(NSPLIT):
        row = (j * nbs + bs) * H + h
        w = tl.exp2(tl.load(pml_ptr + row * 2, mask=h < H, other=float("-inf")) - m_use)
        w = w * tl.load(pml_ptr + row * 2 + 1, mask=h < H, other=0.0)  # this split's l, rescaled
        l += w
        acc += tl.load(pacc_ptr + row[:, None] * D + d[None, :], mask=mask_hd, other=0.0).to(tl.float32) * w[:, None]
    sk = tl.load(sink_ptr + h, mask=h < H, other=0.0) * 1.4426950408889634 if HAS_SINK else 0.0
    out = _finish(acc, m_use, l, sk, HAS_SINK)
    tl.store(out_ptr + (bs * H + h)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_hd)


# ---------------------------------------------------------------------------------------------
# launcher


def _segments(kv) -> list[tuple]:
    """Non-empty segments as (data, scale, fmt code, start, length), last dim contiguous; stored
    bytes as uint8 (plain: (data, data, 0, ...))."""
    out, start = [], 0
    for seg in (kv if isinstance(kv, tuple) else (kv,)):
        q = isinstance(seg, QTensor)
        data, scale = (seg.data.view(torch.uint8), seg.scale.view(torch.uint8)) if q else (seg, seg)
        data, scale = (t if t.stride(-1) == 1 else t.contiguous() for t in (data, scale))
        if seg.shape[1]:
            out.append((data, scale, FMT_CODES[seg.fmt] if q else 0, start, seg.shape[1]))
        start += seg.shape[1]
    return out


def _segment_args(segs, roles) -> list:
    """Per segment: base pointers, offsets from them, (b, t) strides of data and scale, start,
    length. A merged segment (roles[i] < i) is addressed from its target's pointers."""
    args = []
    segs = segs + [segs[0][:3] + (0, 0)] * (MAX_SEGMENTS - len(segs))
    for i, (data, scale, code, start, n) in enumerate(segs):
        base, sbase = segs[roles[i] if 0 <= roles[i] < i else i][:2]
        args += [base, sbase, data.data_ptr() - base.data_ptr(), scale.data_ptr() - sbase.data_ptr(),
                 _bstride(data), data.stride(1), *((_bstride(scale), scale.stride(1)) if code else (0, 0)), start, n]
    return args


def _bstride(t: torch.Tensor) -> int:
    """Batch stride; 0 for a batch-1 segment, which every row shares (the HKCP page pool)."""
    return 0 if t.shape[0] == 1 else t.stride(0)


def _roles(codes: list[int]) -> tuple[int, int]:
    """ROLE1, ROLE2 of _gather_kv: a quantized segment joins the first earlier segment that has
    its own dequant path in the same format; -1 where the segment is absent."""
    r1 = -1 if len(codes) < 2 else (0 if codes[1] and codes[1] == codes[0] else 1)
    own = [0] + ([1] if r1 == 1 else [])
    r2 = -1 if len(codes) < 3 else next((j for j in own if codes[2] and codes[j] == codes[2]), 2)
    return r1, r2


def _plan(q: torch.Tensor, K: int) -> tuple[dict, int, int, int, int]:
    """(tiles, H_BLOCK, K_BLOCK, splits, blocks per split): split K until the programs fill one
    wave (one program per SM: it holds most of an SM's shared memory)."""
    B, S, H, _ = q.shape
    t, sp = _tiles()["attention" if q.dtype == torch.bfloat16 else "attention_fp32"], _tiles()["split"]
    h_block = min(t["H_BLOCK"], max(16, triton.next_power_of_2(H)))
    k_block = min(t["K_BLOCK"], max(16, triton.next_power_of_2(K)))
    n_kb = triton.cdiv(K, k_block)
    wave = sp["programs"] or (torch.cuda.get_device_properties(q.device).multi_processor_count
                              if q.device.type == "cuda" else 132)
    splits = max(1, min(wave // (B * S * triton.cdiv(H, h_block)), sp["max_splits"], n_kb // sp["min_blocks"]))
    per_split = triton.cdiv(n_kb, splits)
    return t, h_block, k_block, triton.cdiv(n_kb, per_split), per_split


def _dot_mode(dtype: torch.dtype):
    """(dot operand dtype, input precision): bf16 MMA for bf16 q; fp16 / fp32 q: fp32 operands at
    TILES' precision (bf16x3 needs a third of 3xTF32's shared memory); fp32 in the interpreter
    (its bf16 dot / arithmetic is wrong)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32, "ieee"
    return (tl.bfloat16, "ieee") if dtype == torch.bfloat16 else (tl.float32, _tiles()["attention_fp32"]["precision"])


def _combine(pacc, pml, sink, out, splits: int) -> None:
    B, S, H, D = out.shape
    t = _tiles()["combine"]
    grid = (B * S, triton.cdiv(H, t["H_BLOCK"]))
    _combine_kernel[grid](pacc, pml, sink if sink is not None else pml, out, splits, H, D, sink is not None,
                          H_BLOCK=t["H_BLOCK"], BLOCK_D=triton.next_power_of_2(D), num_warps=t["num_warps"])


def sparse_attention(q, kv, indices, sink, scale):
    B, S, H, D = q.shape
    K = indices.shape[-1]
    segs = _segments(kv)
    if not segs or min(B * S, H, K) == 0:
        return torch.zeros_like(q)
    assert D % 32 == 0 and D <= MAX_D and len(segs) <= MAX_SEGMENTS, (D, len(segs))
    assert q.dtype in PLAIN_DTYPES and indices.dtype == torch.int32
    q, indices = q.contiguous(), indices.contiguous()
    sink = None if sink is None else sink.contiguous()
    out = torch.empty_like(q)
    t, h_block, k_block, splits, per_split = _plan(q, K)
    pacc = pml = out
    if splits > 1:  # partial outputs in bf16 for bf16 q (half the traffic), else fp32
        pdtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
        pacc = torch.empty(splits, B * S, H, D, dtype=pdtype, device=q.device)
        pml = torch.empty(splits, B * S, H, 2, dtype=torch.float32, device=q.device)
    dot_dtype, prec = _dot_mode(q.dtype)
    codes = [s[2] for s in segs]
    role1, role2 = _roles(codes)
    codes += [0] * (MAX_SEGMENTS - len(segs))
    grid = (B * S, triton.cdiv(H, h_block), splits)
    _sparse_attention_kernel[grid](
        q, indices, sink if sink is not None else q, out, pacc, pml, *_segment_args(segs, (0, role1, role2)),
        S, H, K, per_split, float(scale) * LOG2E, D,
        FMT0=codes[0], FMT1=codes[1], FMT2=codes[2], ROLE1=role1, ROLE2=role2, HAS_SINK=sink is not None,
        SPLIT=splits > 1, DOT_DTYPE=dot_dtype, PREC=prec, H_BLOCK=h_block, K_BLOCK=k_block,
        BLOCK_D=triton.next_power_of_2(D), num_warps=t["num_warps"], num_stages=t["num_stages"])
    if splits > 1:
        _combine(pacc, pml, sink, out, splits)
    return out


def supports_sparse_attention(q, kv, indices, sink, scale) -> bool:
    """bf16/fp16/fp32 q; D % 32 == 0 and D <= 512; <= 3 non-empty segments, each plain
    bf16/fp16/fp32 or fp8 / fp4_b16 / fp4_b32."""
    D = q.shape[-1]
    if q.dtype not in PLAIN_DTYPES or D == 0 or D % 32 or D > MAX_D:
        return False
    segs = kv if isinstance(kv, tuple) else (kv,)
    if sum(1 for s in segs if s.shape[1]) > MAX_SEGMENTS:
        return False
    return all(s.fmt in FMT_CODES if isinstance(s, QTensor) else s.dtype in PLAIN_DTYPES for s in segs)


OPS = {"sparse_attention": sparse_attention}
SUPPORTS = {"sparse_attention": supports_sparse_attention}
