"""``prefix_attention`` on CUDA: a prompt chunk's attention, each gathered KV row shared by a block of
queries (``flashrt.ops.prefix_attention``: the indices follow from the positions).

One program per (block of ``QB`` consecutive queries, batch row). Its ``M = QB * HB`` score rows
(``HB`` = the heads padded to a power of two >= 16; row ``m`` is query ``m // HB``, head ``m % HB``)
attend, in ``K_BLOCK`` steps, to

- the window: the positions ``(p_first - W, p_last]`` of the block, each at its row of ``[ring ‖
  chunk]`` (the chunk row when it is in the chunk, ring slot ``p % W`` when ``p >= 0`` and ``p >=
  ring_start``, else none), masked per score row to that query's window ``(p - W, p]``: the rows
  ``window_indices`` gives it, each once;
- the compressed entries ``0 .. max visible`` of the block, at ``entries[b, j]``, masked per score
  row to ``j < visible``.

Each K block of rows is gathered and dequantized once for all ``M`` rows (the sparse kernel's
``_gather_kv``: up to four segments, three formats), then ``q @ kv^T`` and ``p @ kv`` by ``tl.dot``
(``M`` >= 64: warpgroup MMA on sm_90) under an online softmax in base 2, the sink joining the
denominator at the end. Where the heads alone fill ``M_BLOCK`` (``QB`` would be 1: nothing to
share) the launcher builds the indices and runs the sparse kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt import profiles, refmath
from flashrt.dtypes import MAIN_KV_FORMAT, STORAGE
from flashrt.families import Dim, KernelFamily, Support
from flashrt.kernels_cuda import attention, splitk
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.attention_kernel import _attend, _finish, _gather_kv, _scores
from flashrt.kernels_cuda.launch import PlanCache, cdiv, dense, next_pow2, zeros_stored
from flashrt.tile_checks import DOT, Tile
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

LOG2E = tl.constexpr(1.4426950408889634)
TILES = {
    # M_BLOCK score rows a program (QB = M_BLOCK / HB queries); K_BLOCK rows gathered a step;
    # D_SPLIT 2: two programs a query block, each accumulating half of the output columns (half the
    # accumulator's registers) and gathering both halves for the scores
    "prefix": {"M_BLOCK": 64, "K_BLOCK": 32, "num_warps": 8, "num_stages": 2, "D_SPLIT": 1},
}
PLANS = PlanCache("prefix_attention", TILES)


@triton.jit(do_not_specialize=("S", "W", "E"))
def _prefix_attention_kernel(
        q_ptr, pos_ptr, rs_ptr, ent_ptr, vis_ptr, sink_ptr, out_ptr,
        d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
        d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
        d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
        o3, so3, sb3, st3, ssb3, sst3, start3, len3,
        S, H, W, E, qk_scale, D: tl.constexpr,
        FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, ROLE1: tl.constexpr, ROLE2: tl.constexpr,
        ROLE3: tl.constexpr, HAS_SINK: tl.constexpr, HAS_ENTRIES: tl.constexpr, DOT_DTYPE: tl.constexpr,
        PREC: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
        D_SPLIT: tl.constexpr, PACKED: tl.constexpr = False):
    wait_inputs()
    M: tl.constexpr = QB * HB
    BW: tl.constexpr = BLOCK_D // D_SPLIT
    b = tl.program_id(1).to(tl.int64)
    first = (tl.program_id(0) // D_SPLIT) * QB
    c0 = (tl.program_id(0) % D_SPLIT) * BW  # this program's output columns [c0, c0 + BW)
    c1 = BW - c0  # the other half's (D_SPLIT 2)
    m = tl.arange(0, M)
    qi = first + m // HB  # this score row's query (chunk index) and head
    h = m % HB
    live = (qi < S) & (h < H)
    d = c0 + tl.arange(0, BW)
    q_row = ((b * S + qi) * H + h).to(tl.int64)[:, None] * D
    q = tl.load(q_ptr + q_row + d[None, :], mask=live[:, None] & (d < D)[None, :], other=0.0).to(DOT_DTYPE)
    q_o = q
    if D_SPLIT == 2:
        d_o = c1 + tl.arange(0, BW)
        q_o = tl.load(q_ptr + q_row + d_o[None, :], mask=live[:, None] & (d_o < D)[None, :], other=0.0).to(DOT_DTYPE)
    p_row = tl.load(pos_ptr + b * S + qi, mask=qi < S, other=0)
    chunk_start = tl.load(pos_ptr + b * S)
    ring_start = tl.load(rs_ptr + b)
    p_first = tl.load(pos_ptr + b * S + first)
    p_last = tl.load(pos_ptr + b * S + tl.minimum(first + QB, S) - 1)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BW], tl.float32)
    # K blocks of the window (positions (p_first - W, p_last], each at its [ring ‖ chunk] row), then
    # of the compressed entries 0 .. the block's largest visible count
    u0 = p_first - W + 1
    n_u = p_last - u0 + 1
    n_wb = tl.cdiv(n_u, K_BLOCK)
    v_row = tl.zeros([M], tl.int32)  # entries each score row sees (none without entries)
    if HAS_ENTRIES:
        v_row = tl.load(vis_ptr + b * S + qi, mask=qi < S, other=0)
    n_e = tl.max(v_row, axis=0)
    for kb in range(0, n_wb + tl.cdiv(n_e, K_BLOCK)):
        k = kb * K_BLOCK + tl.arange(0, K_BLOCK)
        if kb < n_wb:
            u = u0 + k
            in_chunk = u >= chunk_start
            stored = (k < n_u) & (in_chunk | ((u >= 0) & (u >= ring_start)))
            idx = tl.where(stored, tl.where(in_chunk, W + u - chunk_start, u % W), -1).to(tl.int32)
            seen = live[:, None] & stored[None, :] & (u[None, :] > p_row[:, None] - W) & (u[None, :] <= p_row[:, None])
        else:
            j = k - n_wb * K_BLOCK
            idx = tl.load(ent_ptr + b * E + j, mask=j < n_e, other=-1)
            seen = live[:, None] & (idx >= 0)[None, :] & (j[None, :] < v_row[:, None])
        kv = _gather_kv(idx, b, c0, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
                        d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
                        d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
                        o3, so3, sb3, st3, ssb3, sst3, start3, len3,
                        FMT0, FMT1, FMT2, ROLE1, ROLE2, ROLE3, D, K_BLOCK, BW, DOT_DTYPE, D_SPLIT == 1, PACKED)
        kv_o = kv
        if D_SPLIT == 2:
            kv_o = _gather_kv(idx, b, c1, d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
                              d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
                              d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
                              o3, so3, sb3, st3, ssb3, sst3, start3, len3,
                              FMT0, FMT1, FMT2, ROLE1, ROLE2, ROLE3, D, K_BLOCK, BW, DOT_DTYPE, False, PACKED)
        s = _scores(q, kv, q_o, kv_o, c0 == 0, D_SPLIT, PREC)
        m_i, l_i, acc = _attend(s, kv, seen, m_i, l_i, acc, qk_scale, DOT_DTYPE, PREC)
    sk = tl.load(sink_ptr + h, mask=h < H, other=0.0) * LOG2E if HAS_SINK else 0.0
    out = _finish(acc, m_i, l_i, sk, HAS_SINK)
    tl.store(out_ptr + q_row + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None] & (d < D)[None, :])


def _plan(q: torch.Tensor, codes: tuple, has_entries: bool, has_sink: bool) -> dict | None:
    """Grid and constexprs of one launch; None where a program would hold one query (no sharing)."""
    B, S, H, D = q.shape
    t = PLANS.lookup(None)[0]["prefix"]
    hb = max(16, next_pow2(H))
    qb = t["M_BLOCK"] // hb
    roles = attention._roles(codes)
    if qb < 2 or roles is None:
        return None
    dot_dtype, prec = attention._dot_mode(q.dtype)
    fmt = list(codes) + [0] * (attention.MAX_SEGMENTS - len(codes))
    d_split = t["D_SPLIT"] if next_pow2(D) >= 64 else 1  # halves of >= 32 columns (scale blocks)
    return dict(grid=(cdiv(S, qb) * d_split, B), roles=(0, *roles), constexprs=dict(
        FMT0=fmt[0], FMT1=fmt[1], FMT2=fmt[2], ROLE1=roles[0], ROLE2=roles[1], ROLE3=roles[2], HAS_SINK=has_sink,
        HAS_ENTRIES=has_entries, DOT_DTYPE=dot_dtype, PREC=prec, QB=qb, HB=hb, K_BLOCK=t["K_BLOCK"],
        BLOCK_D=next_pow2(D), D_SPLIT=d_split, PACKED=attention.packed_rows(), num_warps=t["num_warps"],
        num_stages=t["num_stages"]))


def prefix_attention(q, kv, positions, ring_start, window, entries, visible, sink, scale):
    B, S, H, D = q.shape
    segs = attention._segments(kv)
    if not segs or B * S == 0:
        return torch.zeros_like(q)
    codes = tuple(s[2] for s in segs)
    key = (B, S, H, D, q.dtype, q.device, codes, entries is not None, sink is not None)
    plan = PLANS.lookup(key)[1]
    if plan is None:
        plan = PLANS.store(key, _plan(q, codes, entries is not None, sink is not None) or "sparse")
    if plan == "sparse":  # no queries to share rows with: the sparse kernel on the implied indices
        indices = refmath.prefix_indices(positions, ring_start, window, entries, visible)
        return attention.sparse_attention(q, kv, indices, sink, scale)
    q, positions, ring_start = dense(q), dense(positions), dense(ring_start)
    out = torch.empty_like(q)
    none = splitk.counters(q.device)  # an int32 stand-in for absent entries (not read)
    ent = dense(entries) if entries is not None else none
    vis = dense(visible) if visible is not None else none
    _prefix_attention_kernel[plan["grid"]](
        q, positions, ring_start, ent, vis, dense(sink) if sink is not None else q, out,
        *attention._segment_args(segs, plan["roles"]), S, H, window,
        entries.shape[-1] if entries is not None else 0, float(scale) * attention.LOG2E, D, **plan["constexprs"],
        **pdl.options(q.device))
    return out


def prefix_fits(q, kv, *_) -> bool:
    """The segments' limits of the sparse kernel (whose row gather this kernel shares)."""
    return attention.segments_fit(q, kv, None, None, None)


