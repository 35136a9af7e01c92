"""Measured costs of speculative decoding on this device: what ``speculative_costs`` of a device
profile holds (read by :mod:`flashrt.engine.adaptive`) and what ``benchmarks/speculative.py`` reports.

Per batch size, on one prefilled state: the median time of a plain decode step
(:class:`~flashrt.engine.step_capture.StepCapture`), of the draft
(:class:`~flashrt.engine.draft_capture.DraftCapture`) and of a verify step with ``k = 1 ..
block_size`` drafts (:class:`~flashrt.engine.verify_capture.VerifyCapture`, then the commit of one
kept token per row, as a fully rejected round). On CUDA all three are CUDA-graph replays (the
first calls capture); elsewhere the same static-buffer steps run eagerly.
"""
from __future__ import annotations

import statistics
import time

import torch

from .draft_capture import DraftCapture
from .step_capture import StepCapture
from .verify_capture import VerifyCapture


def timed_ms(fn, steps: int, sync, warmup: int = 2) -> float:
    """Median ms of ``steps`` synchronized calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def prefilled(model, batch: int, prompt: int, extra: int, seed: int = 0):
    """(state after a random prompt of ``prompt`` tokens per row with room for ``extra`` more,
    the greedy next token [B])."""
    gen = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prompt), generator=gen).to(model.device)
    state = model.new_state(batch, prompt + extra)
    return state, model.forward(ids, state=state).argmax(-1)


def measure(model, batch: int, prompt: int = 64, steps: int = 5, warmup: int = 2) -> dict:
    """ms of a plain decode step (``decode_ms``), the draft (``draft_ms``) and a verify step per
    ``k`` (``verify_ms``: {k: ms}) at ``batch`` rows after ``prompt`` tokens; ``graphs``: whether
    they were CUDA-graph replays."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: expected an int >= 1, got {batch!r}")
    K = model.cfg.dspark_block_size
    if model.drafts is None or not K:
        raise ValueError("model: expected a model with DSpark draft layers (dspark_block_size > 0)")
    cuda = model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    state, tok = prefilled(model, batch, prompt, (steps + warmup) * (K + 2) + K + 1)
    plain = StepCapture(model, state)
    row = {"batch": batch, "prompt": prompt, "block_size": K, "graphs": cuda}
    row["decode_ms"] = timed_ms(lambda: plain.step(tok), steps, sync, warmup)
    drafter = DraftCapture(model, state)
    row["draft_ms"] = timed_ms(lambda: drafter.draft(tok), steps, sync, warmup)
    verifier, ones = VerifyCapture(model, state), torch.ones(batch, dtype=torch.long)
    row["verify_ms"] = {}
    for k in range(1, K + 1):
        ids = tok.unsqueeze(1).expand(batch, k + 1).contiguous()

        def step():
            verifier.verify(ids)
            verifier.keep(ids, ones)  # one token kept per row: the state moves as in decoding
        row["verify_ms"][k] = timed_ms(step, steps, sync, warmup)
    return row


def cost_entry(row: dict) -> dict:
    """A ``speculative_costs`` entry from :func:`measure`: times relative to the plain step."""
    d = row["decode_ms"]
    return {"verify": [1.0] + [row["verify_ms"][k] / d for k in sorted(row["verify_ms"])],
            "draft": row["draft_ms"] / d}


def cost_table(model, batches, prompt: int = 64, steps: int = 5, progress=None) -> tuple[dict, list]:
    """(``speculative_costs`` table {batch: entry}, the :func:`measure` rows) at ``batches``."""
    rows = []
    for i, b in enumerate(batches):
        rows.append(measure(model, b, prompt, steps))
        if progress:
            progress(i + 1, len(batches))
    return {r["batch"]: cost_entry(r) for r in rows}, rows
