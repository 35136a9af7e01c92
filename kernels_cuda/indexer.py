"""The indexer's launchers: ``index_scores`` (fused dot, ReLU, head weights, head sum,
visibility mask; paged keys read in place) and ``candidate_blocks`` (block max + the threshold
select of :mod:`.topk` + expansion). The kernels and how they decode stored keys:
:mod:`.indexer_kernel`.
"""
from __future__ import annotations

import torch
import triton.language as tl

from flashrt.families import Dim, KernelFamily, Support
from flashrt.tile_checks import DOT, POW2, Tile
from flashrt.formats import QTensor
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.codecs import CODES, INTERPRETED as _INTERPRETED, ptx_sm90
from flashrt.kernels_cuda.indexer_kernel import _block_keys_kernel, _expand_kernel, _index_scores_kernel
from flashrt.kernels_cuda.launch import PlanCache, cdiv, next_pow2, zeros_stored
from flashrt.kernels_cuda.topk import select_rows
from flashrt.kv.paged import PagedKeys
from flashrt.kernels_cuda import pdl

TILES = {
    # rows: most (query, head) dot columns per program; num_warps_wide: > 64 columns or an fp32 dot;
    # asm_decode: fp4 keys decoded by inline PTX + bf16x2 multiplies (GPU, bf16 q; see _decode_asm)
    "index_scores": {"block_t": 128, "rows": 128, "num_warps": 4, "num_warps_wide": 8, "num_stages": 2,
                     "fp32_precision": "tf32x3", "asm_decode": True},
    "candidate_blocks": {"block": 2048, "num_warps": 4},
}


PLANS = PlanCache("indexer", TILES)  # the active tiles (and launch plans made with them)
_tiles = PLANS.tiles


_HALF_DTYPES = (torch.bfloat16, torch.float16)
# QTensor keys: fmt -> (kernel code, elements per scale, stored bytes per scale block, scale byte of 1.0)
_FORMATS = {"fp4_b32": (CODES["fp4_b32"], 32, 16, 127), "fp4_b16": (CODES["fp4_b16"], 16, 8, 0x38),
            "fp8": (CODES["fp8"], 32, 32, 127), "int8": (CODES["int8"], 32, 32, 127)}


def _dot_dtype(q, k):
    """(dot operand dtype, fp32 input precision) for these inputs on this machine."""
    if not _INTERPRETED and q.dtype in _HALF_DTYPES:
        if (isinstance(k, QTensor) and q.dtype == torch.bfloat16) or getattr(k, "dtype", None) == q.dtype:
            return (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16), "tf32"  # (ignored)
    return tl.float32, ("ieee" if _INTERPRETED else _tiles()["index_scores"]["fp32_precision"])


