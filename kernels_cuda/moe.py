"""``moe_experts``: routed SwiGLU experts with ``fp4_w`` / ``fp8_w`` weights, grouped by expert.

The (token, slot) pairs are sorted by expert with a table of row tiles, each inside one expert
(:mod:`.moe_tables`: one program for decode-sized batches, a sort and two kernels past that; no
host sync, so it can be captured in a CUDA graph). Then three kernels (:mod:`.moe_kernels`):

1. ``_moe_up_kernel``: per (row tile, column tile of I), W1 and W3 over the fp8 activations of the
   tile's tokens (rows gathered by token id; up to ``fused_max_tokens`` tokens quantized in the kernel
   from x, past that by one ``act_quant`` launch first), the SwiGLU epilogue in fp32 (gate and up rounded to
   x.dtype first, clamp, silu, times the routing weight), h rounded to x.dtype and quantized to fp8
   per 32 (the input W2 sees, as ``linear`` would quantize it), stored in pair order;
2. ``_moe_down_kernel``: per (row tile, column tile of D), W2 over h, output rounded to x.dtype;
3. ``_moe_combine_kernel``: each token sums its k rows in fp32 (a deterministic gather-sum), adds
   the op's ``add`` row after the sum and stores in ``out_dtype``; with ``combine.in_kernel`` (up
   to ``splitk.POOL`` token x column tiles) the down kernel does it: each (token, column tile) has a
   ticket counter (kernels_cuda/splitk.py's pool), and the program that stores a token's last row
   sums its k rows in slot order, so the bits are the combine kernel's.

Up to ``pair_tiles`` tokens (decode) the tables are not built: each (token, slot) pair is a row
tile of its own, in pair order (``PAIRS``: expert = its index, token = pair // k); a batch-1 step's
pairs are distinct experts, so this reads what the tables' tiles read, one launch fewer.

``shared`` (the model's shared expert, any weight format of FAMILY) runs in the same up and down
launches: its row tiles (``BLOCK_M`` tokens each, rows ``pairs + token``) follow the routed ones,
each tile picks its weights and decoder by a runtime branch between two compiled K loops, and the
combine adds the token's shared row after its k slots. Shared weights the kernels do not decode
(plain) go through the reference math, joined as the combine's ``add``.

From ``grouped_min_rows`` pair rows per expert (a profile's choice; prefill) with bf16 x, the call
runs as two bf16 grouped GEMMs over weights dequantized once (:mod:`.moe_grouped`).

With ``act_dequantized`` the activations reach both kernels as the bf16 values of their fp8 round
trip: x by :func:`.round_trip.fp8_round_trip` first, h as the up kernel's epilogue stores it; the MMA
loops load them as they are (the same values, so fp4_w weights give the same bits; fp8_w weights
take the dequantizing MMA, the raw E4M3 one needing fp8 activations).

One expert and one slot a token (the shared expert alone, expert parallel; ``direct`` on) needs no
tables and no sum: pair ``t`` is token ``t``, the row tiles are ``BLOCK_M`` tokens each
(``DIRECT``), and the down kernel writes each token's x.dtype-rounded row as fp32: two launches.

Decode launches have few row tiles: the experts rule's knobs (``KNOBS``, off by default) narrow
the column tiles and / or split K over programs (the tile's last program sums the fp32 partials
and runs the epilogue, :mod:`.moe_kernels`) where the programs do not fill the SMs. The tiles,
splits and paths are planned once per shape under the active profile (``PLANS``).

The MMA modes are those of ``linear.py`` (promote for fp8_w on sm_89+, dequant-to-bf16 otherwise).
``moe_route`` is not served here (the reference does it: one small GEMM and a top-k).
"""
from __future__ import annotations

import torch

from flashrt import jit_targets
from flashrt.families import Dim, KernelFamily, Support
from flashrt.formats import QTensor
from flashrt.tile_checks import COUNT0, GEMM_ROWS, POW2, Tile, gemm_smem
from flashrt.kernels_cuda.launch import TL_DTYPES, PlanCache, cdiv, last_dense
from flashrt.kernels_cuda import (experts_qgmma, moe_grouped, moe_mma, moe_qgmma, moe_qgmma_stream, moe_tables,
                                  moe_warmup, splitk)
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda import linear as _linear
from flashrt.kernels_cuda.linear import (FLOATS, FOLD_MAX_SCALE, SCALED, WEIGHT_FORMATS, act_quant, fold_fp8,
                                         fold_scales, fp4_decode, fp8_decode, may_fold, mma_mode, pick_tile,
                                         scales_at_most, split_tile, weight_operands, with_words)
from flashrt.kernels_cuda.linear_kernel import ACT_DEQUANTIZED
from flashrt.kernels_cuda.moe_kernels import _moe_combine_kernel, _moe_down_kernel, _moe_up_kernel
from flashrt.kernels_cuda.round_trip import fp8_codes, fp8_round_trip
from flashrt.refmath_moe import experts_loop, finish_experts
from flashrt.kernels_cuda import pdl

