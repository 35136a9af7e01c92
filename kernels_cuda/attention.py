"""Sparse MQA attention over gathered, quantized KV rows (``flashrt.ops.sparse_attention``).

One program per (query ``b, s``, block of heads, K split). All heads of a query share the same
gathered latent rows (MQA), so each selected row is loaded and dequantized ONCE per program and
serves every head of the block: ``q [H_BLOCK, D] @ kv [K_BLOCK, D]^T`` and ``p @ kv`` via
``tl.dot``, online softmax (base 2) over K in blocks. KV segments (a tuple stands for their
concatenation along T) are read as stored: plain float, ``fp8`` (E4M3 + UE8M0 per 32),
``fp4_b16`` (E2M1 + E4M3 per 16), ``fp4_b32`` (E2M1 + UE8M0 per 32); a global index is mapped to
its segment by comparing with the segment starts (segments in one quantized format share one
dequant path); a K block only converts the formats it touches. With few queries the K blocks
are split over programs (flash-decoding): each writes ``(acc / l, m, l)`` and the last split
program of each tile merges them with the sink in the same launch (``tiles.combine.in_kernel``,
ticket counters of :mod:`.splitk`), or ``_combine_kernel`` does in a launch of its own. Dots:
bf16 MMA for bf16 q, 3 bf16 MMAs (``bf16x3``) for fp16 / fp32 q.

This file holds the launcher and its planning; the Triton kernels are in :mod:`.attention_kernel`
and the format decoders in :mod:`.codecs`. Everything that follows from the shapes, formats and
the profile's tiles (tiles, grid, splits, constexprs) is planned once per key (:mod:`.launch`).
"""
from __future__ import annotations

import torch
import triton.language as tl

from flashrt import profiles
from flashrt.dtypes import MAIN_KV_FORMAT, STORAGE
from flashrt.families import Dim, KernelFamily, Support
from flashrt.tile_checks import COUNT0, DOT, POW2, Tile
from flashrt.formats import QTensor
from flashrt.jit_triton import interpreted
from flashrt import jit_targets
from flashrt.kernels_cuda.attention_kernel import _combine_kernel, _sparse_attention_kernel
from flashrt.kernels_cuda import attention_ws
from flashrt.kernels_cuda.codecs import CODES
from flashrt.kernels_cuda import splitk
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.launch import PlanCache, cdiv, dense, last_dense, next_pow2, sm_count, zeros_stored
from flashrt.kernels_cuda import pdl

