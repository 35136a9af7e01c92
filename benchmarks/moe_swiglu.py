"""The grouped experts' SwiGLU (prefill, ``tiles.moe.grouped_min_rows``) as one launch against the
torch composition it replaced, in one run.

    python benchmarks/moe_swiglu.py --out F

Per case (a model's prefill of ``--rows`` x ``--tokens`` tokens: its (token, slot) pair rows plus
one shared-expert row a token, ``moe_inter_dim`` columns): the gate ‖ up sums in bf16 and the row
weights, then ``moe_grouped.swiglu_fp8`` (SwiGLU, bf16 rounding, fp8 per 32 and back, one launch)
and the torch ops it replaced (fp32 copies of both halves, clamps, ``silu``, two products, the cast,
``act_quant`` and ``dequantize``). Microseconds a call (``flashrt.timing.bench_ms``: CUDA-graph
replays behind an L2 flush), the bytes the fused launch must move (gu read, h written) over the
device-to-device copy rate of the same run, and the share of outputs that differ (the two compute
``exp`` differently in the last fp32 bit).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import flashrt
from flashrt.graphs.config import shipped_config
from flashrt.kernels_cuda import moe, moe_grouped
from flashrt.kernels_cuda.linear import fp8_rows_bf16
from flashrt.timing import bench_ms
from real_slice import copy_bandwidth
from results_io import write_json


def composed(gu: torch.Tensor, rw: torch.Tensor, limit: float) -> torch.Tensor:
    """The torch ops the fused launch replaced."""
    I = gu.shape[1] // 2
    g, u = gu[:, :I].float(), gu[:, I:].float()
    if limit > 0:
        g, u = g.clamp_max(limit), u.clamp(-limit, limit)
    return fp8_rows_bf16((F.silu(g) * u * rw[:, None]).to(torch.bfloat16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["small", "v4.1-flash"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(dev)
    out = []
    with flashrt.use_backend("cuda"):
        tile = moe.PLANS.tiles()["swiglu"]
        for name in args.models:
            cfg = shipped_config(name)
            n = args.rows * args.tokens
            rows, I = n * (cfg.n_activated_experts + cfg.n_shared_experts), cfg.moe_inter_dim
            gu = (torch.randn(rows, 2 * I, device=dev, generator=g) * 4.0).to(torch.bfloat16)
            rw = torch.rand(rows, device=dev, generator=g)
            limit = float(cfg.swiglu_limit)
            fused, torch_ops = moe_grouped.swiglu_fp8(gu, rw, limit, tile), composed(gu, rw, limit)
            differ = float((fused != torch_ops).float().mean())
            t_fused = bench_ms(lambda: moe_grouped.swiglu_fp8(gu, rw, limit, tile)).ms * 1e3
            t_torch = bench_ms(lambda: composed(gu, rw, limit)).ms * 1e3
            floor = (gu.numel() * 2 + rows * I * 2 + rows * 4) / bw * 1e6
            out.append({"model": name, "rows": rows, "I": I, "fused_us": t_fused, "torch_us": t_torch,
                        "speedup": t_torch / t_fused, "floor_us": floor, "fused_of_floor": floor / t_fused,
                        "share_differing": differ})
            print(f"{name:12s} {rows:7d} x {I}: fused {t_fused:9.1f} us  torch {t_torch:9.1f} us  "
                  f"{t_torch / t_fused:5.2f}x  floor {floor:7.1f} us ({100 * floor / t_fused:.0f}%)  "
                  f"differing {100 * differ:.3f}%", flush=True)
            del gu, rw, fused, torch_ops
    write_json(args.out, {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw, "tokens": args.tokens,
                          "cases": out})


if __name__ == "__main__":
    main()