# A rule's launch knobs (not kernel parameters; a rule without them gets these values), applied to
# the up (I columns over D) and the down (D columns over I) launch apart, as linear's: min_block_n
# halves BLOCK_N, down to it, while the (row tile, column tile) programs at the halved width still
# fit in the SMs (None: BLOCK_N as given); split_min_blocks: split K when they do not fill the SMs,
# keeping this many K blocks a split (None: no split); split_per_sm: split K to bring the programs
# nearest to this many an SM (linear's knob); split_k: a forced count (None: as above); swap_operands:
# the rule's 64-row tiles multiply w @ x.T, as linear's tile of that name (None: that tile decides);
# gemv_mma: routed fp4_w experts in E2M1 words whose folded scales fit (linear.FOLD_MAX_SCALE), with the
# activations dequantized (act_dequantized), on mma.sync with the weights as its M side (:mod:`.moe_mma`,
# Gluon, sm_80+): num_warps x 16 weight rows a program, row tiles of gemv_mma_tokens pair rows, the K split
# aiming at gemv_mma_per_sm programs an SM, gemv_mma_stages ring slots of gemv_mma_sub K slices of 32;
# qgmma: routed fp4_w experts in the standard nibbles, the activations dequantized (act_dequantized), on the
# fp8 warpgroup MMA with the weights as its register operand (:mod:`.moe_qgmma`, Gluon, sm_90): 64 weight rows
# a program, row tiles of qgmma_tokens pair rows, the K split aiming at qgmma_per_sm programs an SM with at
# most qgmma_max_k a program, the weights through a ring of qgmma_stages trips of four K blocks (0: loaded
# where used); with qgmma_tokens of 32 or 64 (a prefill chunk's row tiles) the whole K a program, the
# activations streamed through the ring beside the weights (:mod:`.moe_qgmma_stream`: at least 2 stages,
# qgmma_warps warps a program, qgmma_inflight of a trip's four MMAs in flight at once (1 or 2), each thread
# held to qgmma_maxnreg registers where set (None: as the compiler allocates); no shared expert in the launches;
# qgmma_bf16: those streamed launches on the bf16 warpgroup MMA instead, the weights decoded with their scales and
# the activations their round trips' values, nothing scaled after the MMA, :mod:`.experts_bf16_stream`; with
# qgmma_tokens2 (16 or 32; 0: none) row tiles of qgmma_tokens + qgmma_tokens2 rows, the second part on a
# narrower MMA over the same decoded weights, run only where the tile holds rows past the first part;
# qgmma_min_k: those streamed launches only where both GEMMs' K (D and I) are at least this, else the rule's
# MMA tile: on a short K the ring's fill and each program's epilogue are most of a program)
KNOBS = dict(min_block_n=None, split_min_blocks=None, split_per_sm=None, split_k=None, swap_operands=None,
             gemv_mma=False, gemv_mma_tokens=8, gemv_mma_per_sm=4, gemv_mma_stages=3, gemv_mma_sub=4,
             qgmma=False, qgmma_tokens=8, qgmma_per_sm=16, qgmma_max_k=1024, qgmma_stages=4, qgmma_warps=8,
             qgmma_inflight=2, qgmma_maxnreg=None, qgmma_bf16=False, qgmma_tokens2=0,
             qgmma_min_k=0)

TILES = {
    # (largest mean rows per expert the rule serves or None, tile): the first matching rule applies
    "experts": (
        (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, **KNOBS)),  # decode: weight-bound
        (None, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    ),
    "combine": dict(BLOCK_D=1024, num_warps=4, in_kernel=True),  # in_kernel: the down kernel's last program sums
    # the grouped path's SwiGLU + fp8 round trip: BLOCK_R rows x BLOCK_C columns (a multiple of 32) a program
    "swiglu": dict(BLOCK_R=16, BLOCK_C=128, num_warps=4),
    "route": moe_tables.ROUTE,  # the routing tables: one program up to max_pairs (token, slot) pairs
    "fused_max_tokens": 64,  # up to this many tokens the up kernel quantizes x itself (no act_quant launch)
    # the activations (x, then h) handed to the up and down kernels as the values of their fp8 round
    # trip in bf16 (x by one launch, h by the up kernel's epilogue), not as fp8 bytes each program
    # quantizes or decodes again; fp8_w weights then take the dequantizing MMA (no raw E4M3 operands)
    "act_dequantized": False,
    "round_trip": dict(BLOCK_R=16, BLOCK_C=128, num_warps=4),  # x's launch for act_dequantized
    "direct": True,  # one expert, one slot (the shared expert): no routing tables, no combine launch
    # the shared expert's rows in the routed experts' launches (True), or in launches of its own whose
    # output the routed launches add (False: two launches more, no shared-weight path in the routed
    # kernels, whose registers it raises)
    "shared_in_launch": True,
    "pair_tiles": 1,  # up to this many tokens: a row tile per (token, slot) pair, no routing tables launch
    # from this many pair rows per expert (mean), bf16 x: exact bf16 operands and two grouped GEMMs
    # (moe_grouped.py); None: never (the default)
    "grouped_min_rows": None,
    # the grouped path only while its bf16 weight stacks (made per call) take at most this many bytes
    "grouped_max_bytes": 1 << 30,
}


PLANS = PlanCache("moe", TILES)  # the active tiles (and launch plans made with them)
_tiles = PLANS.tiles


def _direct_tables(weights: torch.Tensor, block_m: int) -> dict:
    """What the kernels read of the tables in ``DIRECT`` mode: the [N] routing weights (fp32) and
    the number of row tiles (the other entries are never read: the weights stand in)."""
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    return dict(tok=rw, rw=rw, tile_e=rw, tile_row=rw, row_end=rw, pos=rw, tiles=cdiv(rw.shape[0], block_m))


