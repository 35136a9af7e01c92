"""``linear`` with a block-scaled weight (``fp8_w`` / ``fp4_w``): fp8 activations, fp32 accumulation
(plain bf16 / fp16 weights: :mod:`.linear_plain`).

``x`` is quantized to fp8 per 32 (E4M3 bytes, UE8M0 scale bytes: the ``fp8`` format, by quant.py's
kernel at this module's ``act_quant`` tiles); ``_linear_kernel`` (:mod:`.linear_kernel`) then
computes ``dequant(xq) @ dequant(w).T`` tile by tile. Two ways to run the MMA (constexpr ``PROMOTE``):

- promote (``fp8_w`` on sm_89 / sm_90): ``tl.dot`` on the raw E4M3 operands one 32-wide K slice at a
  time; each slice's product is scaled by ``sx[row] * sw[col]`` and added to the fp32 accumulator;
- dequant (``fp4_w`` everywhere, ``fp8_w`` on sm_80): both operands are dequantized in registers
  (exact in bf16: E4M3 / E2M1 times a power of two) and one bf16 ``tl.dot`` per K block accumulates.
  The ``fp4_decode`` tile picks how E2M1 codes are decoded: code by code ("bits"), by
  ``tl.dot_scaled`` on the packed bytes and UE8M0 scales ("dot_scaled": Triton decodes them), or two
  codes a byte in packed registers ("packed", sm_90+; "packed_prefetch": with the scale bytes loaded a
  K block ahead); the same values each way. The ``fp4_halves`` tile reorders K within each 8 so
  the packed decode's registers are the MMA's operand as they come (``linear_kernel._halves``).

Row tiles under 16 (a profile's decode rule) take neither: a multiply-add K loop over fp32 operands
(``linear_kernel._fma_k_loop``).

E4M3 weights reach the kernels as float8e4nv on sm_89+ and as uint8 below (Triton rejects the fp8
type there), activations as uint8; the kernels bitcast in registers. Under the Triton interpreter
the dot operands are fp32 (constexpr ``DOT``) and fp32 -> bf16 rounding is done by hand (the
interpreter truncates). Few output tiles (decode) split K over programs and sum fp32 partials.
Tiles, grid, split and constexprs are planned once per (rows, weight shape, dtypes) and active
profile (:mod:`.launch`). ``moe.py`` reuses ``act_quant``, ``mma_mode``, ``pick_tile`` and the
operand helpers.
"""
from __future__ import annotations

import torch
import triton.language as tl

from flashrt import jit_targets, profiles
from flashrt.families import KernelFamily, Support
from flashrt.tile_checks import COUNT0, GEMM_ROWS, POW2, Tile, gemm_smem
from flashrt.formats import QTensor
from flashrt.kernels_cuda import quant, splitk
from flashrt.kernels_cuda.codecs import INTERPRETED, ptx_sm90
from flashrt.kernels_cuda.codecs_e4m3 import FOLD_MAX_SCALE as FP8_FOLD_MAX_SCALE
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.launch import TL_DTYPES, PlanCache, cdiv, last_dense, zeros_stored
from flashrt.kernels_cuda import gemv, gemv_mma, linear_qgmma
from flashrt.kernels_cuda.gemv import _gemv_kernel
from flashrt.kernels_cuda.linear_kernel import _linear_kernel
from flashrt.kernels_cuda.linear_plain import WEIGHT_DTYPES, plain_linear, supports_plain_linear
from flashrt.kernels_cuda.round_trip import fp8_codes, fp8_round_trip
from flashrt.kernels_cuda import pdl

WEIGHT_FORMATS = ("fp8_w", "fp4_w")
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

