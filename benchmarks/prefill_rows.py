"""What a prefill forward costs per token as its row count grows: the serving engine runs a prompt
chunk of ``n`` tokens for a group of ``R`` rows as one ``[R, n]`` forward, ``generate()`` the whole
batch at once.

    python benchmarks/prefill_rows.py --model small --rows 1 4 16 64 --tokens 512 --out F

For each row count: the wall time of a forward in a fresh state (synchronized, median of
``--repeat`` after one untimed forward that compiles its kernels), and the GPU time of one forward
(torch profiler: the sum of its kernels, and their number). Wall time well above GPU time is host
work (launches, Python); GPU time per token that falls with ``R`` is kernels that only fill the
device at many rows. With ``--graphs`` (default), also the wall time of the same forward replayed
from a CUDA graph (``engine/prefill_capture.py``: a reusable state, its rows emptied before each
call as the serving engine empties them; the first call captures, untimed) and the ratio of the
two wall times.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashrt
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.engine.prefill_capture import PrefillCapture
from flashrt.graphs.model import Model
from decode_profile import kernel_times
from results_io import write_json


def synced_seconds(run) -> float:
    """Wall seconds of ``run()`` with the device idle before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def graph_wall(model, ids: torch.Tensor, repeat: int) -> float:
    """Median wall seconds of ``ids``' forward replayed by a :class:`PrefillCapture` (synchronized)."""
    rows, n = ids.shape
    state = model.new_state(rows, n + 8)
    runner = PrefillCapture(model, state)

    def once():
        for row in range(rows):
            state.release_row(row)
        return synced_seconds(lambda: runner.forward(ids))

    once()  # captured
    wall = statistics.median(once() for _ in range(repeat))
    if runner.stats["replayed"] != repeat:
        raise RuntimeError(f"the prefill graph did not replay: {runner.stats}")
    return wall


def forward_costs(model, rows: int, n: int, repeat: int, graphs: bool = True) -> dict:
    ids = torch.randint(0, model.cfg.vocab_size, (rows, n), device=model.device)

    def once():
        state = model.new_state(rows, n + 8)
        return synced_seconds(lambda: model.forward(ids, state=state))

    once()
    wall = statistics.median(once() for _ in range(repeat))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        once()
    kernels = kernel_times(prof, 1)
    graph = graph_wall(model, ids, repeat) if graphs else None
    gpu_ms = sum(k["us_per_step"] for k in kernels) / 1e3
    return {"rows": rows, "tokens": rows * n, "wall_ms": 1e3 * wall, "gpu_ms": gpu_ms,
            "launches": sum(k["launches_per_step"] for k in kernels),
            "wall_us_per_token": 1e6 * wall / (rows * n), "gpu_us_per_token": 1e3 * gpu_ms / (rows * n),
            "graph_wall_ms": None if graph is None else 1e3 * graph,
            "graph_speedup": None if graph is None else wall / graph,
            "top_kernels": kernels[:12]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens per row")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the forward replayed from a CUDA graph")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device="cuda"))
    out = []
    with flashrt.value_checks(False):
        for rows in args.rows:
            r = forward_costs(model, rows, args.tokens, args.repeat, args.graphs)
            out.append(r)
            print(f"[{rows}, {args.tokens}]: wall {r['wall_ms']:.1f} ms ({r['wall_us_per_token']:.2f} us/token), "
                  f"GPU {r['gpu_ms']:.1f} ms ({r['gpu_us_per_token']:.2f} us/token) over {r['launches']:.0f} kernels"
                  + (f"; from a CUDA graph {r['graph_wall_ms']:.1f} ms ({r['graph_speedup']:.2f}x)" if args.graphs else ""),
                  flush=True)
            for k in r["top_kernels"][:8]:
                print(f"    {k['us_per_step'] / 1e3:8.2f} ms x{k['launches_per_step']:4.0f}  {k['kernel'][:80]}")
    if args.out:
        write_json(args.out, {"model": args.model, "device": torch.cuda.get_device_name(), "tokens_per_row": args.tokens,
                              "rows": out})


if __name__ == "__main__":
    main()
