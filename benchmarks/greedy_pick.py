"""Greedy sampling of a decode step's logits: ``flashrt.ops.sample(logits, 0)`` on the CUDA backend
(the split argmax of kernels_cuda/sample.py) against ``torch.argmax`` of the same rows, one run.

    python benchmarks/greedy_pick.py --out F

Rows ``[B, V]`` of fp32 logits (the head's output dtype) at the model's vocabulary; microseconds a
call by ``flashrt.timing.bench_ms`` (CUDA-graph replays, each behind an L2 flush); the floor is the
row bytes read once at the device-to-device copy bandwidth measured in the same run.
Each pick is checked equal to ``torch.argmax`` first.
"""
from __future__ import annotations

import argparse

import torch

import flashrt
from flashrt import ops
from flashrt.timing import bench_ms
from results_io import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    g, rows = torch.Generator(device="cuda").manual_seed(0), []
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB: copy read + write
    dst = torch.empty_like(src)
    copy_bps = 2 * src.numel() * 4 / (bench_ms(lambda: dst.copy_(src)).ms * 1e-3)
    del src, dst
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for B in args.batches:
            x = torch.randn(B, args.vocab, device="cuda", generator=g).to(dtype)
            with flashrt.use_backend("cuda"):
                if not torch.equal(ops.sample(x, 0.0), x.argmax(-1)):
                    raise SystemExit(f"greedy pick differs from torch.argmax at B={B}, {name}")
                ours = bench_ms(lambda: ops.sample(x, 0.0)).ms * 1e3
            base = bench_ms(lambda: x.argmax(-1)).ms * 1e3
            floor = x.numel() * x.element_size() / copy_bps * 1e6
            rows.append({"batch": B, "dtype": name, "vocab": args.vocab, "split_argmax_us": ours,
                         "torch_argmax_us": base, "speedup": base / ours, "floor_us": floor})
            print(f"B={B:3d} {name:9s} split argmax {ours:7.2f} us  torch.argmax {base:7.2f} us  "
                  f"{base / ours:5.2f}x  (floor {floor:.2f} us)", flush=True)
    write_json(args.out, {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bps, "rows": rows})


if __name__ == "__main__":
    main()