TILES = {  # H_BLOCK >= 16 (tl.dot); sm_90 smem: H_BLOCK * D * 2 (q) + 2 * K_BLOCK * D * 2 (kv) + stages
    # D_SPLIT 2: two programs per head block, each accumulating half of the output columns, used
    # when the programs (with D_SPLIT) fill at most half the SMs: few queries, where it is faster; with
    # many queries it is slower (docs/performance.md, sparse_attention)
    "attention": {"H_BLOCK": 64, "K_BLOCK": 32, "num_warps": 8, "num_stages": 2, "D_SPLIT": 2},  # bf16 q
    # fp16 / fp32 q: fp32 dot operands at this input precision ("bf16x3": 3 bf16 MMAs, ~2**-16)
    "attention_fp32": {"H_BLOCK": 64, "K_BLOCK": 16, "num_warps": 8, "num_stages": 1, "precision": "bf16x3",
                       "D_SPLIT": 1},
    # in_kernel: the last split program of each tile merges the partials (no combine launch);
    # else _combine_kernel, one program per (query, H_BLOCK heads, BLOCK_D columns)
    "combine": {"H_BLOCK": 16, "BLOCK_D": 64, "num_warps": 4, "in_kernel": False},
    # launches of at least min_queries queries (B * S; 0: none) with bf16 q and at most max_heads
    # heads a program (0: any) run with these warps and stages instead: a prefill chunk has one
    # program per query and head block and no split, and fewer warps a program can suit it where
    # they would slow a decode step; a program of many heads holds an accumulator of H_BLOCK x D
    # fp32 that fewer warps would spill (docs/performance.md)
    "prefill": {"min_queries": 0, "max_heads": 0, "num_warps": 8, "num_stages": 2},
    # split-K: splits = min(programs // (B*S*head blocks), max_splits, K blocks // min_blocks);
    # programs 0 = the device's SM count
    "split": {"programs": 0, "min_blocks": 1, "max_splits": 32},
    # packed_fp4_b16: the fp4_b16 KV rows decoded eight codes a call in packed bf16 registers on sm_90
    # (codecs.dequant_rows; the same values), in this family's kernels and prefix_attention's; the
    # warp-specialized kernel's producer also decodes the fp8 window rows four bytes a call under it
    "dequant": {"packed_fp4_b16": False},
    # enabled: launches that fit it (bf16 q, D 512, heads a multiple of 64, fp8 / fp4_b16 segments, an
    # sm_90 device) run the warp-specialized Gluon kernel (:mod:`.attention_ws`): a producer partition of
    # producer_warps gathering RAW_STAGES K blocks ahead with asynchronous copies and decoding them into
    # a ring of STAGES bf16 slots of K_BLOCK rows (CW columns at a time), two consumer warpgroups on the
    # MMAs (overlap: a block's score MMA issued before the softmax of the block before); registers:
    # maxnreg a thread of the kernel, producer_regs of the producer's; pv_parts 2: the value MMA in two
    # halves of the output columns, which a launch of 8 producer warps needs (its 16 warps allow 128
    # registers a thread at launch, under what one 256-wide accumulator instruction takes);
    # q_in_consumers: q loaded by the consumers after the partitions start (the producer's first
    # copies do not wait for it); split_scores: each consumer warpgroup a partition computing a block's
    # scores over half of D (half of q read a block) and adding the other's half through shared memory
    # (overlap and pv_parts do not apply to it; with q_in_consumers each loads its half of q), the
    # registers the producer leaves shared evenly between the two; rows_by_warp: the producer's warps
    # split a block's rows when copying (a thread locates one row of 32, not four); staged_stores: the output
    # (or split partials) leaves through q's shared memory, 16-byte vectors a thread; decode_ahead: the
    # producer loads each chunk of raw bytes before storing the decoded chunk ahead of it
    # min_queries: launches of fewer queries (B * S) keep the plain kernel (at one query it is faster)
    "ws": {"enabled": False, "min_queries": 1, "K_BLOCK": 32, "STAGES": 2, "RAW_STAGES": 3, "CW": 128,
           "producer_warps": 4, "producer_regs": 88, "maxnreg": 168, "overlap": False,
           "pv_parts": 1, "q_in_consumers": False, "split_scores": False, "rows_by_warp": False,
           "staged_stores": False, "decode_ahead": False},
}


PLANS = PlanCache("attention", TILES)  # the active tiles and the launch plans made with them
_tiles = PLANS.tiles
MAX_D = 512
MAX_SEGMENTS = 4  # three with their own dequant path at most; a fourth joins one of the same format
OFFSET_BIAS = 1 << 48  # added to every segment offset (attention_kernel.OFFSET_BIAS): always int64
FMT_CODES = {f: CODES[f] for f in ("fp8", "fp4_b16", "fp4_b32")}  # 0 = plain float
PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = 1.4426950408889634


def _segments(kv) -> list[tuple]:
    """Non-empty segments as (data, scale, fmt code, start, length), last dim contiguous; stored
    bytes as uint8 (plain: (data, data, 0, ...))."""
    out, start = [], 0
    for seg in (kv if isinstance(kv, tuple) else (kv,)):
        n = seg.shape[1]
        if n and isinstance(seg, QTensor):
            data, scale = last_dense(seg.data.view(torch.uint8)), last_dense(seg.scale.view(torch.uint8))
            out.append((data, scale, FMT_CODES[seg.fmt], start, n))
        elif n:
            seg = last_dense(seg)
            out.append((seg, seg, 0, start, n))
        start += n
    return out


