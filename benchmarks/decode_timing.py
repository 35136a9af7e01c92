"""The decode-step timing the benchmarks share: a step function (eager ``Model.forward`` or CUDA-graph
replay) and the median of synchronized steps after a warm-up (which also captures the graphs)."""
from __future__ import annotations

import statistics
import time

import torch

from flashrt import ops
from flashrt.engine.step_capture import StepCapture


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """The next tokens ``[B]`` as ``generate()`` picks them at temperature 0: ``ops.sample(logits, 0)``."""
    return ops.sample(logits, 0.0)


def stepper(model, state, graph: bool):
    """``step(tokens [B]) -> logits [B, vocab]``: one decode step of ``state``."""
    if graph:
        return StepCapture(model, state).step
    return lambda tok: model.forward(tok.reshape(-1, 1), state=state)


def median_step_ms(step, tok: torch.Tensor, steps: int, warmup: int = 2, greedy: bool = False) -> float:
    """Median ms of ``steps`` synchronized calls of ``step`` after ``warmup`` untimed ones; ``greedy``
    feeds each step's greedy pick to the next (else ``tok`` every time)."""
    sync = torch.cuda.synchronize if tok.device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        out = step(tok)
        tok = greedy_pick(out) if greedy else tok
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        out = step(tok)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        tok = greedy_pick(out) if greedy else tok
    return statistics.median(times)


def pipelined_step_ms(step, tok: torch.Tensor, steps: int, captures=None) -> tuple[float, int]:
    """(mean ms, captures inside the timed calls) of ``steps`` calls of ``step`` back to back, each fed
    the previous one's greedy pick on the device, one sync at the end: a step's host work overlaps the
    device work queued before it, as in a decode loop that reads its tokens one step late
    (``generate()``, the overlapped engine). ``captures()``: the step's CUDA-graph captures so far
    (a bucket edge inside the timed calls records a graph there, which the mean then includes: the
    count says so; None: 0)."""
    sync = torch.cuda.synchronize if tok.device.type == "cuda" else (lambda: None)
    count = captures or (lambda: 0)
    tok = greedy_pick(step(tok))  # warm: captures, compiles
    sync()
    before = count()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = greedy_pick(step(tok))
    sync()
    return (time.perf_counter() - t0) * 1e3 / steps, count() - before

