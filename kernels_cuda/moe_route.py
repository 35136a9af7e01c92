"""``moe_route``: the MoE gate on the CUDA backend, two launches.

1. ``z = x @ gate.T`` in fp32 by :func:`.linear_plain.plain_linear` (the gate read once, as
   stored; exact products, fp32 sums: the reference's fp32 GEMM up to summation order);
2. ``_route_select_kernel``, one program per block of tokens over all experts: the score function
   (softmax / sigmoid / sqrt(softplus), log1p by Kahan's correction), the bias added for the
   choice only, the ``topk`` largest by repeated argmax (one value-and-index reduction a pick,
   ties to the lower expert, as the reference's stable descending sort), the picked scores
   gathered once, normalised and scaled.

The reference formulation is a dozen torch launches a layer (GEMM, score function, sort, gather,
sum, divide, casts); at decode each launch costs more than its work, inside a CUDA graph too
(docs/performance.md, decode end to end).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt.families import Dim, KernelFamily, Support
from flashrt.tile_checks import POW2
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.launch import PlanCache, cdiv, next_pow2
from flashrt.kernels_cuda.linear_plain import WEIGHT_DTYPES, plain_linear, supports_plain_linear
from flashrt.kernels_cuda import pdl
from flashrt.kernels_cuda.pdl import wait_inputs

# tokens a program: at most ELEMS / experts (padded to a power of two) and BLOCK_T: the score, key and
# pick tensors of ELEMS fp32 values stay in registers (4096 over 4 warps: no spills for 384 experts)
TILES = {"select": dict(BLOCK_T=16, ELEMS=4096, num_warps=4)}
PLANS = PlanCache("moe_route", TILES)  # the active tiles (and launch plans made with them)
SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
MAX_EXPERTS, MAX_TOPK = 1024, 16


@triton.jit
def _log1p(u):
    """log(1 + u) for u >= 0 to a few ulp: Kahan's correction, u itself where 1 + u rounds to 1."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def _scores(z, SCORE: tl.constexpr):
    """fp32 scores of gate logits ``z`` [T, E] (masked experts at -inf give 0)."""
    if SCORE == 0:
        p = tl.exp(z - tl.max(z, axis=1)[:, None])
        s = p / tl.sum(p, axis=1)[:, None]
    elif SCORE == 1:
        s = 1.0 / (1.0 + tl.exp(-z))
    else:
        s = tl.sqrt_rn(tl.where(z > 20.0, z, _log1p(tl.exp(z))))  # torch's softplus (threshold 20)
    return s


@triton.jit
def _route_select_kernel(z_ptr, bias_ptr, w_ptr, i_ptr, N, E, stride_z, route_scale,
                         TOPK: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_T: tl.constexpr, EB: tl.constexpr, KB: tl.constexpr):
    wait_inputs()
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, EB)
    live = (e < E)[None, :]
    z = tl.load(z_ptr + t.to(tl.int64)[:, None] * stride_z + e[None, :], mask=(t < N)[:, None] & live,
                other=float("-inf"))
    s = _scores(z, SCORE)
    key = s
    if HAS_BIAS:
        key = key + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :]
    key = tl.where(live, key, float("-inf"))
    col = tl.arange(0, KB)[None, :]
    picks = tl.zeros([BLOCK_T, KB], tl.int32)
    for j in tl.static_range(TOPK):  # one (value, index) reduction a pick; ties: the lower expert
        idx = tl.argmax(key, axis=1, tie_break_left=True).to(tl.int32)
        picks = tl.where(col == j, idx[:, None], picks)
        key = tl.where(e[None, :] == idx[:, None], float("-inf"), key)
    w = tl.where(col < TOPK, tl.gather(s, picks, axis=1), 0.0)  # the picked experts' scores
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    out = t.to(tl.int64)[:, None] * TOPK + col
    ok = (t < N)[:, None] & (col < TOPK)
    tl.store(w_ptr + out, w * route_scale, mask=ok)
    tl.store(i_ptr + out, picks, mask=ok)


def moe_route(x, weight, bias, topk, score_func, norm_topk, route_scale):
    """x [N, D], gate weight [E, D] -> (fp32 weights [N, topk], int32 indices [N, topk])."""
    n, E = x.shape[0], weight.shape[0]
    z = plain_linear(x, weight, out_dtype=torch.float32)
    w = torch.empty(n, topk, dtype=torch.float32, device=x.device)
    idx = torch.empty(n, topk, dtype=torch.int32, device=x.device)
    if n == 0 or topk == 0:
        return w, idx
    t = PLANS.tiles()["select"]
    EB = max(16, next_pow2(E))
    # one token (a decode step of one sequence) takes a one-row program: no masked rows to score
    bt = 1 if n == 1 else max(1, min(t["BLOCK_T"], t["ELEMS"] // EB))
    _route_select_kernel[(cdiv(n, bt),)](
        z, bias if bias is not None else z, w, idx, n, E, z.stride(0), float(route_scale), TOPK=topk,
        SCORE=SCORES[score_func], HAS_BIAS=bias is not None, NORM=bool(norm_topk) and topk > 1,
        BLOCK_T=bt, EB=EB, KB=max(2, next_pow2(topk)), num_warps=t["num_warps"], **pdl.options(z.device))
    return w, idx


def gate_fits_plain_linear(x, weight, bias, topk, score_func, norm_topk, route_scale) -> bool:
    """The plain linear serves the gate (x in the gate's dtype, or fp32 x with a bf16 gate)."""
    return supports_plain_linear(x, weight)



def warmup_cases(device, d: dict, dtype):
    """The gate of a decode step and of a prefill: x in the activation dtype, a bf16 gate over the
    routed experts, a bias, the shipped configs' score function (sqrtsoftplus), normalised top-k."""
    E, k, dim = d["n_routed_experts"], d["n_activated_experts"], d["dim"]
    gate = _warmup.rand((E, dim), torch.bfloat16, device) * dim ** -0.5
    for n in _warmup.TOKENS:
        yield _warmup.Launch("moe_route", moe_route, (_warmup.rand((n, dim), torch.bfloat16, device), gate,
                                                      torch.zeros(E, device=device), k, "sqrtsoftplus", True, 1.5))


FAMILY = KernelFamily(
    "moe_route", ops={"moe_route": moe_route},
    # <= 1024 experts, top-16, an fp32 bias or none; the gate through the plain linear
    supports={"moe_route": Support(inputs={"x": (torch.float32, *WEIGHT_DTYPES), "weight": WEIGHT_DTYPES,
                                           "bias": (torch.float32,), "score_func": tuple(SCORES)},
                                   dims={"weight[0]": Dim(1, MAX_EXPERTS), "topk": Dim(1, MAX_TOPK)},
                                   extra=gate_fits_plain_linear)},
    tiles=TILES, tile_checks={"select.BLOCK_T": POW2, "select.ELEMS": POW2},
    warmup=_warmup.hook(warmup_cases), warmup_cases=warmup_cases,
    description="MoE gate: scores, biased top-k, normalised weights")