def _pair_tables(weights: torch.Tensor, indices: torch.Tensor) -> dict:
    """What the kernels read in ``PAIRS`` mode (a row tile per (token, slot) pair, in pair order):
    each pair's routing weight and expert; the other entries are never read."""
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    e = indices.reshape(-1).to(torch.int32).contiguous()
    return dict(tok=e, rw=rw, tile_e=e, tile_row=e, row_end=e, pos=e, tiles=e.shape[0])


def _gemm(t: dict, knobs: dict, cols: int, k: int, row_tiles: int, rows: int, width: int, reserved: int = 0):
    """(kernel tile, K splits, K per split) of one expert GEMM launch: ``cols`` output columns over
    ``k``, ``row_tiles`` row tiles of ``rows`` pair rows, ``width`` fp32 partials per row and
    column, ``reserved`` ticket counters the launch uses besides the split's."""
    sms = _linear.num_sms()
    t = dict(t, BLOCK_N=splitk.narrow_block_n(t["BLOCK_N"], cols, row_tiles, sms, knobs["min_block_n"]))
    tiles = row_tiles * cdiv(cols, t["BLOCK_N"])
    split, k_split = splitk.splits(tiles, k, t["BLOCK_K"], sms, knobs["split_k"], knobs["split_min_blocks"],
                                   knobs["split_per_sm"])
    if split > 1 and (not splitk.fits(reserved + tiles) or split * width * rows * cols >= 2 ** 31):
        return t, 1, k
    return t, split, k_split


def _plan(n: int, k: int, E: int, D: int, I: int, shared: bool = False) -> dict:
    """The up and down launches (tile, splits, K per split), whether the down kernel combines, the
    row tiles (``direct``: every token's one slot is expert 0; ``pairs``: a tile per pair, no
    routing tables; else the tables'), the shared expert's tiles after them, the fused activation
    quantization, the routing tiles and the fp4 decode (``e2m1``: the kernels' E2M1 for fp4_w
    loops, ``linear.fp4_decode``), for n tokens of k slots over E experts, under the active tiles."""
    key = ("experts", n, k, E, D, I, shared)
    tiles, plan = PLANS.lookup(key)
    if plan is not None:
        return plan
    direct = E == 1 and k == 1 and tiles["direct"] and not shared
    pairs_mode = not direct and n <= tiles["pair_tiles"]
    # the rows a tile serves: one in pairs mode, else the mean rows per expert
    t, knobs = split_tile(pick_tile(tiles["experts"], 1 if pairs_mode else n * k / E), KNOBS)
    pairs = n * k
    routed = cdiv(n, t["BLOCK_M"]) if direct else pairs if pairs_mode else min(pairs, cdiv(pairs, t["BLOCK_M"]) + E)
    row_tiles, rows = routed + (cdiv(n, t["BLOCK_M"]) if shared else 0), pairs + (n if shared else 0)
    down = _gemm(t, knobs, D, I, row_tiles, rows, 1)
    cols = n * cdiv(D, down[0]["BLOCK_N"])  # the combine's counters: one per (token, column tile)
    combine = not direct and tiles["combine"]["in_kernel"] and splitk.fits(cols)
    if combine and down[1] > 1:
        down = _gemm(t, knobs, D, I, row_tiles, rows, 1, reserved=cols)
    e2m1 = fp4_decode(knobs["swap_operands"])  # the rule's swap knob over linear's tile
    mma, mma_shared = _mma_plan(n, k, E, D, I, direct, pairs_mode, t, knobs, tiles, shared)
    qgmma, qgmma_shared = _qgmma_plan(n, k, E, D, I, direct, pairs_mode, knobs, tiles, shared)
    return PLANS.store(key, dict(mma=mma, mma_shared=mma_shared, qgmma=qgmma, qgmma_shared=qgmma_shared,
                                 block_m=t["BLOCK_M"],
                                 up=_gemm(t, knobs, I, D, row_tiles, rows, 2), down=down,
                                 combine=combine, reserved=cols if combine else 0, direct=direct, pairs=pairs_mode,
                                 shared=shared, qx=n <= tiles["fused_max_tokens"], route=tiles["route"],
                                 adq=bool(tiles["act_dequantized"]), round_trip=tiles["round_trip"],
                                 e2m1=e2m1, fold=may_fold(e2m1),
                                 swap=knobs["swap_operands"],
                                 combine_tile=tiles["combine"]))


def _mma_plan(n: int, k: int, E: int, D: int, I: int, direct: bool, pairs: bool, t: dict, knobs: dict, tiles: dict,
              shared: bool = False) -> tuple[dict | None, dict | None]:
    """:mod:`.moe_mma`'s plans of the routed experts where the rule's ``gemv_mma`` knob takes them and they
    can run there (the activations dequantized, a compiled sm_80+ target whose Triton builds the
    kernels; not the direct path, whose one expert is the shared one), else None: (the routed rows alone;
    with the shared expert's tiles after them where ``shared`` and the tile takes them, else None). The
    weights' part (:func:`_mma_weights`, :func:`.moe_mma.shared_operands`) is checked per call."""
    if not (knobs["gemv_mma"] and not direct and tiles["act_dequantized"] and _linear.mma_sync_device()
            and moe_mma.usable()):
        return None, None
    tile = dict(num_warps=t["num_warps"], TOKENS=knobs["gemv_mma_tokens"], STAGES=knobs["gemv_mma_stages"],
                SUB=knobs["gemv_mma_sub"], per_sm=knobs["gemv_mma_per_sm"])
    sms = _linear.num_sms()
    with_shared = moe_mma.plan(n, k, E, D, I, pairs, tile, sms, True) if shared and moe_mma.takes_shared(tile) else None
    return moe_mma.plan(n, k, E, D, I, pairs, tile, sms), with_shared


