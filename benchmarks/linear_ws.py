"""``linear`` of an ``fp8_w`` weight at many rows, every path side by side with ``torch._scaled_mm``
in one run: the plain Triton kernel, the bf16 cuBLAS path (``tiles.linear.bf16_gemm_min_rows``) and
the warp-specialized Gluon GEMM (``tiles.linear.ws_gemm``) with its tile variants.

    python benchmarks/linear_ws.py --out F [--rows 4096] [--shapes 32768x1280 1280x5120 ...]

bf16 activations of ``--rows`` rows through an ``N x K`` fp8_w weight (random, quantized). Each path's
output is checked against the plain kernel's first (relative difference at most 1e-3; a path that
differs or fails is recorded and not timed), then timed by CUDA-graph replay behind an L2 flush
(``flashrt.timing.bench_ms``), the activations' quantization included where the path has one. The
baseline: ``torch._scaled_mm`` on the same shape with per-tensor scales (E4M3 operands made once,
not timed), the FP8 ceiling the speed target is stated against; the bf16 GEMM rate and the copy rate
are measured in the same run for the roofline (``flashrt.bench.common``).
"""
from __future__ import annotations

import argparse

import torch

import flashrt
from flashrt import formats
from flashrt.bench import common
from decode_kernel_variants import with_tiles
from results_io import write_json

PATHS = {  # tiles.linear over the active profile's
    "plain kernel": {"bf16_gemm_min_rows": None, "ws_gemm": {"min_rows": None}},
    "bf16 cuBLAS": {"bf16_gemm_min_rows": 1, "ws_gemm": {"min_rows": None}},
    "ws": {"ws_gemm": {"min_rows": 1}},
    "ws, 4 stages": {"ws_gemm": {"min_rows": 1, "STAGES": 4}},
    "ws, 10 stages": {"ws_gemm": {"min_rows": 1, "STAGES": 10}},
    "ws, 64 columns a tile": {"ws_gemm": {"min_rows": 1, "BLOCK_N": 64}},
    "ws, 2 producer warps": {"ws_gemm": {"min_rows": 1, "producer_warps": 2, "producer_regs": 40}},
    "ws, next MMA before the scaling": {"ws_gemm": {"min_rows": 1, "overlap": True, "maxnreg": 168}},
}


def _shape(text: str) -> tuple[int, int]:
    n, sep, k = text.partition("x")
    if not sep or not (n.isdigit() and k.isdigit()) or int(k) % 32 or not int(n):
        raise argparse.ArgumentTypeError(f"expected NxK with K a multiple of 32, got {text!r}")
    return int(n), int(k)


def _case(ceil, m: int, n: int, k: int, g) -> list[dict]:
    from flashrt.kernels_cuda import linear

    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = formats.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.1, "fp8_w")
    a8, b8 = x.to(torch.float8_e4m3fn), w.data.view(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    base = common.bench_ms(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16))
    flops, nbytes = 2.0 * m * n * k, x.numel() * 2 + w.data.numel() + w.scale.numel() + m * n * 2
    rows, first = [], None
    for label, tiles in PATHS.items():
        with with_tiles("linear", tiles), flashrt.use_backend("cuda"), flashrt.value_checks(False):
            call = lambda: linear.linear(x, w)
            try:
                out = call().float()
                torch.cuda.synchronize()
            except Exception as e:  # a tile set past the device's limits: recorded, the others still run
                rows.append({"path": label, "m": m, "n": n, "k": k, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"{m}x{n}x{k} {label:24s} failed: {rows[-1]['error'][:100]}", flush=True)
                continue
            first = out if first is None else first
            diff = float((out - first).norm() / first.norm())
            if not torch.isfinite(out).all() or diff > 1e-3:
                rows.append({"path": label, "m": m, "n": n, "k": k,
                             "error": f"differs from the plain kernel: relative difference {diff:.3g}"})
                print(f"{m}x{n}x{k} {label:24s} {rows[-1]['error']}", flush=True)
                continue
            t = common.bench_ms(call)
        r = common.row("linear fp8_w", f"M={m} N={n} K={k}", t, flops, nbytes, ceil, fp8_math=True,
                       baseline="torch._scaled_mm (per-tensor)", baseline_ms=base)
        rows.append({"path": label, "tiles": tiles, "m": m, "n": n, "k": k, "us": r["ms"] * 1e3,
                     "scaled_mm_us": r["baseline_ms"] * 1e3, "vs_scaled_mm": r["speedup_vs_baseline"],
                     "tflops": r["tflops"], "of_roofline": r["roofline_fraction"], "rel_diff_from_plain": diff})
        print(f"{m}x{n}x{k} {label:24s} {rows[-1]['us']:9.1f} us  {r['tflops']:7.1f} TFLOPS  "
              f"{r['speedup_vs_baseline']:.2f}x _scaled_mm ({rows[-1]['scaled_mm_us']:.1f} us)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096])
    ap.add_argument("--shapes", type=_shape, nargs="+", default=[(32768, 1280), (1280, 5120), (5120, 8192)],
                    metavar="NxK")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    if min(args.rows) < 1:
        ap.error(f"--rows: expected positive counts, got {args.rows}")
    ceil = common.Ceilings.measure()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [r for m in args.rows for n, k in args.shapes for r in _case(ceil, m, n, k, g)]
    write_json(args.out, {"device": torch.cuda.get_device_name(), "fp8_flops": ceil.fp8_flops,
                          "bf16_flops": ceil.bf16_flops, "copy_bytes_per_s": ceil.copy_bytes_per_s, "rows": rows})


if __name__ == "__main__":
    main()
