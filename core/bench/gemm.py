"""Benchmarks of the gemm family: ``linear`` (fp8_w, fp4_w) and ``moe_experts`` (fp4_w routed, fp8_w shared).

- ``linear fp8_w``: x bf16 ``[M, in]`` (M = 1, 8, 64 decode rows; 4096 prefill) times the released
  fp8 weights ``[out, in]``: wq_a 1280x5120, shared-expert w1 2304x5120, wo_b 5120x8192, wq_b
  32768x1280. Our time includes the activation quantization kernel (the op's full cost).
  Baseline: ``torch._scaled_mm`` on e4m3 operands with per-tensor scales (M padded to
  16 rows, as cuBLASLt needs), which does no per-32 scaling; target >= 60% of its speed
  (``scaled_mm_fraction``). Each row also carries the torch reference (``reference_ms``,
  dequantized weight cached, fp32 F.linear), our dequant-to-bf16 path (``bf16_path_ms``, the
  sm_80 path forced through the profile's ``tiles.linear.fp8_mma``) and, from 64 rows, exact bf16
  operands + one cuBLAS bf16 GEMM (``bf16_gemm_ms``, ``tiles.linear.bf16_gemm_min_rows``). FLOPs ``2 M out in`` at the fp8 rate; bytes
  x (bf16) + weight as stored + output.
- ``linear fp4_w``: 2304x5120 at M = 1, 64, 4096 against the torch reference.
- ``moe_experts fp4_w``: 384 experts, top-6, D 5120, I 2304, swiglu_limit 10; decode N = 1, 8, 64
  and a 4096-token prefill. FLOPs ``6 N k D I``; bytes x + routing + the weights of the experts
  actually chosen + the fp32 output. Baseline: the torch reference, timed expert-chunk by
  expert-chunk (its cost is a loop over the chosen experts; timing chunks of <= 64 experts keeps
  its fp32 weight cache under ~9 GB instead of 54 GB for all 384), summed: ``reference (sum over
  expert chunks)``. ``moe_experts fp8_w shared``: the shared expert (E = 1) against the reference.

    python -m flashrt.bench.gemm     # prints the rows as JSON (needs a CUDA device)
"""
from __future__ import annotations

import json

import torch

from . import common
from .common import nbytes as _nb

DEVICE = "cuda"
LINEAR_FP8 = ((1280, 5120), (2304, 5120), (5120, 8192), (32768, 1280))
LINEAR_FP4 = (2304, 5120)
ROWS = (1, 8, 64, 4096)
FEW_ROWS = (1, 64, 4096)
D, I, E, TOPK, LIMIT = 5120, 2304, 384, 6, 10.0


def _rel(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def scaled_mm_timing(x, w) -> common.Timing:
    """The timing of torch._scaled_mm on x cast to e4m3 (rows padded to 16) and the stored e4m3 weight,
    per-tensor scales: the fp8 GEMMs' baseline."""
    m = -(-x.shape[0] // 16) * 16
    a8 = torch.zeros(m, x.shape[1], device=DEVICE, dtype=torch.float8_e4m3fn)
    a8[: x.shape[0]] = x.to(torch.float8_e4m3fn)
    b8 = w.data.t()  # [in, out] column-major, as _scaled_mm wants its second operand
    one = torch.ones((), device=DEVICE)
    return common.bench_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))


def _linear_case(rows, ceil, m, out_f, in_f, fmt, g):
    from flashrt import formats
    from flashrt.backends import reference as ref
    from flashrt.kernels_cuda import linear as lin

    x = torch.randn(m, in_f, device=DEVICE, generator=g).to(torch.bfloat16)
    w = formats.quantize(torch.randn(out_f, in_f, device=DEVICE, generator=g) * 0.05, fmt)
    out = lin.linear(x, w)
    ms = common.bench_ms(lambda: lin.linear(x, w))
    ref_ms = common.bench_ms(lambda: ref.linear(x, w))
    extra = {"reference_ms": ref_ms, "speedup_vs_reference": ref_ms / ms, "rel_err": _rel(out, ref.linear(x, w))}
    base, base_ms = "torch reference", ref_ms
    if fmt == "fp8_w":
        base, base_ms = "torch._scaled_mm (per-tensor)", scaled_mm_timing(x, w)
        extra["scaled_mm_fraction"] = base_ms / ms
        with _linear_tiles(fp8_mma=False):  # through the profile: TILES edits in place are not seen
            extra["bf16_path_ms"] = common.bench_ms(lambda: lin.linear(x, w))
        if m >= 64:  # exact bf16 operands + one cuBLAS bf16 GEMM (TILES bf16_gemm_min_rows)
            with _linear_tiles(bf16_gemm_min_rows=1):
                extra["bf16_gemm_ms"] = float(common.bench_ms(lambda: lin.linear(x, w)))
                extra["bf16_gemm_rel_err"] = _rel(lin.linear(x, w), ref.linear(x, w))
            extra["bf16_gemm_scaled_mm_fraction"] = float(base_ms) / extra["bf16_gemm_ms"]
    rows.append(common.row(f"linear {fmt}", f"M={m} out={out_f} in={in_f}", ms, 2.0 * m * out_f * in_f,
                           _nb(x, w, out), ceil, baseline=base, baseline_ms=base_ms, fp8_math=True, **extra))