def _segment_args(segs, roles) -> list:
    """Per segment: base pointers (not for the fourth, always merged), offsets from them (biased),
    (b, t) strides of data and scale, start, length. A merged segment (roles[i] < i) is addressed
    from its target's pointers."""
    args = []
    segs = segs + [segs[0][:3] + (0, 0)] * (MAX_SEGMENTS - len(segs))
    for i, (data, scale, code, start, n) in enumerate(segs):
        base, sbase = segs[roles[i] if 0 <= roles[i] < i else i][:2]
        args += ([base, sbase] if i < 3 else []) + [
            OFFSET_BIAS + data.data_ptr() - base.data_ptr(), OFFSET_BIAS + scale.data_ptr() - sbase.data_ptr(),
            _bstride(data), data.stride(1), *((_bstride(scale), scale.stride(1)) if code else (0, 0)), start, n]
    return args


def _bstride(t: torch.Tensor) -> int:
    """Batch stride; 0 for a batch-1 segment, which every row shares (the HKCP page pool)."""
    return 0 if t.shape[0] == 1 else t.stride(0)


def _roles(codes) -> tuple[int, int, int] | None:
    """ROLE1, ROLE2, ROLE3 of _gather_kv: a quantized segment joins the first earlier segment that
    has its own dequant path in the same format, else gets its own path (at most three); -1 where
    the segment is absent. None when a fourth segment has no such segment to join."""
    roles, own = [], [0]
    for i in range(1, MAX_SEGMENTS):
        if i >= len(codes):
            roles.append(-1)
            continue
        target = next((j for j in own if codes[i] and codes[j] == codes[i]), i)
        if target == i and i == MAX_SEGMENTS - 1:
            return None
        roles.append(target)
        own += [i] if target == i else []
    return tuple(roles)


def _segment_constexprs(codes) -> dict:
    """FMT0..2 and ROLE1..3 of the kernels for segments in formats ``codes``."""
    fmt = list(codes) + [0] * (MAX_SEGMENTS - len(codes))
    role1, role2, role3 = _roles(codes)
    return dict(FMT0=fmt[0], FMT1=fmt[1], FMT2=fmt[2], ROLE1=role1, ROLE2=role2, ROLE3=role3)


def _plan(q: torch.Tensor, K: int) -> tuple[dict, int, int, int, int, int]:
    """(tiles, H_BLOCK, K_BLOCK, splits, blocks per split, D_SPLIT): split K until the programs fill
    one wave (one program per SM: it holds most of an SM's shared memory)."""
    B, S, H, D = q.shape
    tiles = _tiles()
    t, pre = tiles["attention" if q.dtype == torch.bfloat16 else "attention_fp32"], tiles["prefill"]
    h_block = min(t["H_BLOCK"], max(16, next_pow2(H)))
    few_heads = pre["max_heads"] == 0 or h_block <= pre["max_heads"]  # h_block: the heads a program holds
    if q.dtype == torch.bfloat16 and 0 < pre["min_queries"] <= B * S and few_heads:
        t = {**t, "num_warps": pre["num_warps"], "num_stages": pre["num_stages"]}
    k_block = min(t["K_BLOCK"], max(16, next_pow2(K)))
    assert t["D_SPLIT"] in (1, 2), f"tiles.attention D_SPLIT: expected 1 or 2, got {t['D_SPLIT']!r}"
    n_kb = cdiv(K, k_block)
    wave = tiles["split"]["programs"] or sm_count(q.device)
    programs = B * S * cdiv(H, h_block)
    # halves of >= 32 columns (scale blocks), only while the split programs fill at most half a wave
    d_split = t["D_SPLIT"] if next_pow2(D) >= 64 and 2 * t["D_SPLIT"] * programs <= wave else 1
    return (t, h_block, k_block, *_split_k(n_kb, programs * d_split, wave), d_split)