def _qgmma_plan(n: int, k: int, E: int, D: int, I: int, direct: bool, pairs: bool, knobs: dict, tiles: dict,
                shared: bool = False) -> tuple[dict | None, dict | None]:
    """:mod:`.moe_qgmma`'s plans of the routed experts where the rule's ``qgmma`` knob takes them and they can
    run there (the activations dequantized, a compiled sm_90 target with Gluon; not the direct path), else
    None: (the routed rows alone; with the shared expert's tiles after them where ``shared``, else None). The
    weights' part (:func:`.moe_qgmma.supports`, :func:`.moe_mma.shared_operands`) is checked per call."""
    if not (knobs["qgmma"] and not direct and tiles["act_dequantized"] and moe_qgmma.AVAILABLE
            and not _linear.INTERPRETED and jit_targets.capability() >= (9, 0)):
        return None, None
    tile = dict(TOKENS=knobs["qgmma_tokens"], STAGES=knobs["qgmma_stages"], per_sm=knobs["qgmma_per_sm"],
                max_k=knobs["qgmma_max_k"], num_warps=knobs["qgmma_warps"], INFLIGHT=knobs["qgmma_inflight"],
                maxnreg=knobs["qgmma_maxnreg"], BF16=knobs["qgmma_bf16"], TOKENS2=knobs["qgmma_tokens2"],
                min_k=knobs["qgmma_min_k"])
    if tile["TOKENS"] in moe_qgmma_stream.TOKENS:
        return moe_qgmma_stream.plan(n, k, E, D, I, pairs, tile), None
    sms = _linear.num_sms()
    with_shared = moe_qgmma.plan(n, k, E, D, I, pairs, tile, sms, True) if shared else None
    return moe_qgmma.plan(n, k, E, D, I, pairs, tile, sms), with_shared


def qgmma_rows(rule: dict) -> int:
    """The routing tables' row tile height under an experts rule that takes ``qgmma``: its row tile's pair
    rows, with the bf16 loop's second part where the rule sets one."""
    knobs = {**KNOBS, **rule}
    return knobs["qgmma_tokens"] + (knobs["qgmma_tokens2"] if knobs["qgmma_bf16"] else 0)


def _mma_weights(w1, w3, w2) -> bool:
    """Whether :mod:`.moe_mma`'s kernels read these routed experts: fp4_w in E2M1 words, scale bytes
    recorded at most :data:`.linear.FOLD_MAX_SCALE` (the decode folds its re-bias into them), the data
    16-byte aligned (whole 16-byte copies)."""
    return (all(w.fmt == "fp4_w" and w.e2m1_words and w.data.data_ptr() % 16 == 0 for w in (w1, w3, w2))
            and scales_at_most((w1, w3, w2), "fp4_w", FOLD_MAX_SCALE))


def _grid(tab, t, cols: int, split: int, n: int, plan: dict):
    """(column tiles, routed row tiles plus the shared expert's, K splits)."""
    return cdiv(cols, t["BLOCK_N"]), tab["tiles"] + (cdiv(n, plan["block_m"]) if plan["shared"] else 0), split


def _e2m1(plan: dict, *weights) -> int:
    """The E2M1 constexpr of a launch over ``weights``: the plan's, folded where it may fold and the
    weights allow (:func:`.linear.fold_scales`, :func:`.linear.fold_fp8`), for their fp4 code layout
    (:func:`.linear.with_words`)."""
    e2m1 = fold_scales(plan["e2m1"], *weights) if plan["fold"] else plan["e2m1"]
    return with_words(fold_fp8(e2m1, *weights), *weights)


def _shared_operands(shared, w_routed, plan):
    """(data and scale of each shared weight, FP4_S, PROMOTE_S, DOT_S); the routed weight's stand-ins
    when there is no shared expert (never read)."""
    ws = shared if shared is not None else (w_routed,) * 3
    ops = [weight_operands(w) for w in ws]
    d, s = ops[0]
    assert all(o[0].stride()[-2:] == d.stride()[-2:] and o[1].stride()[-2:] == s.stride()[-2:] for o in ops[:2]), \
        "shared w1 and w3 must share a layout"
    promote, dot = mma_mode(ws[0].fmt, not plan["adq"])
    return ops, ws[0].fmt == "fp4_w", promote, dot


def _dq(plan: dict, **constexprs) -> dict:
    """The kernels' trailing act_dequantized constexprs, passed only when on (the launches' variants
    are otherwise those of the plain path)."""
    return constexprs if plan["adq"] else {}