def _linear_tiles(**overrides):
    """The active profile with ``tiles.linear`` overrides (a context manager)."""
    import dataclasses

    from flashrt import profiles

    p = profiles.active_profile()
    return profiles.using(dataclasses.replace(p, tiles={**p.tiles, "linear": {**p.tiles.get("linear", {}), **overrides}}))


def _random_fp4(g, n_exp, out_f, in_f):
    from flashrt.formats import QTensor

    data = torch.randint(0, 256, (n_exp, out_f, in_f // 2), dtype=torch.uint8, device=DEVICE, generator=g)
    scale = torch.randint(119, 123, (n_exp, out_f, in_f // 32), dtype=torch.uint8, device=DEVICE, generator=g)
    return QTensor(data, scale.view(torch.float8_e8m0fnu), "fp4_w", (n_exp, out_f, in_f))


def _compact(w, experts):
    import dataclasses

    return dataclasses.replace(w, data=w.data[experts], scale=w.scale[experts], shape=(len(experts), *w.shape[1:]))


def _reference_by_chunks(x, weights, indices, ws, chunk=64):
    """(summed reference ms, reference output): the reference on each chunk of chosen experts."""
    from flashrt.backends import reference as ref

    used = torch.unique(indices)
    total, out = 0.0, torch.zeros(x.shape, dtype=torch.float32, device=DEVICE)
    for c0 in range(0, used.numel(), chunk):
        experts = used[c0 : c0 + chunk]
        remap = torch.full((E,), -1, dtype=torch.int32, device=DEVICE)
        remap[experts] = torch.arange(experts.numel(), dtype=torch.int32, device=DEVICE)
        tok, slot = torch.nonzero(remap[indices.long()] >= 0, as_tuple=True)
        sub = (x[tok], weights[tok, slot][:, None], remap[indices[tok, slot].long()][:, None])
        cw = tuple(_compact(w, experts) for w in ws)
        out.index_add_(0, tok, ref.moe_experts(*sub, *cw, LIMIT))  # also fills the dequant cache
        total += common.bench_ms(lambda: ref.moe_experts(*sub, *cw, LIMIT), warmup=5, rep=30)
        del cw
        torch.cuda.empty_cache()
    return total, out


def _moe_case(rows, ceil, n, ws, g):
    from flashrt.kernels_cuda import moe

    x = torch.randn(n, D, device=DEVICE, generator=g).to(torch.bfloat16)
    indices = torch.rand(n, E, device=DEVICE, generator=g).topk(TOPK).indices.to(torch.int32)
    weights = torch.rand(n, TOPK, device=DEVICE, generator=g)
    out = moe.moe_experts(x, weights, indices, *ws, LIMIT)
    ms = common.bench_ms(lambda: moe.moe_experts(x, weights, indices, *ws, LIMIT))
    ref_ms, want = _reference_by_chunks(x, weights, indices, ws)
    used = torch.unique(indices).numel()
    w_bytes = sum(_nb(w) for w in ws) * used // E
    rows.append(common.row("moe_experts fp4_w", f"N={n} E={E} top{TOPK} D={D} I={I}", ms, 6.0 * n * TOPK * D * I,
                           _nb(x, weights, indices, out) + w_bytes, ceil, baseline="reference (sum over expert chunks)",
                           baseline_ms=ref_ms, fp8_math=True, experts_used=used, rel_err=_rel(out, want)))


def _shared_case(rows, ceil, n, g):
    from flashrt import formats
    from flashrt.backends import reference as ref
    from flashrt.kernels_cuda import moe

    ws = tuple(formats.quantize(torch.randn(1, *s, device=DEVICE, generator=g) * 0.05, "fp8_w")
               for s in ((I, D), (I, D), (D, I)))
    x = torch.randn(n, D, device=DEVICE, generator=g).to(torch.bfloat16)
    route = (torch.ones(n, 1, device=DEVICE), torch.zeros(n, 1, dtype=torch.int32, device=DEVICE))
    out = moe.moe_experts(x, *route, *ws, LIMIT)
    ms = common.bench_ms(lambda: moe.moe_experts(x, *route, *ws, LIMIT))
    ref_ms = common.bench_ms(lambda: ref.moe_experts(x, *route, *ws, LIMIT))
    rows.append(common.row("moe_experts fp8_w shared", f"N={n} E=1 D={D} I={I}", ms, 6.0 * n * D * I,
                           _nb(x, *route, *ws, out), ceil, baseline="torch reference", baseline_ms=ref_ms,
                           fp8_math=True, rel_err=_rel(out, ref.moe_experts(x, *route, *ws, LIMIT))))


def run(ceil) -> list[dict]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    rows: list[dict] = []
    for out_f, in_f in LINEAR_FP8:
        for m in ROWS:
            _linear_case(rows, ceil, m, out_f, in_f, "fp8_w", g)
    for m in FEW_ROWS:
        _linear_case(rows, ceil, m, *LINEAR_FP4, "fp4_w", g)
    ws = (_random_fp4(g, E, I, D), _random_fp4(g, E, I, D), _random_fp4(g, E, D, I))  # 6.8 GB
    for n in ROWS:
        _moe_case(rows, ceil, n, ws, g)
    del ws
    torch.cuda.empty_cache()
    for n in FEW_ROWS:
        _shared_case(rows, ceil, n, g)
    return rows


if __name__ == "__main__":
    print(json.dumps(run(common.Ceilings.measure()), indent=2))