# A rule's launch knobs (not kernel parameters; a rule without them gets these values): min_block_n
# halves BLOCK_N, down to it, while the output tiles at the halved width still fit in the SMs (None:
# BLOCK_N as given; splitk.narrow_block_n); split_min_blocks: the fewest K blocks a split keeps when
# K is split because the output tiles do not fill the SMs (None: no split; splitk.splits);
# split_per_sm: split K to the count that brings the programs nearest to this many an SM, also
# where the output tiles fill the SMs once (more programs in flight an SM; None: the rule above);
# split_reduce: a split K summed by each output tile's last program (True), or by a sum and a cast
# launch after the GEMM (False); None: in the kernel where it quantizes x itself (fused_max_rows);
# fp8_mma: the rule's own choice of the fp8 MMA for fp8_w (True / False; None: the fp8_mma tile's);
# gemv: fp8_w launches of the rule's rows as a GEMV (:mod:`.gemv`: gemv_rows rows and BLOCK_N weight rows a
# program, multiply-adds on the CUDA cores, BLOCK_M unused; fp4_w launches keep the rule's MMA tile);
# gemv_round_trip: the GEMV's activations through their fp8 round trip by one launch before it (the
# round_trip tile), loaded as they are by every program instead of quantized again in each;
# gemv_shared_min_weights: the weight elements (N x K) from which gemv_rows and gemv_round_trip apply
# (None: every launch); a smaller weight's launch takes one row a program and no round trip;
# max_weights: the rule serves weights of at most this many elements (N x K), a larger one's launch
# takes the next rule that serves its rows (None: any weight);
# gemv_mma: fp8_w launches of up to 16 rows on mma.sync with the weights as its M side (:mod:`.gemv_mma`,
# Gluon, sm_80+; num_warps x 16 weight rows a program, the K split aiming at gemv_mma_per_sm programs an
# SM, gemv_mma_kw consecutive K elements a thread holds in the MMA's operands: 4, or 8 for 64-bit shared
# loads where the Triton accepts it; only from gemv_mma_min_weights weight elements (N x K; None: every
# weight): a smaller weight's launch, and every launch elsewhere, takes the rule's other knobs;
# gemv_mma_stages slots in its ring of copies, gemv_mma_sub K slices of 32 a slot; gemv_mma_dq: the
# activations' fp8 round trip by a launch before it and bf16 operands, up to 64 rows instead of 16);
# qgmma: fp8_w launches on the fp8 warpgroup MMA with both operands streamed from shared memory (:mod:`.linear_qgmma`,
# Gluon, sm_90; the activations quantized by a launch before it): qgmma_tokens activation rows and 16 x qgmma_warps
# weight rows a program, a ring of qgmma_stages trips of 128 K, qgmma_inflight of a trip's four MMAs in flight at
# once (1 or 2), each thread held to qgmma_maxnreg registers where set, the group_m tile's activation tiles in a
# row over each weight tile; over the bf16_gemm_min_rows tile where it applies. Where the kernel does not take
# the shape (K not a multiple of 128, N not whole programs), the rule's MMA tile; qgmma_per_sm: K split into
# runs of whole trips to bring the programs nearest to this many an SM, the splits summed by each output tile's
# last program (None: no split; for the few rows of a decode step, whose output tiles do not fill the SMs);
# qgmma_min_weights: only weights of at least this many elements (N x K) take it, smaller ones the rule's other
# knobs (None: every weight; a rule with qgmma and gemv / gemv_mma tries qgmma first, the others where it declines);
# qgmma_token_groups 2: a program's warpgroups side by side over its tokens, one weight tile of 64 rows (8 warps;
# half the accumulator a thread at 32-64 rows)
KNOBS = dict(min_block_n=None, split_min_blocks=4, split_per_sm=None, split_reduce=None, fp8_mma=None, gemv=False,
             gemv_rows=1, gemv_round_trip=False, gemv_shared_min_weights=None, max_weights=None, gemv_mma=False,
             gemv_mma_per_sm=8, gemv_mma_kw=4, gemv_mma_min_weights=None, gemv_mma_stages=4, gemv_mma_sub=4,
             gemv_mma_dq=False, qgmma=False, qgmma_tokens=64, qgmma_warps=8, qgmma_stages=3, qgmma_inflight=2,
             qgmma_maxnreg=None, qgmma_per_sm=None, qgmma_min_weights=None, qgmma_token_groups=1)