def _experts_up(xq, sx, tab, w1, w3, I, limit, xdtype, plan, n, k, shared=None):
    (d1, s1), (d3, s3) = weight_operands(w1), weight_operands(w3)
    assert d1.stride() == d3.stride() and s1.stride() == s3.stride(), "w1 and w3 must share a layout"
    (o1, o3, _), fp4_s, promote_s, dot_s = _shared_operands(shared, w1, plan)
    rows, D = n * k + (n if plan["shared"] else 0), xq.shape[1]
    t, split, k_split = plan["up"]
    if plan["adq"]:  # h's dequantized values
        hq = sh = torch.empty(rows, I, dtype=torch.bfloat16, device=xq.device)
    else:
        hq = torch.empty(rows, I, dtype=torch.uint8, device=xq.device)  # E4M3 bytes
        sh = torch.empty(rows, I // 32, dtype=torch.uint8, device=xq.device)  # UE8M0 bytes
    ws = torch.empty(split, 2, rows, I, dtype=torch.float32, device=xq.device) if split > 1 else hq
    cnt = splitk.counters(xq.device) if split > 1 else hq
    promote, dot = mma_mode(w1.fmt, not plan["adq"])
    _moe_up_kernel[_grid(tab, t, I, split, n, plan)](
        xq, sx, tab["tok"], tab["rw"], d1, s1, d3, s3, hq, sh, tab["tile_e"], tab["tile_row"], tab["row_end"],
        w1.shape[0], I, D, limit, rows, xq.stride(0), sx.stride(0), d1.stride(0), d1.stride(1), s1.stride(0),
        s1.stride(1), hq.stride(0), sh.stride(0), ws, cnt, k_split, split,
        o1[0], o1[1], o3[0], o3[1], o1[0].stride(-2), o1[1].stride(-2), tab["tiles"], n * k, k,
        FP4=w1.fmt == "fp4_w", PROMOTE=promote, DOT=dot, CLAMP=limit > 0, XDT=TL_DTYPES[xdtype],
        QX=ACT_DEQUANTIZED if plan["adq"] else plan["qx"],
        DIRECT=plan["direct"], SPLIT=split > 1, PAIRS=plan["pairs"], SHARED=plan["shared"], FP4_S=fp4_s,
        PROMOTE_S=promote_s, DOT_S=dot_s,
        E2M1=_e2m1(plan, w1, w3, *(shared or ())[:2]) if w1.fmt == "fp4_w" or fp4_s
        else fold_fp8(fp8_decode(promote, plan["swap"]), w1, w3, *(shared or ())[:2]),
        SCALE_K=s1.stride(2), SCALE_K_S=o1[1].stride(-1), **_dq(plan, HDQ=True), **t,
        **pdl.options(xq.device))
    return hq, sh


def _experts_down(hq, sh, tab, w2, D, xdtype, plan, n, k, shared=None, combine=None, add=None):
    """The pair rows [pairs (+ n shared), D] in x.dtype (``direct``: the op's fp32 output, pair =
    token). ``combine``: out [N, D]: the kernel also sums each token's rows, plus ``add`` (fp32
    [N, D] or None), into ``out`` (in out's dtype)."""
    d2, s2 = weight_operands(w2)
    (_, _, o2), fp4_s, promote_s, dot_s = _shared_operands(shared, w2, plan)
    t, split, k_split = plan["down"]
    direct = plan["direct"]
    y = torch.empty(hq.shape[0], D, dtype=torch.float32 if direct else xdtype, device=hq.device)
    ws = torch.empty(split, hq.shape[0], D, dtype=torch.float32, device=hq.device) if split > 1 else y
    promote, dot = mma_mode(w2.fmt, not plan["adq"])
    out = combine if combine is not None else y
    pool = splitk.counters(hq.device) if combine is not None or split > 1 else y
    split_cnt = pool[plan["reserved"]:] if split > 1 else y  # past the combine's counters
    _moe_down_kernel[_grid(tab, t, D, split, n, plan)](
        hq, sh, d2, s2, y, tab["tile_e"], tab["tile_row"], tab["row_end"], w2.shape[0], D, hq.shape[1], hq.shape[0],
        hq.stride(0), sh.stride(0), d2.stride(0), d2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        tab["tok"], tab["pos"], out, pool, k, out.stride(0), add if add is not None else out,
        add.stride(0) if add is not None else 0, ws, split_cnt, k_split, split,
        o2[0], o2[1], o2[0].stride(-2), o2[1].stride(-2), tab["tiles"], n * k,
        FP4=w2.fmt == "fp4_w", PROMOTE=promote, DOT=dot, XDT=TL_DTYPES[xdtype], DIRECT=direct,
        COMBINE=combine is not None, HAS_ADD=add is not None, SPLIT=split > 1, PAIRS=plan["pairs"],
        SHARED=plan["shared"], FP4_S=fp4_s, PROMOTE_S=promote_s, DOT_S=dot_s,
        E2M1=_e2m1(plan, w2, *(shared or ())[2:]) if w2.fmt == "fp4_w" or fp4_s
        else fold_fp8(fp8_decode(promote, plan["swap"]), w2, *(shared or ())[2:]),
        SCALE_K=s2.stride(2), SCALE_K_S=o2[1].stride(-1), **_dq(plan, QX=ACT_DEQUANTIZED), **t,
        **pdl.options(hq.device))
    return y


def _grouped(x, pairs: int, E: int, D: int, I: int, shared) -> bool:
    """Whether ``pairs`` routed rows over E experts take the bf16 grouped GEMMs (:mod:`.moe_grouped`)."""
    tiles = _tiles()
    big = tiles["grouped_min_rows"]
    return (big is not None and pairs >= big * E and moe_grouped.available(x)
            and moe_grouped.stack_bytes(E, I, D, shared is not None) <= tiles["grouped_max_bytes"])


def _routed_path(plan: dict, w1, w3, w2) -> str:
    """The routed experts' launches under ``plan`` for these weights: ``qgmma`` (the weights in registers,
    K split), ``qgmma_stream`` (a prefill chunk's, the activations streamed), ``gemv_mma`` or ``tile``."""
    if plan["qgmma"] is not None and moe_qgmma.supports(w1, w3, w2, w1.shape[2], w1.shape[1]):
        return "qgmma_stream" if plan["qgmma"].get("stream", False) else "qgmma"
    return "gemv_mma" if plan["mma"] is not None and _mma_weights(w1, w3, w2) else "tile"


def launch_path(x, weights, indices, w1, w3, w2, swiglu_limit, add=None, out_dtype=torch.float32, shared=None) -> str:
    """The launches :func:`moe_experts` takes for these arguments under the active tiles: ``grouped``, or the
    routed experts' (:func:`_routed_path`); which of an experts rule's knobs the call reads (``flashrt tune``
    sweeps those): the routed experts' where a shared expert runs in launches of its own."""
    (n, D), k, (E, I) = x.shape, indices.shape[1], w1.shape[:2]
    if n * k == 0 or D == 0 or I == 0:
        return "none"
    if shared is not None and not _quantized_up_pair(*shared):
        shared = None  # joined as ``add`` (:func:`_with_plain_shared`)
    if _grouped(x, n * k, E, D, I, shared):
        return "grouped"
    in_launch = shared is not None and _tiles()["shared_in_launch"]
    return _routed_path(_plan(n, k, E, D, I, in_launch), w1, w3, w2)


def moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit, add=None, out_dtype=torch.float32, shared=None):
    """x [N, D], weights [N, k] fp32, indices [N, k] int32, w1/w3 [E, I, D], w2 [E, D, I] QTensor,
    add fp32 [N, D] or None, shared (w1, w3, w2) of one expert or None -> [N, D] in out_dtype (the
    sum, the shared expert's row, plus add, cast: in the combine)."""
    assert _quantized_up_pair(w1, w3, w2), (w1, w3, w2)  # dispatch checked the rest of FAMILY's support
    if shared is not None and not _quantized_up_pair(*shared):
        return _with_plain_shared(x, weights, indices, w1, w3, w2, swiglu_limit, add, out_dtype, shared)
    n, D = x.shape
    k = indices.shape[1]
    E, I = w1.shape[0], w1.shape[1]
    if n * k == 0 or D == 0 or I == 0:
        return finish_experts(torch.zeros(n, D, dtype=torch.float32, device=x.device), add, out_dtype)
    tiles = _tiles()
    if _grouped(x, n * k, E, D, I, shared):
        return moe_grouped.experts(x, weights, indices, w1, w3, w2, float(swiglu_limit), add, out_dtype, shared,
                                   tiles["combine"], tiles["swiglu"])
    if shared is not None and not tiles["shared_in_launch"]:
        return _shared_apart(x, weights, indices, w1, w3, w2, swiglu_limit, add, out_dtype, shared)
    plan = _plan(n, k, E, D, I, shared is not None)
    path = _routed_path(plan, w1, w3, w2)
    if path in ("qgmma", "qgmma_stream"):
        return _experts_qgmma(x, weights, indices, w1, w3, w2, float(swiglu_limit), add, out_dtype, shared, plan)
    if path == "gemv_mma":
        return _experts_mma(x, weights, indices, w1, w3, w2, float(swiglu_limit), add, out_dtype, shared, plan)
    if plan["adq"]:
        xq = sx = fp8_round_trip(x, plan["round_trip"])
    else:
        xq, sx = (last_dense(x),) * 2 if plan["qx"] else act_quant(x)
    limit = float(swiglu_limit)
    if plan["direct"]:  # every token's one slot is expert 0
        tab = _direct_tables(weights, plan["block_m"])
        hq, sh = _experts_up(xq, sx, tab, w1, w3, I, limit, x.dtype, plan, n, k)
        return finish_experts(_experts_down(hq, sh, tab, w2, D, x.dtype, plan, n, k), add, out_dtype)
    if plan["pairs"]:
        tab = _pair_tables(weights, indices)
    else:
        tab = dict(moe_tables.route_tables(indices, weights, E, plan["block_m"], plan["route"]))
        tab["tiles"] = tab["tile_e"].shape[0]
    hq, sh = _experts_up(xq, sx, tab, w1, w3, I, limit, x.dtype, plan, n, k, shared)
    out = torch.empty(n, D, dtype=out_dtype, device=x.device)  # every row is written: k >= 1
    add = add.contiguous() if add is not None else None
    if plan["combine"]:
        _experts_down(hq, sh, tab, w2, D, x.dtype, plan, n, k, shared, combine=out, add=add)
        return out
    y = _experts_down(hq, sh, tab, w2, D, x.dtype, plan, n, k, shared)
    return _combine(y, tab, out, add, k, plan["pairs"], plan["shared"], plan["combine_tile"])