def _split_k(n_kb: int, programs: int, wave: int) -> tuple[int, int]:
    """(splits, K blocks a split) of ``n_kb`` K blocks over ``programs`` programs a split: split until
    the programs fill ``wave`` (tiles.attention.split's limits), each split at least one block."""
    sp = _tiles()["split"]
    splits = max(1, min(wave // programs, sp["max_splits"], n_kb // sp["min_blocks"]))
    per_split = cdiv(n_kb, splits)
    return cdiv(n_kb, per_split), per_split


def packed_rows() -> bool:
    """Whether the attention kernels decode fp4_b16 rows in packed registers (the ``dequant`` tile; the
    kernels take it on sm_90 targets only)."""
    return bool(_tiles()["dequant"]["packed_fp4_b16"])


def _dot_mode(dtype: torch.dtype):
    """(dot operand dtype, input precision): bf16 MMA for bf16 q; fp16 / fp32 q: fp32 operands at
    TILES' precision (bf16x3 needs a third of 3xTF32's shared memory); fp32 in the interpreter
    (its bf16 dot / arithmetic is wrong)."""
    if interpreted():
        return tl.float32, "ieee"
    return (tl.bfloat16, "ieee") if dtype == torch.bfloat16 else (tl.float32, _tiles()["attention_fp32"]["precision"])


def _launch_plan(q: torch.Tensor, K: int, codes: tuple, has_sink: bool) -> dict:
    """What a launch takes from the shapes, formats and tiles: grid, splits, segment roles, the
    partials' dtype and the kernel's constexprs (cached in PLANS by the launcher)."""
    B, S, H, D = q.shape
    t, h_block, k_block, splits, per_split, d_split = _plan(q, K)
    dot_dtype, prec = _dot_mode(q.dtype)
    tiles = B * S * cdiv(H, h_block) * d_split  # programs per split: one ticket counter each
    finish = splits > 1 and _tiles()["combine"]["in_kernel"] and splitk.fits(tiles)
    return dict(grid=(B * S, cdiv(H, h_block) * d_split, splits), splits=splits, per_split=per_split, finish=finish,
                roles=(0, *_roles(codes)),  # partial outputs in bf16 for bf16 q (half the traffic), else fp32
                pdtype=torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32,
                constexprs=dict(**_segment_constexprs(codes), HAS_SINK=has_sink,
                                SPLIT=splits > 1, DOT_DTYPE=dot_dtype, PREC=prec, H_BLOCK=h_block, K_BLOCK=k_block,
                                BLOCK_D=next_pow2(D), D_SPLIT=d_split, FINISH=finish, PACKED=packed_rows(),
                                num_warps=t["num_warps"],
                                num_stages=t["num_stages"]))


def _aligned16(segs) -> bool:
    """Every segment's rows and scale rows start on 16 bytes (the warp-specialized kernel copies
    them 16 bytes at a time)."""
    return all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
               for data, scale, *_ in segs for t in (data, scale))


def _ws_fits(q: torch.Tensor, codes: tuple, aligned: bool = True) -> bool:
    """Whether the warp-specialized kernel serves this launch (``tiles.attention.ws``): bf16 q, D 512,
    heads a multiple of 64, fp8 / fp4_b16 segments ``codes`` whose rows are ``aligned`` on 16 bytes,
    an sm_90 device."""
    B, S, H, D = q.shape
    t = _tiles()["ws"]
    return (bool(t["enabled"]) and B * S >= t["min_queries"] and attention_ws.AVAILABLE and not interpreted()
            and aligned and q.dtype == torch.bfloat16 and D == MAX_D and H % attention_ws.H_BLOCK == 0
            and all(c in (FMT_CODES["fp8"], FMT_CODES["fp4_b16"]) for c in codes)
            and jit_targets.capability() == (9, 0))


def _consumers(t: dict) -> dict:
    """The constexprs of the ws kernel's consumers under tiles ``t``: one partition of two warpgroups
    (``overlap``, ``pv_parts``, ``q_in_consumers``), or with ``split_scores`` two partitions of one (each
    loading the half of q it reads with ``q_in_consumers``), the second at half of what the producer's
    warps leave of a thread's 65,536 / 128 (multiples of 8)."""
    if t["split_scores"]:
        left = 65536 // 128 - t["producer_regs"] * t["producer_warps"] // 4
        return dict(OVERLAP=False, num_warps=4, SPLIT_SCORES=True, CONSUMER_REGS=left // 2 // 8 * 8,
                    **({"Q_IN_CONSUMERS": True} if t["q_in_consumers"] else {}))
    return dict(OVERLAP=t["overlap"], num_warps=8, **({"PV_PARTS": 2} if t["pv_parts"] == 2 else {}),
                **({"Q_IN_CONSUMERS": True} if t["q_in_consumers"] else {}))


def _ws_launch_plan(q: torch.Tensor, K: int, codes: tuple, has_sink: bool) -> dict:
    """:func:`_launch_plan` for the warp-specialized kernel: one program per (query, 64 heads, K split),
    the split rule of ``tiles.attention.split``, partials merged by the combine launch."""
    B, S, H, D = q.shape
    t = _tiles()["ws"]
    programs = B * S * (H // attention_ws.H_BLOCK)
    splits, per_split = _split_k(cdiv(K, t["K_BLOCK"]), programs, _tiles()["split"]["programs"] or sm_count(q.device))
    return dict(ws=True, grid=(B * S, H // attention_ws.H_BLOCK, splits), splits=splits, per_split=per_split,
                finish=False, roles=(0, *_roles(codes)), pdtype=torch.bfloat16,
                constexprs=dict(**_segment_constexprs(codes), HAS_SINK=has_sink, SPLIT=splits > 1,
                                K_BLOCK=t["K_BLOCK"], STAGES=t["STAGES"], RAW_STAGES=t["RAW_STAGES"], CW=t["CW"],
                                PRODUCER_WARPS=t["producer_warps"], PRODUCER_REGS=t["producer_regs"],
                                PACKED=packed_rows(), maxnreg=t["maxnreg"], **_consumers(t),
                                **({"ROWS_BY_WARP": True} if t["rows_by_warp"] else {}),
                                **({"STAGED_STORES": True} if t["staged_stores"] else {}),
                                **({"DECODE_AHEAD": True} if t["decode_ahead"] else {})))


def planned_splits(q: torch.Tensor, K: int, codes: tuple) -> tuple[str, int]:
    """(the kernel, "ws" or "plain", and its K splits) a launch of these shapes and segment formats
    gets under the active tiles (its rows' alignment assumed)."""
    if _ws_fits(q, codes):
        return "ws", _ws_launch_plan(q, K, codes, False)["splits"]
    return "plain", _plan(q, K)[3]


def _combine(pacc, pml, sink, out, splits: int) -> None:
    B, S, H, D = out.shape
    key = ("combine", B * S, H, D)
    tiles, plan = PLANS.lookup(key)
    if plan is None:
        t = tiles["combine"]
        block_d = min(t["BLOCK_D"], next_pow2(D))
        plan = PLANS.store(key, ((B * S, cdiv(H, t["H_BLOCK"]), cdiv(D, block_d)), dict(
            H_BLOCK=t["H_BLOCK"], BLOCK_D=block_d, num_warps=t["num_warps"])))
    _combine_kernel[plan[0]](pacc, pml, sink if sink is not None else pml, out, splits, H, D, sink is not None,
                             **plan[1], **pdl.options(pacc.device))


def _ws_aligned(q, segs) -> bool:
    """The segments' rows aligned for the warp-specialized kernel (:func:`_aligned16`), looked at only where it
    may take the launch (its tile on, bf16 q)."""
    return bool(_tiles()["ws"]["enabled"]) and q.dtype == torch.bfloat16 and _aligned16(segs)


def launch_path(q, kv, indices, sink, scale) -> str:
    """The kernel :func:`sparse_attention` runs for these arguments under the active tiles: ``ws`` (the
    warp-specialized kernel, tiles ``ws``) or ``plain`` (tiles ``attention``, ``split``); ``flashrt tune`` sweeps
    the tiles of the one its case takes."""
    segs = _segments(kv)
    return "ws" if segs and _ws_fits(q, tuple(s[2] for s in segs), _ws_aligned(q, segs)) else "plain"


def sparse_attention(q, kv, indices, sink, scale):
    B, S, H, D = q.shape
    parts = indices if isinstance(indices, tuple) else (indices,)
    if len(parts) > 2:  # the kernel reads one or two parts
        parts = (torch.cat(parts, dim=-1),)
    K = sum(p.shape[-1] for p in parts)
    segs = _segments(kv)
    if not segs or min(B * S, H, K) == 0:
        return torch.zeros_like(q)
    codes = tuple(s[2] for s in segs)
    aligned = _ws_aligned(q, segs)
    key = (B, S, H, D, K, q.dtype, q.device, codes, sink is not None, aligned)
    plan = PLANS.lookup(key)[1]
    if plan is None:
        assert D % 32 == 0 and D <= MAX_D and len(segs) <= MAX_SEGMENTS, (D, len(segs))
        assert q.dtype in PLAIN_DTYPES and all(p.dtype == torch.int32 for p in parts), q.dtype
        make = _ws_launch_plan if _ws_fits(q, codes, aligned) else _launch_plan
        plan = PLANS.store(key, make(q, K, codes, sink is not None))
    q, parts = dense(q), tuple(map(dense, parts))
    sink = None if sink is None else dense(sink)
    out = torch.empty_like(q)
    splits = plan["splits"]
    pacc = pml = out
    if splits > 1:
        pacc = torch.empty(splits, B * S, H, D, dtype=plan["pdtype"], device=q.device)
        pml = torch.empty(splits, B * S, H, 2, dtype=torch.float32, device=q.device)
    args = (q, parts[0], parts[-1], sink if sink is not None else q, out, pacc, pml,
            *_segment_args(segs, plan["roles"]), S, H, K, parts[0].shape[-1], plan["per_split"], float(scale) * LOG2E)
    if plan.get("ws"):
        attention_ws._ws_attention_kernel[plan["grid"]](*args, D, TWO_PARTS=len(parts) == 2, **plan["constexprs"],
                                                        **pdl.options(q.device))
    else:
        _sparse_attention_kernel[plan["grid"]](
            *args, splitk.counters(q.device) if plan["finish"] else pml, D,  # ticket counters only when merging
            TWO_PARTS=len(parts) == 2, **plan["constexprs"], **pdl.options(q.device))
    if splits > 1 and not plan["finish"]:
        _combine(pacc, pml, sink, out, splits)
    return out


def segments_fit(q, kv, indices, sink, scale) -> bool:
    """At most four non-empty KV segments and at most three formats' dequant paths (a fourth
    segment shares an earlier segment's format: HKCP's ring + chunk + page pool + cold staging).
    Reads only segment formats and emptiness (the call key holds both)."""
    segs = kv if isinstance(kv, tuple) else (kv,)
    live = [s for s in segs if (s.data if isinstance(s, QTensor) else s).numel()]
    if len(live) > MAX_SEGMENTS:
        return False
    return _roles([FMT_CODES[s.fmt] if isinstance(s, QTensor) else 0 for s in live]) is not None


# ---------------------------------------------------------------------------------------------
# ahead-of-time compilation (``flashrt jit warmup``)

# (batch, queries, main KV entries): decode (split K) and prefill chunks below and past the prefill
# tiles' min_queries of the shipped profiles; main KV lengths on both sides of Triton's
# divisibility-by-16 specialization
WARMUP_CASES = ((1, 1, 1024), (1, 1, 1000), (8, 1, 1000), (1, 64, 1000), (1, 512, 1000))


def warmup_cases(device, d: dict, dtype):
    """The variants the model launches under the active profile: q in the activation dtype over
    (``kv_window_dtype`` ring, chunk, the main KV in ``MAIN_KV_FORMAT``), with a sink, K = window +
    index top-k in two index parts; every case of WARMUP_CASES, and the decode steps that read cold HKCP pages (a fourth
    segment: the staged picks)."""
    window, main = STORAGE.get(profiles.active_profile().kv_window_dtype, "?"), MAIN_KV_FORMAT
    if window is not None and window not in FMT_CODES:
        return  # a window format this kernel does not serve: the op goes elsewhere
    H, D, W, K = d["n_heads"], d["head_dim"], d["window_size"], d["index_topk"]
    for B, S, T in WARMUP_CASES:
        kv = (zeros_stored(window, (B, W, D), dtype, device), zeros_stored(window, (B, S, D), dtype, device),
              zeros_stored(main, (B, T, D), dtype, device))
        # the window's indices and the compressed picks, in two parts as a compressed layer gives them
        idx = (torch.zeros(B, S, W, dtype=torch.int32, device=device), torch.zeros(B, S, K, dtype=torch.int32, device=device))
        q, sink = torch.zeros(B, S, H, D, dtype=dtype, device=device), torch.zeros(H, device=device)
        yield _warmup.Launch("sparse_attention", sparse_attention, (q, kv, idx, sink, D ** -0.5))
        if S == 1:
            cold = kv + (zeros_stored(main, (1, B * K, D), dtype, device),)
            yield _warmup.Launch("sparse_attention cold", sparse_attention, (q, cold, idx, sink, D ** -0.5))


PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16x3")  # tl.dot input precisions of fp32 operands
TILE_CHECKS = {"*.H_BLOCK": DOT, "*.K_BLOCK": DOT, "*.D_SPLIT": Tile(choices=(1, 2)), "combine.H_BLOCK": POW2,
               "prefill.min_queries": COUNT0, "prefill.max_heads": COUNT0,
               "combine.BLOCK_D": POW2, "combine.in_kernel": Tile(kind=bool),
               "attention_fp32.precision": Tile(choices=PRECISIONS), "split.programs": COUNT0,
               "dequant.packed_fp4_b16": Tile(kind=bool), "ws.enabled": Tile(kind=bool), "ws.K_BLOCK": DOT,
               "ws.min_queries": Tile(low=1),
               "ws.STAGES": Tile(low=1, high=8), "ws.RAW_STAGES": Tile(low=1, high=8),
               "ws.CW": Tile(low=64, high=512, pow2=True),
               "ws.producer_warps": Tile(choices=(4, 8)), "ws.producer_regs": Tile(low=24, high=256, multiple=8),
               "ws.maxnreg": Tile(low=24, high=256, multiple=8), "ws.overlap": Tile(kind=bool),
               "ws.pv_parts": Tile(choices=(1, 2)), "ws.q_in_consumers": Tile(kind=bool),
               "ws.split_scores": Tile(kind=bool), "ws.rows_by_warp": Tile(kind=bool),
               "ws.staged_stores": Tile(kind=bool), "ws.decode_ahead": Tile(kind=bool)}


def _kv_tile_bytes(t: dict) -> int:
    """At least the dequantized bf16 KV tile of one program (K_BLOCK rows of its share of D = 512)."""
    return t["K_BLOCK"] * (MAX_D // t["D_SPLIT"]) * 2


FAMILY = KernelFamily(
    "attention", ops={"sparse_attention": sparse_attention},
    # bf16/fp16/fp32 q; D % 32 == 0 and D <= 512; each segment plain or fp8 / fp4_b16 / fp4_b32
    supports={"sparse_attention": Support(inputs={"q": PLAIN_DTYPES, "kv": PLAIN_DTYPES + tuple(FMT_CODES)},
                                          dims={"q[-1]": Dim(32, MAX_D, 32)}, extra=segments_fit)},
    tiles=TILES, tile_checks=TILE_CHECKS,
    smem={"attention": _kv_tile_bytes, "attention_fp32": _kv_tile_bytes}, paths={"sparse_attention": launch_path},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases, description="sparse MQA attention over gathered, quantized KV rows")
