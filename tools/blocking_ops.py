"""Which tensor operations of the KV row moves wait for the device: each statement of
``KVState.take_rows`` / ``_reset_rows`` / ``rewind_rows`` timed on the host while the GPU is busy
with a long kernel (``torch.cuda._sleep``); a statement that takes about the kernel's length
blocked on it.

    python tools/blocking_ops.py [--model small] [--rows 64] [--sleep-ms 50]
"""
from __future__ import annotations

import argparse
import time

import torch

from flashrt.graphs.config import shipped_config
from flashrt.kv.state import KVState


def cycles_per_ms() -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--sleep-ms", type=float, default=50.0)
    args = ap.parse_args()
    cfg, dev = shipped_config(args.model), torch.device("cuda")
    state = KVState(cfg, args.rows, 1024, dev)
    other = KVState(cfg, args.rows, 1024, dev, pool=state.pool)
    per_ms = cycles_per_ms()
    rows = list(range(0, args.rows, 2))
    idx_host = torch.tensor(rows, dtype=torch.long)
    idx = idx_host.pin_memory().to(dev, non_blocking=True)
    c = next(iter(state.compressed.values()))
    cases = {
        "index from pinned, non_blocking": lambda: idx_host.pin_memory().to(dev, non_blocking=True),
        "torch.tensor(list).pin_memory()": lambda: torch.tensor(rows, dtype=torch.long).pin_memory(),
        "positions[idx] = 0": lambda: state.positions.__setitem__(idx, 0),
        "positions[idx] = other.positions[idx]": lambda: state.positions.__setitem__(idx, other.positions[idx]),
        "engram_history[idx] = -1": lambda: state.engram_history.__setitem__(idx, -1),
        "ring_start_store[:, idx] = 0": lambda: state._ring_start_store.__setitem__((slice(None), idx), 0)
        if state._ring_start_store is not None else None,
        "kv_state[idx] = 0.0": lambda: c.kv_state.__setitem__(idx, 0.0) if c.kv_state is not None else None,
        "score_state[idx] = -inf": lambda: c.score_state.__setitem__(idx, float("-inf"))
        if c.score_state is not None else None,
        "positions.index_fill_(0, idx, 0)": lambda: state.positions.index_fill_(0, idx, 0),
        "kv_state.index_fill_(0, idx, 0.0)": lambda: c.kv_state.index_fill_(0, idx, 0.0)
        if c.kv_state is not None else None,
        "take_rows (all rows)": lambda: state.take_rows(rows, other, rows),
        "rewind_rows": lambda: state.rewind_rows(rows),
    }
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(int(args.sleep_ms * per_ms))
        end.record()
        t0 = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        busy = start.elapsed_time(end)
        verdict = "WAITS for the device" if host_ms > busy / 4 else "async"
        print(f"{name:42s} {host_ms:8.3f} ms on the host (GPU busy {busy:.1f} ms)  {verdict}", flush=True)


if __name__ == "__main__":
    main()