def _combine(y, tab, out, add, k: int, pairs: bool, shared: bool, c: dict) -> torch.Tensor:
    """``out`` [N, D]: each token's k pair rows of ``y`` summed in slot order (then its shared row where
    ``shared``), plus its ``add`` row (fp32 or None): one launch of the combine kernel, tile ``c``."""
    n, D = out.shape
    _moe_combine_kernel[(n, cdiv(D, c["BLOCK_D"]))](
        y, tab["pos"], out, add if add is not None else out, D, k, y.stride(0), out.stride(0),
        add.stride(0) if add is not None else 0, n * k, BLOCK_D=c["BLOCK_D"], HAS_ADD=add is not None,
        PAIRS=pairs, SHARED=shared, num_warps=c["num_warps"], **pdl.options(y.device))
    return out


def _experts_mma(x, weights, indices, w1, w3, w2, limit: float, add, out_dtype, shared, plan):
    """The routed experts on :mod:`.moe_mma`'s kernels (plan ``plan["mma"]``) over x's fp8 round trip's
    values; the shared expert as :func:`_gluon_experts` places it."""
    xq = fp8_round_trip(x, plan["round_trip"])
    run = lambda *a, **kw: moe_mma.experts(xq, *a, **kw)  # noqa: E731
    return _gluon_experts(run, "mma", x, weights, indices, w1, w3, w2, limit, add, out_dtype, shared, plan,
                          lambda: xq)


