"""What a process's first cached kernel load waits for: Triton's own cache key (``triton_key``, a
hash of its sources and library, once a process) against a later cache hit.

    python benchmarks/triton_key_cost.py [--family kv_store] [--out F]

Compiles the variants ``flashrt jit`` plans for one kernel family (sm_90, the h200 profile,
``small``'s dims; cross-compiled with ``ptxas``, no GPU needed) into a fresh compile cache, then in
a new process loads them all from that cache: the first load (``triton_key`` included), each later
one, and, in a third process, ``triton_key`` alone. No device: the compile path up to the binary.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from results_io import write_json

CHILD = r"""
import json, os, sys, time
from flashrt.jit import install
install()
from flashrt import profiles
from flashrt.jit_compile import launch_sources
from flashrt.jit_parallel import compile_spec, plan
from flashrt.jit_targets import ARCHS
from flashrt.kernels_cuda.warmup import MODELS
mode, family = sys.argv[1], sys.argv[2]
if mode == "key":
    from triton.runtime.cache import triton_key
    t0 = time.perf_counter(); triton_key(); print(json.dumps({"triton_key_s": time.perf_counter() - t0})); sys.exit()
sources = [s for s in launch_sources() if s[0] == family]
specs, _ = plan(ARCHS["sm_90"], profiles.load_profile("h200"), {"small": MODELS["small"]}, sources, plans=False)
times = []
for s in specs:
    t0 = time.perf_counter(); row = compile_spec(s); times.append(time.perf_counter() - t0)
    assert row["status"] == "compiled", row
print(json.dumps({"variants": len(specs), "seconds": times}))
"""


def child(mode: str, family: str, cache: str) -> dict:
    env = {**os.environ, "FLASHRT_CACHE_DIR": cache, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, family], env=env, capture_output=True, text=True,
                         check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="kv_store", help="the kernel family whose variants are compiled")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold = child("compile", args.family, cache)
        warm = child("compile", args.family, cache)
        key = child("key", args.family, cache)
    if warm["variants"] < 2:
        sys.exit(f"--family {args.family}: expected at least 2 planned variants, got {warm['variants']}")
    first, later = warm["seconds"][0], warm["seconds"][1:]
    result = {"family": args.family, "variants": warm["variants"], "cold_compile_s": sum(cold["seconds"]),
              "first_hit_s": first, "later_hit_median_s": sorted(later)[len(later) // 2],
              "triton_key_s": key["triton_key_s"], "command": f"python benchmarks/triton_key_cost.py --family "
                                                               f"{args.family}", "warm_seconds": warm["seconds"]}
    print(f"{args.family}: {warm['variants']} variants; first cache hit {first * 1e3:.0f} ms, later hits "
          f"{result['later_hit_median_s'] * 1e3:.1f} ms (median); triton_key alone {key['triton_key_s'] * 1e3:.0f} ms")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