# ---------------------------------------------------------------------------------------------
# ahead-of-time compilation (``flashrt jit warmup``)

def warmup_cases(device, d: dict, dtype):
    """A prompt chunk of 64 queries over the window ring, the chunk and the main KV (with entries:
    the compressed layers; without: the window-only layers), with a sink."""
    window = STORAGE.get(profiles.active_profile().kv_window_dtype, "?")
    if window is not None and window not in attention.FMT_CODES:
        return
    H, D, W, S, T = d["n_heads"], d["head_dim"], d["window_size"], 64, 1000
    ring, chunk = zeros_stored(window, (1, W, D), dtype, device), zeros_stored(window, (1, S, D), dtype, device)
    main = zeros_stored(MAIN_KV_FORMAT, (1, T, D), dtype, device)
    q, sink = torch.zeros(1, S, H, D, dtype=dtype, device=device), torch.zeros(H, device=device)
    pos, rs = torch.arange(S, device=device).view(1, S), torch.zeros(1, dtype=torch.long, device=device)
    ent, vis = torch.zeros(1, T, dtype=torch.int32, device=device), torch.zeros(1, S, dtype=torch.int32, device=device)
    yield _warmup.Launch("prefix_attention", prefix_attention, (q, (ring, chunk, main), pos, rs, W, ent, vis, sink, 1.0))
    yield _warmup.Launch("prefix_attention window", prefix_attention, (q, (ring, chunk), pos, rs, W, None, None, sink, 1.0))


FAMILY = KernelFamily(
    "prefix_attention", ops={"prefix_attention": prefix_attention},
    supports={"prefix_attention": Support(
        inputs={"q": attention.PLAIN_DTYPES, "kv": attention.PLAIN_DTYPES + tuple(attention.FMT_CODES)},
        dims={"q[-1]": Dim(32, attention.MAX_D, 32)}, extra=prefix_fits)},
    tiles=TILES, tile_checks={"prefix.M_BLOCK": DOT, "prefix.K_BLOCK": DOT, "prefix.D_SPLIT": Tile(choices=(1, 2))},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="a prompt chunk's attention over its causal window and a prefix of the compressed entries, "
                "each KV row gathered once for a block of queries")