def _experts_qgmma(x, weights, indices, w1, w3, w2, limit: float, add, out_dtype, shared, plan):
    """The routed experts on :mod:`.moe_qgmma`'s kernels (plan ``plan["qgmma"]``) over x's fp8 round trip
    as codes and scales; the shared expert as :func:`_gluon_experts` places it."""
    stream = plan["qgmma"].get("stream", False)
    if stream and plan["qgmma"]["bf16"]:  # the round trip's values in the bf16 loop's order
        xq, xs = fp8_round_trip(x, plan["round_trip"], stream_order=True), None
    else:
        xq, xs = fp8_codes(x, plan["round_trip"], experts_qgmma.DECODE_SCALE, mma_order=stream)
    launches = moe_qgmma_stream if stream else moe_qgmma
    run = lambda *a, **kw: launches.experts(xq, xs, *a, **kw)  # noqa: E731
    return _gluon_experts(run, "qgmma", x, weights, indices, w1, w3, w2, limit, add, out_dtype, shared, plan,
                          lambda: fp8_round_trip(x, plan["round_trip"]))


def _gluon_experts(run, key: str, x, weights, indices, w1, w3, w2, limit: float, add, out_dtype, shared, plan,
                   values):
    """The routed experts through a Gluon path's two launches (``run(tab, w1, w3, w2, limit, xdtype, p, n, k,
    out=, add=, shared=)``, its plans ``plan[key]`` and ``plan[key + "_shared"]``; the down launch sums each
    token's rows where :func:`.moe_mma.combines` says its counters fit). The shared expert: its rows in the
    same launches where its weights allow (fp8_w, :func:`.moe_mma.shared_operands`), summed after each
    token's routed rows; else on the direct path's kernels over x's round trip's values (``values()``), its
    fp32 rows (plus ``add``) added by the combine after the routed sum, as :func:`_shared_apart` orders
    them."""
    n, D = x.shape
    k = indices.shape[1]
    p, own = plan[key], None
    if shared is not None and plan[key + "_shared"] is not None:
        own = moe_mma.shared_operands(shared, w1.shape[1], D)
    if own is not None:
        p = plan[key + "_shared"]
    elif shared is not None:
        alone = _shared_direct(x, values(), shared, limit)
        add = alone if add is None else finish_experts(alone, add, torch.float32)
    if p["pairs"]:
        tab = _pair_tables(weights, indices)
    else:
        tab = dict(moe_tables.route_tables(indices, weights, w1.shape[0], p["block_m"], plan["route"]))
    out = torch.empty(n, D, dtype=out_dtype, device=x.device)
    add = add.contiguous() if add is not None else None
    if plan["combine_tile"]["in_kernel"] and moe_mma.combines(p, n):
        return run(tab, w1, w3, w2, limit, x.dtype, p, n, k, out=out, add=add, shared=own)
    y = run(tab, w1, w3, w2, limit, x.dtype, p, n, k, shared=own)
    return _combine(y, tab, out, add, k, p["pairs"], p["shared"], plan["combine_tile"])


def _shared_direct(x, xq, shared, limit: float) -> torch.Tensor:
    """fp32 [N, D]: the shared expert (one expert, one slot a token: the direct path's two launches) over
    ``xq``, the dequantized values of the activations ``x`` (the whole op on ``x`` where the profile turns
    the direct path off)."""
    w1, w3, w2 = shared
    n, D = xq.shape
    plan = _plan(n, 1, 1, D, w1.shape[1])
    if not plan["direct"]:
        return moe_experts(x, *_shared_routes(x), *shared, limit)
    tab = _direct_tables(torch.ones(n, dtype=torch.float32, device=xq.device), plan["block_m"])
    hq, sh = _experts_up(xq, xq, tab, w1, w3, w1.shape[1], limit, x.dtype, plan, n, 1)
    return _experts_down(hq, sh, tab, w2, D, x.dtype, plan, n, 1)


def _shared_routes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert's routes for the tokens of ``x``: weight 1.0 (fp32 [N, 1]), expert 0 (int32 [N, 1])."""
    n = x.shape[0]
    return (torch.ones(n, 1, dtype=torch.float32, device=x.device),
            torch.zeros(n, 1, dtype=torch.int32, device=x.device))


