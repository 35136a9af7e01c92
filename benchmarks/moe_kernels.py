"""The kernels of one ``moe_experts`` call at the released shapes (384 fp4 experts, top 6, D 5,120, I 2,304,
the fp8 shared expert), by kernel: each one's device time a call under the active profile and under
variants of its experts rule (the same knobs as ``benchmarks/gemv_tiles.py``'s ``EXPERT_MMA_VARIANTS``).

    python benchmarks/moe_kernels.py [--tokens 1 8] [--variant LABEL ...] [--out FILE.json]

The call is captured in a CUDA graph and replayed ``--calls`` times under ``torch.profiler``, each replay
behind an L2 flush (a write of a buffer larger than the L2, whose own kernel is left out); a kernel's time
is its summed device time over the replays divided by their number. The weights are
``gemv_tiles.random_experts`` and ``random_shared`` laid out as the h200 profile loads them (scales K
major, codes in words, the largest scale bytes recorded).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemv_tiles  # noqa: E402

import flashrt  # noqa: E402
from flashrt import ops, profiles  # noqa: E402
from flashrt.graphs.config import shipped_config  # noqa: E402


def kernel_times(call, calls: int) -> dict[str, float]:
    """µs a call of each kernel ``call`` launches (graph replays behind an L2 flush)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    total: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "fill" not in ev.name.lower():
            total[ev.name] += ev.device_time / calls
    return dict(total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--variant", nargs="*", default=list(gemv_tiles.EXPERT_MMA_VARIANTS)[:2],
                    help="labels of gemv_tiles.EXPERT_MMA_VARIANTS to time beside the profile")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    cfg, dev, g = shipped_config("v4.1-flash"), torch.device("cuda"), torch.Generator().manual_seed(0)
    E, k, D = cfg.n_routed_experts, cfg.n_activated_experts, cfg.dim
    w1, w3, w2 = gemv_tiles.random_experts(cfg, dev, True, True)
    shared = gemv_tiles.random_shared(cfg, dev, g, True)
    rows = []
    with flashrt.use_backend("cuda"), flashrt.value_checks(False):
        for n in args.tokens:
            x = torch.randn(n, D, generator=g).to(dev, torch.bfloat16)
            idx = torch.rand(n, E, generator=g).topk(k).indices.to(dev, torch.int32)
            rw = torch.rand(n, k, generator=g).to(dev)
            call = lambda: ops.moe_experts(x, rw, idx, w1, w3, w2, 10.0, None, torch.bfloat16, shared)  # noqa: E731
            for label in ["profile", *args.variant]:
                tile = None if label == "profile" else gemv_tiles.tweaked(
                    "moe", "experts", 1, gemv_tiles.EXPERT_MMA_VARIANTS[label])
                with gemv_tiles.with_rule("moe", "experts", 1, tile, None):
                    profiles._TILES_CACHE.clear()
                    times = kernel_times(call, args.calls)
                rows.append({"tokens": n, "variant": label, "kernels_us": times, "sum_us": sum(times.values())})
                print(f"tokens {n:2d}  {label[:60]:60s} {sum(times.values()):8.1f} us over {len(times)} kernels")
                for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
                    print(f"      {us:8.1f} us  {name[:90]}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
