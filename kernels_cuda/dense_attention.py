"""``dense_attention``: bidirectional attention (the ViT over an image's patches) as one Triton
flash-attention forward.

One program per (block of ``BLOCK_M`` queries, batch row and head): the query block stays in
registers while the keys and values stream through in blocks of ``BLOCK_N``; an online softmax in
base 2 (running max ``m``, sum ``l``) accumulates ``p @ v`` in fp32 and divides once at the end.
The MMA runs on the inputs' dtype (bf16 / fp16 operands, fp32 accumulation; fp32 inputs as fp32
"ieee" dots); ``p`` is rounded to that dtype for its dot, as flash attention does. Under the
Triton interpreter every dot operand is fp32 (its bf16 dot is wrong) and the output is rounded to
nearest even by hand (:func:`.codecs.to_out`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.families import Dim, KernelFamily, Support
from flashrt.jit_triton import interpreted
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.codecs import to_out
from flashrt.kernels_cuda.launch import TL_DTYPES, PlanCache, cdiv, last_dense, next_pow2
from flashrt.tile_checks import DOT
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

LOG2E = 1.4426950408889634
MAX_D = 256
TILES = {
    # (largest head dim the rule serves or None, tile): the first matching rule applies
    "dense": (
        (64, dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
        (128, dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)),
        (None, dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1)),
    ),
}
PLANS = PlanCache("dense_attention", TILES)  # the active tiles (and launch plans made with them)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _dense_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, S, T, H,
                            sqb, sqs, sqh, skb, skt, skh, svb, svt, svh, sob, sos, soh, qk_scale,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, DOT: tl.constexpr, OUT: tl.constexpr):
    wait_inputs()
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    dmask = (cols < D)[None, :]
    qmask = (rows < S)[:, None] & dmask
    q = tl.load(q_ptr + b * sqb + h * sqh + rows.to(tl.int64)[:, None] * sqs + cols[None, :], mask=qmask, other=0.0)
    q = q.to(DOT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    for n0 in range(0, T, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kvmask = (keys < T)[:, None] & dmask
        offs = keys.to(tl.int64)[:, None]
        k = tl.load(k_base + offs * skt + cols[None, :], mask=kvmask, other=0.0).to(DOT)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where((keys < T)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block has a key (T >= 1, n0 < T)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(v_base + offs * svt + cols[None, :], mask=kvmask, other=0.0).to(DOT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    o = o_ptr + b * sob + h * soh + rows.to(tl.int64)[:, None] * sos + cols[None, :]
    tl.store(o, to_out(out, OUT), mask=qmask)


def _dot_dtype(dtype: torch.dtype):
    """Dot operand dtype: the inputs' (bf16 / fp16 MMA, fp32 "ieee"); fp32 under the interpreter."""
    if interpreted():
        return tl.float32
    return TL_DTYPES[dtype]


def _plan(S: int, B: int, H: int, D: int, dtype: torch.dtype) -> dict:
    t = next(tile for limit, tile in PLANS.tiles()["dense"] if limit is None or D <= limit)
    return dict(grid=(cdiv(S, t["BLOCK_M"]), B * H),
                constexprs=dict(D=D, BLOCK_D=max(16, next_pow2(D)), BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"],
                                DOT=_dot_dtype(dtype), OUT=TL_DTYPES[dtype], num_warps=t["num_warps"],
                                num_stages=t["num_stages"]))


def dense_attention(q, k, v, scale):
    B, S, H, D = q.shape
    T = k.shape[1]
    out = torch.empty_like(q)
    if B * S * H == 0:
        return out
    key = (S, B, H, D, q.dtype)
    plan = PLANS.lookup(key)[1] or PLANS.store(key, _plan(S, B, H, D, q.dtype))
    q, k, v = last_dense(q), last_dense(k), last_dense(v)
    _dense_attention_kernel[plan["grid"]](
        q, k, v, out, S, T, H, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        float(scale) * LOG2E, **plan["constexprs"], **pdl.options(q.device))
    return out


def warmup_cases(device, d: dict, dtype):
    """The image encoder's attention (models with one: ``vision_*`` dims): every query / key block
    of its longest image (``vision_max_n_token`` patches) and of a short one, bf16 q, k, v."""
    if "vision_dim" not in d:
        return
    H = d["vision_n_heads"]
    D = d["vision_dim"] // H
    for n in sorted({d["vision_max_n_token"], 16}):
        q, k, v = (_warmup.rand((1, n, H, D), torch.bfloat16, device) for _ in range(3))
        yield _warmup.Launch("dense_attention", dense_attention, (q, k, v, D ** -0.5))


FAMILY = KernelFamily(
    "dense_attention", ops={"dense_attention": dense_attention},
    # q, k, v of one float dtype (the contract checks k and v against q); head dims up to 256
    supports={"dense_attention": Support(inputs={"q": _DTYPES}, dims={"q[-1]": Dim(1, MAX_D)})},
    tiles=TILES, tile_checks={"dense.BLOCK_M": DOT, "dense.BLOCK_N": DOT},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="bidirectional flash attention (the vision encoder)")