def _with_plain_shared(x, weights, indices, w1, w3, w2, swiglu_limit, add, out_dtype, shared):
    """A shared expert the kernels do not decode (plain weights, or w1 and w3 in two formats): its
    fp32 output by the reference math on this device, joined as the combine's ``add`` (the
    op's order: the routed sum, the shared row, then ``add``)."""
    alone = experts_loop(x, *_shared_routes(x), *shared, swiglu_limit)
    if add is None:
        return moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit, alone, out_dtype)
    return finish_experts(moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit, alone), add, out_dtype)


def _shared_apart(x, weights, indices, w1, w3, w2, swiglu_limit, add, out_dtype, shared):
    """``tiles.moe.shared_in_launch`` False: the shared expert in its own launches (one expert, one
    slot: the direct path), its fp32 rows (plus ``add``) added by the routed launches' combine. The
    same sum in the same order as one launch when ``add`` is None (routed rows, then the shared row)."""
    own = moe_experts(x, *_shared_routes(x), *shared, swiglu_limit, add=add, out_dtype=torch.float32)
    return moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit, add=own, out_dtype=out_dtype)


def _quantized_up_pair(w1, w3, w2) -> bool:
    """What the launcher's code relies on of the weights (a cheap guard on every call; dispatch
    checks FAMILY's whole support declaration once per call key): all quantized in WEIGHT_FORMATS,
    w1 and w3 in one format."""
    return all(isinstance(w, QTensor) and w.fmt in WEIGHT_FORMATS for w in (w1, w3, w2)) and w1.fmt == w3.fmt


def same_up_format(x, weights, indices, w1, w3, w2, swiglu_limit, add=None, out_dtype=None, shared=None) -> bool:
    """w1 and w3 in one format (the up kernel reads both with one decoder)."""
    return w1.fmt == w3.fmt


FAMILY = KernelFamily(
    "moe", ops={"moe_experts": moe_experts},
    # all three weights quantized (fp4_w / fp8_w), w1 and w3 in one format; plain weights declined (a
    # plain shared expert is served: _with_plain_shared)
    supports={"moe_experts": Support(inputs={"x": FLOATS, "w1": WEIGHT_FORMATS, "w3": WEIGHT_FORMATS,
                                             "w2": WEIGHT_FORMATS, "shared": (*WEIGHT_FORMATS, *FLOATS)},
                                     dims={"w1[1]": Dim(0, None, 32)},
                                     extra=same_up_format)},
    paths={"moe_experts": launch_path},
    tiles=TILES, tile_checks={"experts.BLOCK_M": GEMM_ROWS, "experts.BLOCK_N": SCALED, "experts.BLOCK_K": SCALED,
                              "experts.min_block_n": Tile(low=32, pow2=True, nullable=True, kind=int),
                              "experts.split_min_blocks": Tile(nullable=True, kind=int),
                              "experts.split_per_sm": Tile(low=1, nullable=True, kind=int),
                              "experts.split_k": Tile(nullable=True, kind=int),
                              "experts.swap_operands": Tile(nullable=True, kind=bool),
                              "experts.gemv_mma": Tile(kind=bool), "experts.gemv_mma_tokens": Tile(choices=(8, 16)),
                              "experts.gemv_mma_per_sm": Tile(low=1, kind=int),
                              "experts.gemv_mma_stages": Tile(low=2, kind=int),
                              "experts.gemv_mma_sub": Tile(choices=(1, 2, 4)),
                              "experts.qgmma": Tile(kind=bool),
                              "experts.qgmma_tokens": Tile(choices=(8, 16, *moe_qgmma_stream.TOKENS)),
                              "experts.qgmma_warps": Tile(choices=(4, 8)),
                              "experts.qgmma_inflight": Tile(choices=(1, 2)),
                              "experts.qgmma_maxnreg": Tile(low=24, high=256, multiple=8, nullable=True, kind=int),
                              "experts.qgmma_bf16": Tile(kind=bool),
                              "experts.qgmma_tokens2": Tile(choices=(0, *moe_qgmma_stream.TOKENS2)),
                              "experts.qgmma_min_k": Tile(low=0, kind=int),
                              "experts.qgmma_per_sm": Tile(low=1, kind=int),
                              "experts.qgmma_max_k": Tile(choices=(256, 512, 1024, 2048)),
                              "experts.qgmma_stages": Tile(choices=(0, 2, 3, 4, 5, 6)),
                              "combine.BLOCK_D": POW2, "swiglu.BLOCK_R": POW2, "round_trip.BLOCK_R": POW2,
                              "round_trip.BLOCK_C": Tile(low=32, pow2=True, kind=int),
                              "act_dequantized": Tile(kind=bool),
                              "swiglu.BLOCK_C": Tile(low=32, pow2=True, kind=int), "fused_max_tokens": COUNT0, "direct": Tile(kind=bool),
                              "pair_tiles": Tile(low=0, kind=int), "grouped_min_rows": Tile(nullable=True, kind=int),
                              "grouped_max_bytes": Tile(low=0, kind=int),
                              "combine.in_kernel": Tile(kind=bool), "route.large": Tile(kind=bool),
                              "shared_in_launch": Tile(kind=bool)},
    smem={"experts": gemm_smem}, warmup=_warmup.hook(moe_warmup.warmup_cases),
    warmup_cases=moe_warmup.warmup_cases,
    description="routed SwiGLU experts: grouped FP8 / FP4 GEMMs over routing tables")
