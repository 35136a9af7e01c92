"""sparse_attention tile probe on one GPU call: each candidate tile is checked against the reference,
then timed by CUDA-graph replay (launch gaps out of the figure) at the decode and prefill shapes of
the released config (64 heads x 512, K = 128 window (fp8) + 512 compressed (fp4_b16) picks), with
the compiled kernel's registers, spills and shared memory.

    python benchmarks/attention_probe.py --out /tmp/attention-probe.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton

import flashrt
from flashrt import ops, profiles
from flashrt.backends import reference

H, D, W, TOPK, CTX = 64, 512, 128, 512, 131072
BASE = dict(H_BLOCK=64, K_BLOCK=32, num_warps=8, num_stages=2, D_SPLIT=2)  # the shipped tiles
TWO = dict(enabled=True, min_queries=1, max_score_bytes=1 << 30, H_BLOCK=64, K_BLOCK=64, DV=128, max_splits=8,
           num_warps=8, num_stages=2)
# tiles.attention sections over the module's TILES (H_BLOCK < 64: 2-30x slower, not probed; D_SPLIT 1 and
# the one-pass tiles around the shipped ones: results/h200-attention-probe.json of session 2). The
# two-pass spill counts in the comments are from benchmarks/sm90_compile.py (Triton 3.6, no GPU needed).
CANDIDATES = [
    {"attention": BASE},
    {"attention": BASE, "two_pass": TWO},  # 255 registers, 112 B stack (scores)
    {"attention": BASE, "two_pass": dict(TWO, K_BLOCK=32)},  # 8 warps: 128 / 128 registers, no spills
    {"attention": BASE, "two_pass": dict(TWO, K_BLOCK=32, num_warps=4)},  # 193 / 201, no spills
    {"attention": BASE, "two_pass": dict(TWO, K_BLOCK=32, DV=64, num_warps=4)},
    {"attention": BASE, "two_pass": dict(TWO, K_BLOCK=16, num_warps=4)},  # 95 KB shared: 2 programs an SM
    {"attention": BASE, "two_pass": dict(TWO, K_BLOCK=32, num_warps=4, num_stages=1)},  # 98 KB shared
]
# Diagnostic (not a candidate): the shipped tiles on bf16 KV rows (the same values, no dequantization,
# 2-4x the bytes): how much of the time the in-register dequantization takes.
DIAGNOSTIC_BF16 = {"attention": BASE}
SHAPES = [("decode", 1, 1), ("decode", 8, 1), ("decode", 64, 1), ("prefill", 1, 2048)]


def inputs(B: int, S: int, gen: torch.Generator):
    q = torch.randn(B, S, H, D, generator=gen).to(torch.bfloat16).cuda()
    ring = ops.quantize(torch.randn(B, W, D, generator=gen).cuda(), "fp8")
    main = ops.quantize(torch.randn(1, CTX // 2, D, generator=gen).cuda(), "fp4_b16")
    win = torch.arange(W, dtype=torch.int32).expand(B, S, W)
    picks = torch.randint(0, CTX // 2, (B, S, TOPK), generator=gen, dtype=torch.int32) + W
    idx = torch.cat([win, picks], -1).cuda()
    sink = torch.randn(H, generator=gen).cuda()
    return q, (ring, main), idx, sink


def graph_ms(fn, reps: int = 20) -> float:
    """Median ms of one call, from replays of a graph holding ``reps`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") / reps


def kernel_stats() -> dict:
    """Registers / spills / shared memory of each compiled attention kernel (best effort)."""
    from flashrt.kernels_cuda import attention_kernel, attention_two_pass

    out = {}
    for fn in (attention_kernel._sparse_attention_kernel, attention_two_pass._scores_kernel,
               attention_two_pass._pv_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            out.setdefault(getattr(fn, "__name__", repr(fn)), []).extend(
                {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
                 "shared": getattr(getattr(k, "metadata", None), "shared", None)} for k in kernels.values())
    return out


def floor_ms(B: int, S: int, ceil: dict) -> tuple[float, str]:
    K = W + TOPK
    flops = 4 * B * S * H * K * D
    bytes_ = B * S * (2 * H * D * 2 + K * 4) + B * S * (W * (D + D // 32) + TOPK * (D // 2 + D // 16))
    t_c, t_m = flops / ceil["bf16"], bytes_ / ceil["copy"]
    return max(t_c, t_m) * 1e3, "compute" if t_c > t_m else "memory"


def ceilings() -> dict:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy = 2 * x.numel() / (triton.testing.do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = 2 * 8192 ** 3 / (triton.testing.do_bench(lambda: a @ a, return_mode="median") * 1e-3)
    return {"copy": copy, "bf16": gemm}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    ceil = ceilings()
    base = profiles.active_profile()
    rows = []
    data = {(B, S): inputs(B, S, gen) for _, B, S in SHAPES}
    refs = {k: reference.sparse_attention(*v, D ** -0.5).float() for k, v in data.items()}
    runs = [(c, "quantized") for c in CANDIDATES] + [(DIAGNOSTIC_BF16, "bf16")]
    for section, kv_kind in runs:
        prof = dataclasses.replace(base, tiles={**base.tiles, "attention": section})
        with profiles.using(prof), flashrt.use_backend("cuda"), flashrt.value_checks(False):
            for kind, B, S in SHAPES:
                q, kv, idx, sink = data[(B, S)]
                if kv_kind == "bf16":
                    kv = tuple(ops.dequantize(seg, torch.bfloat16) for seg in kv)
                call = lambda: ops.sparse_attention(q, kv, idx, sink, D ** -0.5)
                row = {"tiles": section, "kv": kv_kind, "kind": kind, "B": B, "S": S}
                try:
                    out = call().float()
                    err = float((out - refs[(B, S)]).norm() / refs[(B, S)].norm())
                    ms = graph_ms(call)
                except Exception as exc:  # an invalid tile (shared memory) is a row, not a failure
                    rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:200]})
                    print(f"{str(section)[:100]} {kind} B={B} S={S}: {rows[-1]['error']}", flush=True)
                    continue
                fl, bound = floor_ms(B, S, ceil)
                rows.append({**row, "ms": ms, "rel_err": err, "floor_ms": fl, "bound": bound,
                             "roofline_fraction": fl / ms})
                name = "two-pass " + str(section["two_pass"]) if "two_pass" in section else str(section["attention"])
                name = (name + (" [bf16 KV]" if kv_kind == "bf16" else ""))[:120]
                print(f"{name:120} {kind:7} B={B:3d} S={S:5d} {ms * 1e3:9.1f} us  "
                      f"{100 * fl / ms:5.1f}% ({bound})  err {err:.1e}", flush=True)
    result = {"ceilings": ceil, "rows": rows, "kernels": kernel_stats()}
    print(json.dumps(result["kernels"])[:1500])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