TILES = {
    "act_quant": dict(BLOCK_R=16, GROUPS=4, num_warps=4),
    # the GEMV rules' activations launch (gemv_round_trip): BLOCK_R rows x BLOCK_C columns (whole blocks of 32)
    "round_trip": dict(BLOCK_R=4, BLOCK_C=256, num_warps=4),
    # (largest M the rule serves or None, tile): the first matching rule applies
    "linear": (
        (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, **KNOBS)),
        (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
        (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)),
    ),
    "group_m": 8,
    "split_k": None,  # None: split K when the output tiles do not fill the SMs; or a forced count
    "fp8_mma": None,  # None: fp8 tl.dot where the device has it (sm_89+); True / False force a path
    # how the MMA loop decodes fp4_w codes: "bits" (code by code: linear_kernel._w_block), "dot_scaled"
    # (the bytes and scales to tl.dot_scaled: Triton decodes them), "packed" (two codes a byte in
    # packed registers: codecs.e2m1_pairs_bf16; sm_90+, "bits" elsewhere and under the interpreter),
    # "packed_prefetch" (the packed decode with each block's scale bytes loaded a block ahead; the bit
    # decode so where "packed" falls back). The same values either way; row tiles under 16 keep the
    # multiply-add loop
    "fp4_decode": "bits",
    # the packed decode's 2**126 re-bias folded into the scales (one bf16x2 multiply a register fewer)
    # where every fp4_w weight of a launch has its largest scale byte recorded at most 128
    # (QTensor.scale_max, set where the experts are stacked at load): see fold_scales
    "fp4_scale_fold": False,
    # the MMA loop's K order within each 8 positions: the four low nibbles' values, then the four high
    # ones (bits and packed decodes): the packed decode's output registers are then the MMA's weight
    # operand as they come, and the activation tile is permuted in registers to match (the same sum;
    # its fp32 order within an MMA differs); see linear_kernel._halves
    "fp4_halves": False,
    # fp8_w weights that the MMA loop dequantizes (no fp8 MMA: the shared expert with its activations
    # dequantized, or fp8_mma off) decoded four E4M3 bytes a call where the packed decode runs
    # (codecs_e4m3; the same values), else byte by byte; see fp8_decode
    "fp8_packed": False,
    # tiles of 64 rows and more multiply the dequantized weights by the activations (w @ x.T, the
    # tile transposed once after the K loop): the decoded weights are the warpgroup MMA's register
    # operand as they come, instead of a trip through shared memory as its second operand, and the
    # activations the operand it reads from shared memory. The same products; see linear_kernel._mma
    "swap_operands": False,
    # bf16 x and fp8_w with at least this many rows: both operands dequantized to bf16 (exact) and one
    # cuBLAS bf16 GEMM (fp32 accumulation), see _bf16_gemm; None: never (the default; h200.yaml: 4096 rows,
    # docs/performance.md, linear fp8_w)
    "bf16_gemm_min_rows": None,
    # up to this many rows the GEMM quantizes x itself (no act_quant launch) and a split K is summed
    # by the tile's last program (no sum and cast launches); 0: never
    "fused_max_rows": 64,
}


PLANS = PlanCache("linear", TILES)  # the active tiles and the launch plans made with them
_tiles = PLANS.tiles


def supports_fp8_mma() -> bool:
    """tl.dot on E4M3 operands (sm_89+; the device compiled for, :mod:`flashrt.jit_targets`); the
    interpreter runs that path with fp32 operands."""
    return INTERPRETED or jit_targets.capability() >= (8, 9)


def mma_sync_device() -> bool:
    """Whether :mod:`.gemv_mma`'s Gluon kernel runs here: a compiled sm_80+ target, not the interpreter
    (which does not run Gluon)."""
    return not INTERPRETED and jit_targets.capability() >= (8, 0)


def num_sms() -> int:
    return 1 if INTERPRETED else jit_targets.sm_count()


def mma_mode(fmt: str, fp8_acts: bool = True, rule_fp8_mma: bool | None = None):
    """(PROMOTE, DOT dtype) for a weight format on this device; ``fp8_acts`` False: the activations
    arrive dequantized (linear_kernel.ACT_DEQUANTIZED), which the fp8 MMA on raw E4M3 cannot take.
    ``rule_fp8_mma``: a rule's own ``fp8_mma`` knob, over the family's ``fp8_mma`` tile."""
    forced = _tiles()["fp8_mma"] if rule_fp8_mma is None else rule_fp8_mma
    promote = fmt == "fp8_w" and fp8_acts and (supports_fp8_mma() if forced is None else bool(forced))
    if INTERPRETED:
        return promote, tl.float32
    return promote, (tl.float8e4nv if promote else tl.bfloat16)


FP4_DECODES = ("bits", "dot_scaled", "packed", "packed_prefetch")
SCALE_PREFETCH = 8  # added to the E2M1 constexpr: the MMA loop loads each block's scales a block ahead
SCALE_FOLD = 16  # added to the E2M1 constexpr: the packed decode's re-bias folded into the scales
HALVES = 32  # added to the E2M1 constexpr: the fp4_halves K order (not with tl.dot_scaled)
WORDS = 64  # added to the E2M1 constexpr: fp4_w bytes in the E2M1 word layout (formats.with_e2m1_words)
FP8_PACKED = 128  # added to the E2M1 constexpr: dequantized fp8_w weights decoded four bytes a call
FP8_FOLD = 256  # added to the E2M1 constexpr: that decode's 2**120 folded into the scales (fold_fp8)
SWAP_AB = 512  # added to the E2M1 constexpr: the swap_operands tile (the weights the MMA's first operand)
FOLD_MAX_SCALE = 128  # the largest UE8M0 byte whose folded scale 2**(u - 1) bf16 holds exactly