def index_scores(q, k, weights, visible, weight_scale=1.0):
    B, S, H, D = q.shape
    T = k.shape[1]
    out = torch.empty(B, S, T, dtype=torch.float32, device=q.device)
    if B * S * T == 0:
        return out
    tiles = _tiles()["index_scores"]
    fmt, qblock, qbytes, one = 0, 1, 1, 0
    paged = isinstance(k, PagedKeys)
    table, page = (k.block_table, k.page_size) if paged else (out, 1)  # (unused when not paged)
    k = k.pool if paged else k  # [1, rows, D]: batch stride 0 below, rows from the block table
    if isinstance(k, QTensor):
        assert k.fmt in _FORMATS and k.data.stride(-1) == 1 and k.scale.stride(-1) == 1
        fmt, qblock, qbytes, one = _FORMATS[k.fmt]
        kd, ks = k.data.view(torch.uint8), k.scale.view(torch.uint8)
        sk, ss = (kd.stride(0), kd.stride(1), 1), (ks.stride(0), ks.stride(1))
    else:
        kd = ks = k
        sk, ss = k.stride(), (0, 0)
    if paged:
        assert table.dtype == torch.int32 and table.stride(1) == 1
        sk, ss = (0, *sk[1:]), (0, ss[1])
    block_h = next_pow2(H)
    block_s = max(1, min(next_pow2(S), tiles["rows"] // block_h))
    block_s = max(block_s, 16 // block_h)  # tl.dot needs N >= 16 on the GPU
    dot, prec = _dot_dtype(q, k)
    block_d = max(16, next_pow2(D))
    grid = (cdiv(T, tiles["block_t"]), cdiv(S, block_s), B)
    wide = block_s * block_h > 64 or dot == tl.float32
    # the packed decode where the keys are fp4_b32 and the dot bf16 on an sm_90 target; under the interpreter
    # (dot fp32) while its PTX is emulated
    asm = fmt == CODES["fp4_b32"] and (dot == tl.bfloat16 or _INTERPRETED) and tiles["asm_decode"] and ptx_sm90()
    _index_scores_kernel[grid](
        q, kd, ks, weights, visible, out, table, S, T, H, *q.stride(), *sk, *ss, *weights.stride(),
        *visible.stride(), out.stride(0), out.stride(1), table.stride(0), page, float(weight_scale), PAGED=paged, D=D, BLOCK_D=block_d,
        DK=min(block_d, 32), BLOCK_T=tiles["block_t"],
        BLOCK_S=block_s, BLOCK_H=block_h, FMT=fmt, NB=next_pow2(max(1, D // qblock)), QBLOCK=qblock,
        QBYTES=qbytes, ONE=one, DOT=dot, PREC=prec, ASM=asm,
        num_warps=tiles["num_warps_wide" if wide else "num_warps"], num_stages=tiles["num_stages"],
        **pdl.options(q.device))
    return out


# ---------------------------------------------------------------------------------------------
# candidate_blocks


def candidate_blocks(scores, visible, topk_blocks, block_size):
    B, S, T = scores.shape
    out = torch.empty(B, S, T, dtype=torch.bool, device=scores.device)
    if B * S * T == 0:
        return out
    R, NB, bs = B * S, cdiv(T, block_size), block_size
    tiles = _tiles()["candidate_blocks"]
    src = scores.reshape(R, T)
    src = src if src.stride(1) == 1 else src.contiguous()
    vis = visible.reshape(R).contiguous()
    keys = torch.empty(R, NB, dtype=torch.int32, device=scores.device)
    flags = torch.empty(R, NB, dtype=torch.uint8, device=scores.device)  # cleared by _block_keys_kernel
    bj = min(next_pow2(bs), tiles["block"])
    blocks = max(1, tiles["block"] // bj)
    _block_keys_kernel[(R, cdiv(NB, blocks))](src, vis, keys, flags, T, NB, bs, src.stride(0), keys.stride(0),
                                                     BLOCKS=blocks, BJ=bj, num_warps=tiles["num_warps"],
                                                     **pdl.options(src.device))
    select_rows(keys, None, topk_blocks, flags, mark=True)  # the model's k, whatever NB: one variant
    flat = out.view(R, T).view(torch.uint8)
    block = tiles["block"]  # (not shrunk to short rows: one variant for every row length)
    _expand_kernel[(R, cdiv(T, block))](flags, flat, T, bs, flags.stride(0), flat.stride(0),
                                               BLOCK=block, num_warps=tiles["num_warps"], **pdl.options(flags.device))
    return out


def warmup_cases(device, d: dict, dtype):
    """index_scores of a step's queries over fp4_b32 keys; candidate_blocks over its scores."""
    H, D = d["index_n_heads"], d["index_head_dim"]
    for n in _warmup.TOKENS:
        q, w = _warmup.rand((1, n, H, D), dtype, device), torch.rand(1, n, H, device=device)
        for T in _warmup.CONTEXTS:
            vis = torch.full((1, n), T, dtype=torch.int32, device=device)
            keys = zeros_stored("fp4_b32", (1, T, D), None, device)
            yield _warmup.Launch("index_scores", index_scores, (q, keys, w, vis))
            scores = torch.randn(1, n, T, device=device)
            yield _warmup.Launch("candidate_blocks", candidate_blocks,
                                 (scores, vis, d["candidate_topk_blocks"], d["candidate_block_size"]))


_PLAIN = (torch.float32, *_HALF_DTYPES)
FAMILY = KernelFamily(
    "indexer", ops={"index_scores": index_scores, "candidate_blocks": candidate_blocks},
    # keys plain or fp4_b32 / fp4_b16 / fp8 / int8, contiguous or paged (PagedKeys); Di <= 512, Hi <= 128
    supports={"index_scores": Support(inputs={"q": _PLAIN, "k": _PLAIN + tuple(_FORMATS)},
                                      dims={"q[-1]": Dim(0, 512), "q[2]": Dim(0, 128)}),
              "candidate_blocks": Support(dims={"scores[-1]": Dim(0, 2**30 - 1)})},
    tiles=TILES, tile_checks={"index_scores.block_t": DOT, "index_scores.rows": POW2, "candidate_blocks.block": POW2,
                              "index_scores.fp32_precision": Tile(choices=("ieee", "tf32", "tf32x3"))},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="indexer scores over (paged) quantized keys; candidate blocks")
