"""``flashrt tune``: sweep kernel tile spaces on this device and write a profile with the winners.

For each kernel in ``SPACES`` every combination of its candidate tile parameters runs the op on
the ``cuda`` backend with those tiles (a copy of the active profile with them merged in), is
checked against the reference (a candidate that is wrong never wins) and timed (median of
``triton.testing.do_bench`` on a GPU; a wall-clock median under the Triton interpreter). The
output YAML is the active profile with the winning tiles, each winner's time and the untuned
time as comments.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import torch
import yaml

from . import dispatch, ops, profiles
from .progress import Progress


def _attention(dev, small):
    B, K, T = (1, 24, 40) if small else (8, 640, 65536)
    H, D = (16, 64) if small else (64, 512)
    q = torch.randn(B, 1, H, D, device=dev).to(torch.bfloat16)
    kv = ops.quantize(torch.randn(B, T, D, device=dev), "fp4_b16")
    idx = torch.randint(0, T, (B, 1, K), device=dev, dtype=torch.int32)
    return "sparse_attention", (q, kv, idx, torch.zeros(H, device=dev), D ** -0.5)


def _indexer(dev, small):
    B, S, T = (1, 2, 256) if small else (8, 1, 131072)
    q = torch.randn(B, S, 32, 128, device=dev).to(torch.bfloat16)
    k = ops.quantize(torch.randn(B, T, 128, device=dev), "fp4_b32")
    return "index_scores", (q, k, torch.rand(B, S, 32, device=dev), torch.full((B, S), T, device=dev, dtype=torch.int32))


def _quant(dev, small):
    return "quantize", (torch.randn(64 if small else 16384, 512, device=dev).to(torch.bfloat16), "fp8")


def _norm(dev, small):
    n, d = (16, 1024) if small else (8192, 5120)
    return "rms_norm", (torch.randn(n, d, device=dev).to(torch.bfloat16), torch.ones(d, device=dev), 1e-6)


def _topk(dev, small):
    return "topk_positions", (torch.randn(2 if small else 64, 1, 512 if small else 131072, device=dev), 64 if small else 512)


# module -> (TILES key, candidate values per parameter, case)
SPACES = {
    "attention": ("attention", {"K_BLOCK": [16, 32], "num_stages": [1, 2], "num_warps": [4, 8]}, _attention),
    "indexer": ("index_scores", {"block_t": [64, 128, 256], "num_warps": [4, 8]}, _indexer),
    "quant": ("quantize", {"ELEMS": [2048, 4096, 8192], "num_warps": [2, 4, 8]}, _quant),
    "norm_rope": ("rms_norm", {"ROW_ELEMS": [2048, 4096], "num_warps": [4, 8, 16]}, _norm),
    "topk": ("select", {"num_warps": [4, 8], "summary": [2048, 4096]}, _topk),
}


def _time_ms(fn, gpu: bool) -> float:
    if gpu:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _with_tiles(base, module: str, key: str, values: dict):
    tiles = {m: dict(t) for m, t in base.tiles.items()}
    current = profiles.tiles(module, _module_tiles(module))[key]
    tiles.setdefault(module, {})[key] = {**current, **values}
    return dataclasses.replace(base, tiles=tiles)


def _module_tiles(module: str) -> dict:
    import importlib

    return importlib.import_module(f"flashrt.kernels_cuda.{module}").TILES


def _close(got, want) -> bool:
    if isinstance(got, torch.Tensor) and not torch.is_floating_point(got):
        return torch.equal(got, want)
    if hasattr(got, "data") and hasattr(got, "fmt"):
        return torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    g, w = got.double(), want.double()
    fin = torch.isfinite(w)
    return bool(torch.equal(torch.isfinite(g), fin)) and float((g[fin] - w[fin]).norm() / w[fin].norm().clamp_min(1e-30)) < 2e-2


def tune_kernel(module: str, base, dev, small: bool, step) -> dict:
    key, space, case = SPACES[module]
    op, args = case(dev, small)
    fn = getattr(ops, op)
    with dispatch.use_backend("reference"):
        want = fn(*args)
    results = []
    for combo in itertools.product(*space.values()):
        values = dict(zip(space, combo))
        with profiles.using(_with_tiles(base, module, key, values)), dispatch.use_backend("cuda"):
            ok = _close(fn(*args), want)
            ms = _time_ms(lambda: fn(*args), dev.type == "cuda") if ok else float("inf")
        results.append((ms, values))
        step()
    with profiles.using(base), dispatch.use_backend("cuda"):
        untuned = _time_ms(lambda: fn(*args), dev.type == "cuda")
    best_ms, best = min(results, key=lambda r: r[0])
    return {"module": module, "key": key, "winner": best, "ms": best_ms, "untuned_ms": untuned,
            "candidates": len(results), "rejected": sum(r[0] == float("inf") for r in results)}


def tune(kernels=None, small: bool | None = None, progress=None) -> tuple[object, list[dict]]:
    """Tune ``kernels`` (default: all of SPACES); returns (tuned Profile, per-kernel results)."""
    kernels = list(kernels or SPACES)
    unknown = sorted(set(kernels) - set(SPACES))
    if unknown:
        raise ValueError(f"kernels: expected names from {sorted(SPACES)}, got {unknown}")
    ok, why = dispatch.availability("cuda") if "cuda" in dispatch.backends() else (False, "not registered")
    if not ok:
        raise ValueError(f"kernels: the cuda backend is not available here ({why})")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = dev.type != "cuda" if small is None else small
    base = profiles.active_profile()
    total = sum(len(list(itertools.product(*SPACES[k][1].values()))) for k in kernels)
    done = [0]

    def step():
        done[0] += 1
        if progress:
            progress(done[0], total)

    results = [tune_kernel(k, base, dev, small, step) for k in kernels]
    tuned = base
    for r in results:
        tuned = _with_tiles(tuned, r["module"], r["key"], r["winner"])
    return tuned, results


def write_profile(profile, results: list[dict], path: str) -> None:
    lines = [f"# tuned by `flashrt tune` on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}"]
    for r in results:
        lines.append(f"# {r['module']}.{r['key']}: {r['winner']} {r['ms'] * 1e3:.1f} us "
                     f"(untuned {r['untuned_ms'] * 1e3:.1f} us, {r['untuned_ms'] / r['ms']:.2f}x; "
                     f"{r['candidates']} candidates, {r['rejected']} rejected as wrong)")
    data = {k: v for k, v in profile.to_dict().items()}
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n" + yaml.safe_dump(data, sort_keys=False))


def cmd(args) -> int:
    tuned, results = tune(args.kernels, progress=Progress("tuning"))
    write_profile(tuned, results, args.out)
    for r in results:
        print(f"{r['module']:10} {r['key']:14} {r['winner']}  {r['ms'] * 1e3:9.1f} us  "
              f"untuned {r['untuned_ms'] * 1e3:9.1f} us  ({r['untuned_ms'] / r['ms']:.2f}x)")
    print(f"wrote {args.out}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="sweep kernel tiles on this device; write a profile with the winners")
    p.add_argument("--out", required=True, help="profile YAML to write")
    p.add_argument("--kernels", nargs="+", default=None, help=f"subset of {sorted(SPACES)}")
    p.set_defaults(func=cmd)