def fp4_decode(swap: bool | None = None) -> int:
    """The kernels' E2M1 constexpr for the ``fp4_decode`` tile on this device: the decode (0 bits, 1
    ``tl.dot_scaled``, 2 packed) plus :data:`SCALE_PREFETCH` for "packed_prefetch", plus
    :data:`HALVES` for the ``fp4_halves`` tile (with the bits and packed decodes), plus
    :data:`FP8_PACKED` for the ``fp8_packed`` tile with the packed decode, plus :data:`SWAP_AB` for
    the ``swap_operands`` tile, or ``swap`` where a rule sets it (not with ``tl.dot_scaled``). The packed
    decode's bf16x2 multiplies need sm_90 (inline PTX: a GPU, or the interpreter emulating it,
    :func:`.codecs.ptx_sm90`), else the bit decode (the same values)."""
    name = _tiles()["fp4_decode"]
    ahead = SCALE_PREFETCH if name == "packed_prefetch" else 0
    mode = 2 if ahead else FP4_DECODES.index(name)
    if mode == 2 and not ptx_sm90():
        mode = 0
    fp8 = FP8_PACKED if mode == 2 and _tiles()["fp8_packed"] else 0  # an fp8 shared expert in the launch
    return mode + ahead + (HALVES if _tiles()["fp4_halves"] and mode != 1 else 0) + fp8 + _swap(mode != 1, swap)


def _swap(applies: bool, swap: bool | None = None) -> int:
    """:data:`SWAP_AB` where the loop dequantizes the weights and ``swap`` (a rule's knob), or where
    it is None the ``swap_operands`` tile, is on."""
    return SWAP_AB if applies and (_tiles()["swap_operands"] if swap is None else swap) else 0


def pick_tile(rules, rows: int, weights: int | None = None) -> dict:
    """The first tile rule serving ``rows`` (BLOCK_N, BLOCK_K: multiples of 32, the scale blocks) and,
    where ``weights`` (a weight's elements, N x K) is given, a weight that size (its ``max_weights``)."""
    tile = next((t for limit, t in rules if (limit is None or rows <= limit)
                 and (weights is None or t.get("max_weights") is None or weights <= t["max_weights"])), None)
    if tile is None:
        raise ValueError(f"tiles: expected a rule serving {rows} rows and a weight of {weights} elements "
                         f"(the last rule without max_weights), got {[limit for limit, _ in rules]}")
    assert tile["BLOCK_N"] % 32 == 0 and tile["BLOCK_K"] % 32 == 0, tile
    return tile


