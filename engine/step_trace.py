"""``FLASHRT_STEP_TRACE=FILE``: one JSON line per engine step while the loop runs, for finding where
serving time goes between steps (arrivals, grouping, idle gaps) rather than inside them.

Each line: ``t`` (the step's start, Unix time in seconds: lines line up with a client's clock), ``ms`` (the step's wall
time), ``idle_ms`` (wall time since the previous step ended: the loop waited for requests or
applied commands), ``decode`` (rows in the decode batch), ``prefill`` (``[rows, tokens]`` of each
prefill forward), ``waiting`` (sequences still queued after planning), ``arrived`` (requests added
since the previous step), ``phase_ms`` (host wall time of the step's phases: ``decode``,
``prefill``, ``prefix`` (prompt snapshots for the prefix cache), ``sample``, ``join``; see
:mod:`.step_timing`) and, with device timing on, ``device_ms`` (device time of the decode and
prefill forwards) and ``allocs`` (per phase, the allocator's slow paths that phase took, where
any: ``cudaMalloc`` calls, retries after freeing the cache, whole-device syncs, pinned host
allocations). The file must not exist yet (nothing is overwritten); lines are written
in blocks, whenever the loop goes idle and when it stops, so a killed process keeps all but its
last block.
"""
from __future__ import annotations

import json
import time

from .loop_profile import new_file_from_env

ALLOC_NAMES = ("cuda_malloc", "alloc_retries", "sync_all_streams", "host_alloc")  # step_timing.alloc_counts' order

ENV = "FLASHRT_STEP_TRACE"
_BLOCK = 256  # lines kept before a write


def trace_path() -> str | None:
    """The file to write, checked; None when tracing is off."""
    return new_file_from_env(ENV)


class StepTrace:
    def __init__(self, path: str):
        self.file = open(path, "x", encoding="utf-8")  # "x": never an existing file
        self.t0 = time.time() - time.perf_counter()  # Unix time at perf_counter 0
        self.last_end: float | None = None
        self.lines: list[str] = []

    def record(self, start: float, end: float, decode: int, groups: list[tuple[int, int]], waiting: int,
               arrived: int, phase_ms: dict | None = None, device_ms: dict | None = None,
               allocs: dict | None = None) -> None:
        """One step: ``start`` / ``end`` from ``time.perf_counter``; ``groups``: (rows, tokens) per
        prefill forward; ``phase_ms`` / ``device_ms``: milliseconds per phase (``StepTimer.stop``);
        ``allocs``: the allocator counter deltas per phase (``StepTimer.allocs``)."""
        idle = 0.0 if self.last_end is None else start - self.last_end
        self.last_end = end
        line = {"t": round(self.t0 + start, 6), "ms": round((end - start) * 1e3, 3), "idle_ms": round(idle * 1e3, 3),
                "decode": decode, "prefill": [list(g) for g in groups], "waiting": waiting, "arrived": arrived,
                "phase_ms": {k: round(v, 3) for k, v in (phase_ms or {}).items()}}
        if device_ms:
            line["device_ms"] = {k: round(v, 3) for k, v in device_ms.items()}
        if allocs:
            line["allocs"] = {phase: dict(zip(ALLOC_NAMES, counts)) for phase, counts in allocs.items()}
        self.lines.append(json.dumps(line))
        if len(self.lines) >= _BLOCK:
            self.flush()

    def flush(self) -> None:
        if self.lines:
            self.file.write("\n".join(self.lines) + "\n")
            self.file.flush()
            self.lines = []

    def close(self) -> None:
        self.flush()
        self.file.close()


def read(path: str) -> list[dict]:
    """The steps of a trace file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(steps: list[dict]) -> dict:
    """What a span of steps did: counts, wall and idle time, decode rows, the prefill forwards by
    their row count (``{rows: forwards}``) with the mean step time of steps that ran each, and the
    seconds per phase (host, and device where timed)."""
    if not steps:
        return {"steps": 0}
    by_rows: dict[int, list[float]] = {}
    for s in steps:
        for rows, _ in s["prefill"]:
            by_rows.setdefault(rows, []).append(s["ms"])
    decode_only = [s["ms"] for s in steps if s["decode"] and not s["prefill"]]
    return {
        "steps": len(steps),
        "span_s": round(steps[-1]["t"] + steps[-1]["ms"] / 1e3 - steps[0]["t"], 4),
        "step_s": round(sum(s["ms"] for s in steps) / 1e3, 4),
        "idle_s": round(sum(s["idle_ms"] for s in steps[1:]) / 1e3, 4),
        "mean_decode": round(sum(s["decode"] for s in steps) / len(steps), 2),
        "decode_only_steps": len(decode_only),
        "decode_only_ms_mean": round(sum(decode_only) / len(decode_only), 3) if decode_only else None,
        "prefill_forwards": {rows: len(ms) for rows, ms in sorted(by_rows.items())},
        "prefill_step_ms_mean": {rows: round(sum(ms) / len(ms), 2) for rows, ms in sorted(by_rows.items())},
        "arrived": sum(s["arrived"] for s in steps),
        "phase_s": _phase_sums(steps, "phase_ms"),
        "device_s": _phase_sums(steps, "device_ms"),
        "allocs": _alloc_sums(steps),
    }


def _phase_sums(steps: list[dict], field: str) -> dict:
    """Seconds per phase over the steps (traces written before phases were recorded have none)."""
    out: dict[str, float] = {}
    for s in steps:
        for k, v in s.get(field, {}).items():
            out[k] = out.get(k, 0.0) + v / 1e3
    return {k: round(v, 4) for k, v in out.items()}


def _alloc_sums(steps: list[dict]) -> dict:
    """The allocator counters per phase summed over the steps (only phases and counters seen)."""
    out: dict[str, dict[str, int]] = {}
    for s in steps:
        for phase, counts in s.get("allocs", {}).items():
            for k, v in counts.items():
                if v:
                    out.setdefault(phase, {})[k] = out.get(phase, {}).get(k, 0) + v
    return out
