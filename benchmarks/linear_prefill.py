"""fp8_w ``linear`` of a prefill chunk (the released projections at thousands of rows) under the linear rule's
``qgmma`` knob (kernels_cuda/linear_qgmma.py) and the profile's paths, against ``torch._scaled_mm``, in one run.

    python benchmarks/linear_prefill.py --out F [--rows 4096] [--variants LABEL ...]

Per projection (out x in: wq_a 1,280 x 5,120, the shared expert's w1 2,304 x 5,120, wo_b 5,120 x 8,192, wq_b
32,768 x 1,280; bf16 x of ``--rows`` rows, random fp8_w weights): microseconds a call of the op under the
active profile ("profile"), under it with the bf16 GEMM tile off (the rule's MMA tile), and with each
``qgmma`` variant put in front of the linear rules (``flashrt.timing.bench_ms``: CUDA-graph replays behind an
L2 flush); ``torch._scaled_mm`` on e4m3 operands with per-tensor scales (no per-32 scaling: the target's
baseline, ``flashrt.bench.gemm.scaled_mm_timing``) and each variant's fraction of its rate; the norm of each
output's difference from the reference backend's over the reference's norm.
"""
from __future__ import annotations

import argparse

import torch

import flashrt
from flashrt import formats, ops, profiles
from flashrt.bench.gemm import LINEAR_FP8, scaled_mm_timing
from flashrt.timing import bench_ms
from gemv_tiles import with_rule
from results_io import write_json


def qgmma(tokens: int, warps: int, stages: int, **knobs) -> dict:
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, qgmma=True, qgmma_tokens=tokens,
                qgmma_warps=warps, qgmma_stages=stages, **knobs)


# label -> (a rule for every row count or None, {family: tiles entries} merged or None)
VARIANTS = {"the rule's MMA tile (no bf16 GEMM)": (None, {"linear": {"bf16_gemm_min_rows": None}})}
for _t, _w, _s in ((64, 8, 3), (64, 8, 4), (32, 8, 3), (64, 4, 3), (128, 8, 2)):
    VARIANTS[f"qgmma, {_t} rows, {_w} warps, {_s} stages"] = (qgmma(_t, _w, _s), None)
# one MMA in flight at a time and 128 registers a thread: two programs of 8 warps an SM
VARIANTS["qgmma, 64 rows, 8 warps, 3 stages, one in flight, 128 registers"] = (
    qgmma(64, 8, 3, qgmma_inflight=1, qgmma_maxnreg=128), None)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--variants", nargs="+", default=None, metavar="LABEL", choices=sorted(VARIANTS),
                    help="only these variants (and the profile); default: all")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.rows < 1:
        ap.error(f"--rows: expected a positive count, got {args.rows}")
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    g, dev = torch.Generator(device="cuda").manual_seed(0), torch.device("cuda")
    chosen = {k: v for k, v in VARIANTS.items() if not args.variants or k in args.variants}
    rows = []
    for n, k in LINEAR_FP8:
        x = torch.randn(args.rows, k, device=dev, generator=g).to(torch.bfloat16)
        w = formats.quantize(torch.randn(n, k, device=dev, generator=g) * 0.05, "fp8_w")
        with flashrt.use_backend("reference"):
            want = ops.linear(x, w)
        base = 1e3 * scaled_mm_timing(x, w).ms
        case = f"M={args.rows} out={n} in={k}"
        rows.append({"case": case, "variant": "torch._scaled_mm (per tensor)", "us_per_call": base})
        print(f"{case:28s} {'torch._scaled_mm (per tensor)':40s} {base:9.1f} us", flush=True)
        with flashrt.use_backend("cuda"), flashrt.value_checks(False):
            for label, (rule, extra) in {"profile": (None, None), **chosen}.items():
                with with_rule("linear", "linear", None, rule, extra):
                    profiles._TILES_CACHE.clear()
                    call = lambda: ops.linear(x, w)  # noqa: E731
                    try:
                        out = call()
                        us = 1e3 * bench_ms(call).ms
                    except Exception as e:  # a variant that does not compile or fit: recorded, not fatal
                        rows.append({"case": case, "variant": label, "error": f"{type(e).__name__}: {e}"[:300]})
                        print(f"{case:28s} {label:40s} failed: {rows[-1]['error'][:100]}", flush=True)
                        continue
                rows.append({"case": case, "variant": label, "us_per_call": us, "of_scaled_mm": base / us,
                             "rel_diff_from_reference": _rel(out, want)})
                print(f"{case:28s} {label:40s} {us:9.1f} us  {base / us:5.2f}x _scaled_mm  "
                      f"diff {rows[-1]['rel_diff_from_reference']:.2g}", flush=True)
    profiles._TILES_CACHE.clear()
    write_json(args.out, {"device": torch.cuda.get_device_name(), "rows": args.rows, "results": rows})


if __name__ == "__main__":
    main()
