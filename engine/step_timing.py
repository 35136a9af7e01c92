"""Where a serving step's time goes: wall time per phase (decode forward, prefill forwards, prefix
snapshots of the prompts, sampling and the host work after it, the joins of prefilled rows into
the decode batch), plus, when asked (``EngineConfig(device_timing=True)``), device time of the
decode and prefill forwards on CUDA.

With device timing on, each phase also counts the caching allocator's slow paths
(``torch.cuda.memory_stats``: ``cudaMalloc`` calls, failed ones retried after freeing the cache,
which synchronizes the device, and whole-device syncs to free blocks; pinned host allocations from
``torch.cuda.host_memory_stats``): a phase that waits for the device without reading a value
shows it there.

Device times come from CUDA events recorded around each phase and read at the end of the step,
which waits for the last event: a host sync in every step (a step that samples has synchronized
with the device already, a step that does not would stall here). So device timing is off unless
asked for (benchmarks); plain serving records no events. Counters accumulate into the engine's
``counters`` dict (``/metrics``, benchmarks).
"""
from __future__ import annotations

import time

import torch

PHASES = ("decode", "prefill", "prefix", "sample", "join")
DEVICE_PHASES = ("decode", "prefill")  # the phases whose device time is kept (the others wait for it)
# the allocator's counters a phase's delta is reported for (memory_stats keys, then host_memory_stats')
ALLOC_KEYS = ("num_device_alloc", "num_alloc_retries", "num_sync_all_streams")
HOST_ALLOC_KEYS = ("num_host_alloc",)


def alloc_counts() -> tuple[int, ...]:
    """The allocator counters of :data:`ALLOC_KEYS` and :data:`HOST_ALLOC_KEYS`, now (host reads only)."""
    # the nested forms: these counters are top-level keys there, and the flattened dicts that
    # memory_stats() builds in Python cost ~0.4 ms a call (several a step)
    dev = torch.cuda.memory_stats_as_nested_dict()
    nested_host = getattr(torch.cuda, "host_memory_stats_as_nested_dict", None)
    host = nested_host() if nested_host is not None else {}
    return tuple(int(dev.get(k, 0)) for k in ALLOC_KEYS) + tuple(int(host.get(k, 0)) for k in HOST_ALLOC_KEYS)


class StepTimer:
    def __init__(self, device: torch.device, device_timing: bool = False):
        """``device_timing``: also record CUDA events and add the forwards' device time (CUDA only)."""
        self.cuda = device_timing and device.type == "cuda"
        self.marks: list = []
        self.allocs: dict = {}  # the last stopped step's allocator deltas by phase (device timing only)

    def start(self) -> "StepTimer":
        self.marks = [("start", time.perf_counter(), self._event())]
        return self

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.perf_counter(), self._event()))

    def _event(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev, alloc_counts()

    def stop(self, counters: dict, decode_rows: int, prefill_tokens: int) -> tuple[dict, dict]:
        """Add this step's times and sizes to ``counters``; returns this step's milliseconds per phase
        (host wall time, and device time of the timed phases when device timing is on)."""
        self.mark("end")
        marks = self.marks
        counters["step_seconds"] += marks[-1][1] - marks[0][1]
        counters["decode_rows"] += decode_rows
        counters["prefill_step_tokens"] += prefill_tokens
        counters["decode_steps"] += bool(decode_rows)
        host, device, self.allocs = {}, {}, {}
        for (phase, t0, e0), (_, t1, e1) in zip(marks, marks[1:]):
            if phase not in PHASES:
                continue
            counters[f"{phase}_seconds"] += t1 - t0
            host[phase] = host.get(phase, 0.0) + (t1 - t0) * 1e3
            if e0 is None:
                continue
            if phase in DEVICE_PHASES:
                e1[0].synchronize()
                ms = e0[0].elapsed_time(e1[0])
                counters[f"{phase}_device_seconds"] += ms / 1e3
                device[phase] = device.get(phase, 0.0) + ms
            delta = [b - a for a, b in zip(e0[1], e1[1])]
            if any(delta):
                old = self.allocs.get(phase, [0] * len(delta))
                self.allocs[phase] = [a + b for a, b in zip(old, delta)]
        return host, device


COUNTERS = ("step_seconds", "decode_rows", "prefill_step_tokens", "decode_steps", "prefill_forwards",
            *(f"{p}_seconds" for p in PHASES), *(f"{p}_device_seconds" for p in DEVICE_PHASES))
