"""Where a serving step's time goes: wall time per phase (decode forward, prefill forwards, prefix
snapshots of the prompts, sampling and the host work after it, the joins of prefilled rows into
the decode batch), plus, when asked (``EngineConfig(device_timing=True)``), device time of the
decode and prefill forwards on CUDA.

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


class StepTimer:
    def __init__(self, device: torch.device, device_timing: bool = False):
        """``device_timing``: also record CUDA events and add the forwards' device time (CUDA only)."""
        self.cuda = device_timing and device.type == "cuda"
        self.marks: list = []

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
        return ev

    def stop(self, counters: dict, decode_rows: int, prefill_tokens: int) -> tuple[dict, dict]:
        """Add this step's times and sizes to ``counters``; returns this step's milliseconds per phase
        (host wall time, and device time of the timed phases when device timing is on)."""
        self.mark("end")
        marks = self.marks
        counters["step_seconds"] += marks[-1][1] - marks[0][1]
        counters["decode_rows"] += decode_rows
        counters["prefill_step_tokens"] += prefill_tokens
        counters["decode_steps"] += bool(decode_rows)
        host, device = {}, {}
        for (phase, t0, e0), (_, t1, e1) in zip(marks, marks[1:]):
            if phase in PHASES:
                counters[f"{phase}_seconds"] += t1 - t0
                host[phase] = host.get(phase, 0.0) + (t1 - t0) * 1e3
                if e0 is not None and phase in DEVICE_PHASES:
                    e1.synchronize()
                    ms = e0.elapsed_time(e1)
                    counters[f"{phase}_device_seconds"] += ms / 1e3
                    device[phase] = device.get(phase, 0.0) + ms
        return host, device


COUNTERS = ("step_seconds", "decode_rows", "prefill_step_tokens", "decode_steps", "prefill_forwards",
            *(f"{p}_seconds" for p in PHASES), *(f"{p}_device_seconds" for p in DEVICE_PHASES))