def split_tile(tile: dict, knobs: dict = KNOBS) -> tuple[dict, dict]:
    """(the kernel parameters of a rule's tile, its launch knobs: ``knobs``' defaults where unset)."""
    return ({k: v for k, v in tile.items() if k not in knobs},
            {k: tile.get(k, default) for k, default in knobs.items()})


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float (K % 32 == 0) -> (E4M3 bytes uint8 [M, K], UE8M0 scale bytes uint8 [M, K / 32]):
    the ``fp8`` format, bit for bit (quant.py's kernel at TILES ``act_quant``)."""
    m, k = x.shape
    key = ("act_quant", m, k)
    plan = PLANS.lookup(key)[1]
    if plan is None:
        assert x.dim() == 2 and k % 32 == 0 and x.dtype in FLOATS, (x.shape, x.dtype)
        t = _tiles()["act_quant"]
        plan = PLANS.store(key, quant.rows_plan(m, k, "fp8", False, (t["BLOCK_R"], t["GROUPS"], t["num_warps"])))
    x = last_dense(x)
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, k // 32, dtype=torch.uint8, device=x.device)
    if m and k:
        quant.launch_rows(plan, x, q, s, None, k, k // 32)
    return q, s


def fp8_operand(t: torch.Tensor) -> torch.Tensor:
    """E4M3 data as the kernels take it: float8_e4m3fn where Triton has the type (sm_89+), else uint8."""
    return t.view(torch.float8_e4m3fn if supports_fp8_mma() else torch.uint8)


def weight_operands(w: QTensor):
    """(data, scale as uint8) of a weight QTensor for the kernels: the data with its last dim
    contiguous; the scale as it is laid out where either of its last two dims is contiguous (row
    major, or K major: the kernels take both strides), else a contiguous copy."""
    data = fp8_operand(w.data) if w.fmt == "fp8_w" else w.data
    scale = w.scale.view(torch.uint8)
    if scale.stride(-1) != 1 and scale.stride(-2) != 1:
        scale = scale.contiguous()
    return last_dense(data), scale


def fp8_decode(promote: bool, swap: bool | None = None) -> int:
    """The E2M1 constexpr of a launch whose weights are all fp8_w: 2 + :data:`FP8_PACKED` where the
    ``fp8_packed`` tile is on, the packed decodes run (:func:`fp4_decode`'s mode) and the loop
    dequantizes the weights (not the fp8 MMA), so it decodes four E4M3 bytes a call
    (``codecs_e4m3``); else 0 (the variants compiled so far unchanged); plus :data:`SWAP_AB` where
    the loop dequantizes the weights and ``swap`` (a rule's knob) or the ``swap_operands`` tile is on."""
    return (2 + FP8_PACKED if not promote and (fp4_decode() & FP8_PACKED) else 0) + _swap(not promote, swap)


def may_fold(e2m1: int) -> bool:
    """Whether launches with the E2M1 constexpr ``e2m1`` may fold the re-bias into the scales: the
    packed decode runs and the ``fp4_scale_fold`` tile is on (a plan's flag, decided once)."""
    return e2m1 % 8 == 2 and _tiles()["fp4_scale_fold"]


def fold_scales(e2m1: int, *weights) -> int:
    """``e2m1`` (:func:`fp4_decode`) plus :data:`SCALE_FOLD` where :func:`may_fold` and every fp4_w
    weight among ``weights`` has a recorded largest scale byte (``QTensor.scale_max``) of at most
    :data:`FOLD_MAX_SCALE`; else ``e2m1``. The weights' part is decided per launch (plans are per
    shape; launchers ask only where their plan may fold); the values are the same either way."""
    return e2m1 + SCALE_FOLD if may_fold(e2m1) and scales_at_most(weights, "fp4_w", FOLD_MAX_SCALE) else e2m1


def scales_at_most(weights, fmt: str, top: int) -> bool:
    """Whether ``weights`` hold a weight of format ``fmt`` and every such one has its largest scale
    byte recorded (``QTensor.scale_max``) at most ``top``."""
    of_fmt = [w for w in weights if isinstance(w, QTensor) and w.fmt == fmt]
    return bool(of_fmt) and all(w.scale_max is not None and w.scale_max <= top for w in of_fmt)


def fold_fp8(e2m1: int, *weights) -> int:
    """``e2m1`` plus :data:`FP8_FOLD` where the packed fp8 decode runs (:data:`FP8_PACKED` in it) and
    every fp8_w weight among ``weights`` (at least one) has its largest scale byte recorded at most
    ``codecs_e4m3.FOLD_MAX_SCALE`` (``QTensor.scale_max``, set where the experts are stacked at load);
    else ``e2m1``. The values are the same either way."""
    packed = e2m1 & FP8_PACKED
    return e2m1 + FP8_FOLD if packed and scales_at_most(weights, "fp8_w", FP8_FOLD_MAX_SCALE) else e2m1


def with_words(e2m1: int, *weights) -> int:
    """``e2m1`` for a launch over ``weights`` whose fp4_w weights hold their codes in the E2M1 word
    layout: plus :data:`WORDS`, ``tl.dot_scaled`` (which takes standard bytes) turned into the bit
    decode; ``e2m1`` as it is for standard bytes. One launch takes one layout: ``ValueError`` when
    its fp4_w weights mix the two."""
    layouts = {w.e2m1_words for w in weights if isinstance(w, QTensor) and w.fmt == "fp4_w"}
    if len(layouts) > 1:
        raise ValueError("weights: expected the fp4_w weights of one launch in one code layout (all standard "
                         "nibbles or all E2M1 words, formats.with_e2m1_words), got both")
    if layouts != {True}:
        return e2m1
    return (e2m1 - 1 if e2m1 % 8 == 1 else e2m1) + WORDS


def _linear_plan(m: int, n: int, k: int, dtype: torch.dtype, fmt: str) -> dict:
    """Grid, K split, output dtype and constexprs of one (rows, weight shape, dtype) under the active
    tiles; ``bf16_gemm``: the call takes :func:`_bf16_gemm` instead."""
    t, knobs = split_tile(pick_tile(_tiles()["linear"], m, n * k))
    big = _tiles()["bf16_gemm_min_rows"]
    bf16_gemm = big is not None and m >= big and fmt == "fp8_w" and dtype == torch.bfloat16
    if (knobs["qgmma"] and fmt == "fp8_w" and n * k >= (knobs["qgmma_min_weights"] or 0) and linear_qgmma.AVAILABLE
            and not INTERPRETED and jit_targets.capability() >= (9, 0)):
        q = linear_qgmma.plan(m, n, k, dict(TOKENS=knobs["qgmma_tokens"], STAGES=knobs["qgmma_stages"],
                                            num_warps=knobs["qgmma_warps"], GROUP=_tiles()["group_m"],
                                            INFLIGHT=knobs["qgmma_inflight"], maxnreg=knobs["qgmma_maxnreg"],
                                            PER_SM=knobs["qgmma_per_sm"], TOKEN_GROUPS=knobs["qgmma_token_groups"]),
                                  num_sms())
        if q is not None:
            return dict(q, qgmma=True, bf16_gemm=False, gemv=False)
    dq = bool(knobs["gemv_mma_dq"])
    if (knobs["gemv_mma"] and fmt == "fp8_w" and m <= (gemv_mma.MAX_ROWS_DQ if dq else gemv_mma.MAX_ROWS)
            and n * k >= (knobs["gemv_mma_min_weights"] or 0) and gemv_mma.AVAILABLE and mma_sync_device()):
        return dict(gemv_mma.plan(m, n, k, dtype, dict(num_warps=t["num_warps"], per_sm=knobs["gemv_mma_per_sm"],
                                                       KW=knobs["gemv_mma_kw"], STAGES=knobs["gemv_mma_stages"],
                                                       SUB=knobs["gemv_mma_sub"]), num_sms(), dq),
                    bf16_gemm=bf16_gemm, gemv=False, gemv_mma=True)
    if knobs["gemv"] and fmt == "fp8_w":  # split K summed in the kernel unless split_reduce is False
        return dict(gemv.plan(m, n, k, dtype, t, knobs, _tiles()["split_k"], num_sms(),
                              knobs["split_reduce"] is not False), bf16_gemm=bf16_gemm, fused=True, fold=False)
    promote, dot = mma_mode(fmt, rule_fp8_mma=knobs["fp8_mma"])
    sms, row_tiles = num_sms(), cdiv(m, t["BLOCK_M"])
    t["BLOCK_N"] = splitk.narrow_block_n(t["BLOCK_N"], n, row_tiles, sms, knobs["min_block_n"])
    tiles = row_tiles * cdiv(n, t["BLOCK_N"])
    split, k_split = splitk.splits(tiles, k, t["BLOCK_K"], sms, _tiles()["split_k"], knobs["split_min_blocks"],
                                   knobs["split_per_sm"])
    fused = m <= _tiles()["fused_max_rows"]
    in_kernel = fused if knobs["split_reduce"] is None else knobs["split_reduce"]
    reduce = in_kernel and split > 1 and splitk.fits(tiles) and split * m * n < 2 ** 31
    out_dtype = dtype if split == 1 or reduce else torch.float32
    return dict(grid=(tiles, split), split=split, k_split=k_split, out_dtype=out_dtype, fused=fused, reduce=reduce,
                bf16_gemm=bf16_gemm, gemv=False,
                constexprs=dict(FP4=fmt == "fp4_w", PROMOTE=promote, DOT=dot, GROUP_M=_tiles()["group_m"],
                                OUT=TL_DTYPES[out_dtype], QX=fused, REDUCE=reduce,
                                E2M1=fp4_decode() if fmt == "fp4_w" else fp8_decode(promote), **t),
                fold=fmt == "fp4_w" and may_fold(fp4_decode()))


def _gemv(x2: torch.Tensor, weight: QTensor, plan: dict) -> torch.Tensor:
    """[M, N] of x2 [M, K] and an fp8_w weight through :mod:`.gemv`'s kernel (fp32 partials summed
    by a launch after it where the plan does not sum them in the kernel); x2 through its fp8 round trip
    first where the rule sets ``gemv_round_trip``."""
    data, scale = weight_operands(weight)
    (m, k), n = x2.shape, weight.shape[0]
    x2 = fp8_round_trip(x2, _tiles()["round_trip"]) if plan["round_trip"] else last_dense(x2)
    out, ws, cnt = splitk.outputs(plan, m, n, x2.device)
    _gemv_kernel[plan["grid"]](
        x2, data, scale, out, ws, cnt, m, n, k, plan["k_split"], plan["split"], x2.stride(0), data.stride(0),
        scale.stride(0), scale.stride(1), out.stride(1), out.stride(0), **plan["constexprs"], **pdl.options(x2.device))
    return splitk.result(out, plan, x2.dtype)


def _bf16_gemm(x2: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """The fp8 activations and the fp8_w weight as bf16 (E4M3 values times UE8M0 powers of two:
    exact in bf16; one launch each), one cuBLAS bf16 GEMM (fp32 accumulation, one rounding
    to bf16): the kernel's math at large M, where the per-32 scale promotion makes the fp8 MMA loop slow."""
    return fp8_rows_bf16(x2) @ quant.dequantize(weight, torch.bfloat16).t()


def fp8_rows_bf16(x2: torch.Tensor) -> torch.Tensor:
    """``x2`` [M, K] quantized to fp8 per 32 (as :func:`act_quant` quantizes it) and back, as bf16: the
    values the kernels' fp8 activations stand for (E4M3 times a power of two: exact in bf16), in one
    launch (:func:`.round_trip.fp8_round_trip`: no E4M3 bytes and scales written and read back)."""
    return fp8_round_trip(x2, _tiles()["round_trip"])


def _cached_plan(m: int, n: int, k: int, dtype: torch.dtype, fmt: str) -> dict:
    """The plan of :func:`_linear_plan`, made once per key under the active tiles, with its launch (``path``)."""
    key = (m, n, k, dtype, fmt)
    plan = PLANS.lookup(key)[1]
    if plan is None:
        plan = _linear_plan(m, n, k, dtype, fmt)
        plan = PLANS.store(key, {**plan, "path": _path(plan)})
    return plan


def _path(plan: dict) -> str:
    """The launch a plan takes: ``bf16_gemm``, ``gemv``, ``qgmma``, ``gemv_mma`` or ``tile`` (the MMA tile)."""
    if plan["bf16_gemm"]:
        return "bf16_gemm"
    if plan["gemv"]:
        return "gemv"
    return "qgmma" if plan.get("qgmma") else "gemv_mma" if plan.get("gemv_mma") else "tile"


def launch_path(x, weight, out_dtype=None) -> str:
    """The launch :func:`linear` takes for these arguments under the active tiles (:func:`_path`; ``plain``
    for a plain weight): which of a rule's knobs the call reads (``flashrt tune`` sweeps those)."""
    if not isinstance(weight, QTensor):
        return "plain"
    n, k = weight.shape
    dtype = x.dtype if out_dtype in (None, x.dtype) else torch.float32
    return _cached_plan(x.numel() // k, n, k, dtype, weight.fmt)["path"]


def linear(x: torch.Tensor, weight: QTensor | torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., in] float, weight fp8_w / fp4_w [out, in] (or plain: :mod:`.linear_plain`) -> [..., out] in
    ``out_dtype`` (default x.dtype). A plain weight writes ``out_dtype`` from the kernel; a quantized
    one with another ``out_dtype`` runs on fp32 ``x`` (exact; the activations quantize the same
    values) and rounds the fp32 sums once."""
    if not isinstance(weight, QTensor):
        return plain_linear(x, weight, out_dtype)
    if out_dtype not in (None, x.dtype):
        out = linear(x.to(torch.float32), weight)
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    assert weight.fmt in WEIGHT_FORMATS and weight.ndim == 2, weight
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or n == 0 or k == 0:
        return x.new_zeros(*x.shape[:-1], n)
    plan = _cached_plan(m, n, k, x.dtype, weight.fmt)
    path = plan["path"]
    if path == "bf16_gemm":
        return _bf16_gemm(x2, weight).view(*x.shape[:-1], n)
    if path == "gemv":
        return _gemv(x2, weight, plan).view(*x.shape[:-1], n)
    if path == "qgmma":
        xq, xs = fp8_codes(x2, _tiles()["round_trip"])
        data, scale = weight_operands(weight)
        return linear_qgmma.launch(xq, xs, data, scale, plan, x.dtype).view(*x.shape[:-1], n)
    if path == "gemv_mma":
        data, scale = weight_operands(weight)
        xs = fp8_round_trip(x2, _tiles()["round_trip"]) if plan["dq"] else last_dense(x2)
        fold = plan["dq"] and scales_at_most((weight,), "fp8_w", FP8_FOLD_MAX_SCALE)
        return gemv_mma.launch(xs, data.view(torch.uint8), scale, plan, fold, x.dtype).view(*x.shape[:-1], n)
    data, scale = weight_operands(weight)
    split = plan["split"]
    if plan["fused"]:
        xq = sx = last_dense(x2)  # quantized inside the kernel
    else:
        xq, sx = act_quant(x2)
    out, ws, cnt = splitk.outputs(plan, m, n, x.device)
    constexprs = plan["constexprs"]
    if plan["fold"]:  # the tile is on for this plan's packed decode: the weight's bound decides
        constexprs = dict(constexprs, E2M1=fold_scales(constexprs["E2M1"], weight))
    e2m1 = fold_fp8(with_words(constexprs["E2M1"], weight), weight)  # the weight's code layout and fp8 fold
    if e2m1 != constexprs["E2M1"]:
        constexprs = dict(constexprs, E2M1=e2m1)
    _linear_kernel[plan["grid"]](
        xq, sx, data, scale, out, ws, cnt, m, n, k, plan["k_split"], split, xq.stride(0), sx.stride(0),
        data.stride(0), scale.stride(0), out.stride(1), out.stride(0), SCALE_K=scale.stride(1), **constexprs,
        **pdl.options(xq.device))
    return splitk.result(out, plan, x.dtype).view(*x.shape[:-1], n)


def supports_linear(x, weight, out_dtype=None) -> bool:
    """Quantized 2-D weights (fp8_w / fp4_w), or plain bf16 / fp16 ones (:func:`.linear_plain.supports_plain_linear`);
    an fp32, bf16 or fp16 output."""
    if out_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        return False
    if not isinstance(weight, QTensor):
        return supports_plain_linear(x, weight)
    return weight.fmt in WEIGHT_FORMATS and weight.ndim == 2 and x.dtype in FLOATS


# ---------------------------------------------------------------------------------------------
# ahead-of-time compilation (``flashrt jit warmup``)

WARMUP_ROWS = (1, 8, 64, 256)  # decode batches 1 / 8 / 64 and a prefill chunk: every tile rule, split or not


def warmup_cases(device, d: dict, dtype):
    """The ``fp8_w`` linear variants the model launches when the active profile stores weights in
    fp8: each of WARMUP_ROWS (and the row counts the GEMV rules give programs of their own:
    :func:`.gemv.warmup_rows`) on the attention projections' shapes (out, in), zero-filled inputs; where
    the profile sends large chunks to the bf16 GEMM, its two dequantize kernels at the model's dim."""
    if profiles.active_profile().weight_dtype != "fp8":
        return
    qk = d["n_heads"] * d["head_dim"]
    rows = sorted({*WARMUP_ROWS, *gemv.warmup_rows(_tiles()["linear"])})
    for n, k in ((d["q_lora_rank"], d["dim"]), (qk, d["q_lora_rank"]), (d["head_dim"], d["dim"]), (d["dim"], qk)):
        w = zeros_stored("fp8_w", (n, k), None, device)
        for m in rows:
            yield _warmup.Launch("linear fp8_w", linear, (torch.zeros(m, k, dtype=dtype, device=device), w))
    big = _tiles()["bf16_gemm_min_rows"]
    if big is not None and dtype == torch.bfloat16:  # the bf16 GEMM path's two dequantize launches
        yield _warmup.Launch("linear fp8_w, bf16 GEMM", _bf16_gemm,
                             (torch.zeros(32, d["dim"], dtype=dtype, device=device),
                              zeros_stored("fp8_w", (d["q_lora_rank"], d["dim"]), None, device)))


SCALED = Tile(low=32, pow2=True)  # a dimension the 32-wide scale blocks tile
TILE_CHECKS = {"act_quant.BLOCK_R": POW2, "act_quant.GROUPS": POW2, "linear.BLOCK_M": GEMM_ROWS, "linear.BLOCK_N": SCALED,
               "linear.BLOCK_K": SCALED, "split_k": Tile(nullable=True, kind=int),
               "fp8_mma": Tile(nullable=True, kind=bool), "fp4_decode": Tile(choices=FP4_DECODES),
               "fp4_scale_fold": Tile(kind=bool), "fp4_halves": Tile(kind=bool), "fp8_packed": Tile(kind=bool),
               "swap_operands": Tile(kind=bool),
               "bf16_gemm_min_rows": Tile(nullable=True, kind=int),
               "fused_max_rows": COUNT0, "*.min_block_n": Tile(low=32, pow2=True, nullable=True, kind=int),
               "*.split_min_blocks": Tile(nullable=True, kind=int), "*.split_per_sm": Tile(low=1, nullable=True, kind=int),
               "*.split_reduce": Tile(nullable=True, kind=bool), "*.fp8_mma": Tile(nullable=True, kind=bool),
               "*.gemv": Tile(kind=bool), "*.gemv_rows": Tile(choices=(1, 2, 4)),
               "*.gemv_round_trip": Tile(kind=bool), "*.gemv_shared_min_weights": Tile(nullable=True, kind=int),
               "*.max_weights": Tile(nullable=True, kind=int), "*.gemv_mma": Tile(kind=bool),
               "*.gemv_mma_per_sm": Tile(low=1, kind=int), "*.gemv_mma_kw": Tile(choices=(4, 8)),
               "*.gemv_mma_min_weights": Tile(nullable=True, kind=int), "*.gemv_mma_stages": Tile(low=2, kind=int),
               "*.gemv_mma_sub": Tile(choices=(1, 2, 4)), "*.gemv_mma_dq": Tile(kind=bool),
               "*.qgmma": Tile(kind=bool), "*.qgmma_tokens": Tile(choices=linear_qgmma.TOKENS),
               "*.qgmma_warps": Tile(choices=linear_qgmma.WARPS), "*.qgmma_stages": Tile(low=2, kind=int),
               "*.qgmma_inflight": Tile(choices=(1, 2)),
               "*.qgmma_maxnreg": Tile(low=24, high=256, multiple=8, nullable=True, kind=int),
               "*.qgmma_per_sm": Tile(low=1, nullable=True, kind=int), "*.qgmma_min_weights": Tile(nullable=True, kind=int),
               "*.qgmma_token_groups": Tile(choices=linear_qgmma.TOKEN_GROUPS),
               "round_trip.BLOCK_R": POW2, "round_trip.BLOCK_C": SCALED}


FAMILY = KernelFamily(
    "linear", ops={"linear": linear},
    supports={"linear": Support(inputs={"x": FLOATS, "weight": WEIGHT_FORMATS + WEIGHT_DTYPES}, extra=supports_linear)},
    tiles=TILES, tile_checks=TILE_CHECKS, smem={"linear": gemm_smem}, warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    paths={"linear": launch_path},
    description="block-scaled FP8 / FP4 GEMM with fp8 activations; plain weights: linear_plain")
