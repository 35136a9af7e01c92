"""The engine's warm-up: synthetic requests run through the step loop before the first real one, so
that serving never stops mid-stream to compile a kernel variant or capture a decode graph of a
batch size it had not met.

Triton specialises a kernel on its tile constants and on integer arguments (``== 1``,
``% 16 == 0``), and the hardware profile's tile rules pick tiles by row count, so each decode
batch-size bucket (``engine/slots.py``) launches variants of its own and captures its own graphs.
Prefill forwards likewise specialise on their token count and rows. Which shapes a server meets
depends on arrivals; one met the first time mid-level costs seconds of compiles. The warm-up
runs rounds of synthetic requests to their end (:func:`rounds`): prefills of every power-of-two
token-count class, groups of every power-of-two row count a step holds, a prefix-store hit, and
every decode batch-size bucket up to the one ``max_running`` rows fill (largest first), with
greedy and sampled draws (top-k / top-p, min-p, penalties, logprobs) and a few decode steps each
(captured on CUDA).

Nothing of it stays visible: its requests have ids of their own, no sink and no finish hooks
(nothing reaches a server's channel), its prefix snapshots
go to a store of their own (never the engine's, nor its disk cache), and the request counters are
put back afterwards (the decode-graph counters keep the captures: they happened). Random draws use
seeded generators of their own, so the engine's seed stream is untouched.
"""
from __future__ import annotations

import logging
import random
import time

from .sampling import SamplingParams
from .slots import BUCKETS, bucket_for
from .snapshot import PrefixStore

log = logging.getLogger("flashrt.engine")

DECODE_STEPS = 3  # tokens per warm-up request: the first from prefill, then decode steps
_KEEP = ("decode_captures", "decode_replays", "decode_eager", "decode_fallbacks", "prefill_captures",
         "prefill_replays")


def buckets(max_running: int) -> list[int]:
    """The decode batch sizes a run of at most ``max_running`` sequences can meet, largest first."""
    top = bucket_for(max_running)
    sizes = [b for b in BUCKETS if b <= top]
    if top not in sizes:  # past the table: multiples of 64
        sizes += list(range(BUCKETS[-1] + 64, top + 1, 64))
    return sorted(sizes, reverse=True)


def _params(i: int) -> SamplingParams:
    """Request ``i``'s draws: greedy, sampled with top-k / top-p, or with min-p, penalties and logprobs."""
    kind = i % 3
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i, max_tokens=DECODE_STEPS, ignore_eos=True)
    return SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
                          frequency_penalty=0.5, logprobs=2, seed=i, max_tokens=DECODE_STEPS, ignore_eos=True)


def _pow2_up_to(n: int) -> list[int]:
    return [1 << k for k in range(max(n, 1).bit_length()) if 1 << k <= n]


def rounds(chunk: int, max_rows: int, sizes: list[int]) -> list[tuple[str, list[int]]]:
    """The warm-up's rounds, each ``(what, prompt lengths)`` run together to their end.

    * one prompt alone of every power-of-two length ``p`` up to a chunk and of ``p - 1`` and
      ``p + 1``, and of a chunk (less one, and down to a multiple of 16): the launchers specialise
      on a forward's token count by power of two, ``== 1`` and ``% 16`` (each class of all three,
      and the tiles' thresholds between them);
      then the same lengths after a whole first chunk (a later chunk reads the earlier one's KV),
      then one more whose first chunk is stored by then (the prefix store's hit path);
    * ``r`` and ``r + 1`` whole chunks in one forward for every power of two ``r`` up to the rows a
      step's token budget holds (``max_rows``);
    * one round per decode batch size in ``sizes``: that many short prompts, decoded together.
    """
    out = []
    for start in (0, chunk):  # a first chunk, and a later one (it reads the earlier chunk's KV)
        lengths = {n for p in _pow2_up_to(chunk) for n in (p - 1, p, p + 1)} | {chunk - 1, chunk, chunk // 16 * 16}
        out += [("prefill", [start + n]) for n in sorted(lengths) if 1 <= n <= chunk]
    out.append(("prefix", [chunk + 3]))  # its first chunk is the one every longer prompt shares: a prefix hit
    for r in _pow2_up_to(max_rows):
        out += [("group", [chunk] * r)] + ([("group", [chunk] * (r + 1))] if r + 1 <= max_rows else [])
    out += [("decode", [5] * b) for b in sizes]
    return out


def log_progress(done: int, total: int, what: str, rows: int) -> None:
    """A server's log line after each round of its warm-up."""
    log.info("warm-up: %s round of %d prompts done (%d of %d)", what, rows, done, total)


def warm_up(engine, progress=None) -> dict:
    """Run the warm-up through ``engine``'s step loop (the calling thread; before :meth:`start`).
    ``progress(done, total, what, prompts)`` is called after each round (:func:`rounds`). Returns
    ``{"buckets", "rounds", "requests", "seconds", "captures"}``."""
    loop = engine.step_loop
    if loop.has_work:
        raise RuntimeError("warm_up: expected an idle engine, it has requests in flight")
    cfg, config = loop.cfg, engine.config
    rng = random.Random(0)
    counters, prefix, hooks = dict(loop.counters), loop.prefix, loop.finish_hooks
    loop.prefix = PrefixStore(prefix.block, prefix.max_bytes, b"warm-up:" + prefix.salt, None)
    loop.finish_hooks = []
    sizes = buckets(config.max_running)
    chunk = config.prefill_chunk
    max_rows = max(1, min(config.max_running, config.max_step_tokens // chunk))
    plan = rounds(chunk, max_rows, sizes)
    shared = [rng.randrange(cfg.vocab_size) for _ in range(chunk)]  # first chunk of every longer prompt
    t0, n = time.perf_counter(), 0
    try:
        for done, (what, lengths) in enumerate(plan, 1):
            for length in lengths[:config.max_running]:
                length = max(1, min(length, config.max_model_len - DECODE_STEPS))
                head = shared if length > chunk else []
                prompt = head + [rng.randrange(cfg.vocab_size) for _ in range(length - len(head))]
                loop.add(f"warm-up-{n}", prompt, _params(n))
                n += 1
            while loop.has_work:
                loop.step()
            if progress is not None:
                progress(done, len(plan), what, len(lengths))
    finally:
        loop.prefix, loop.finish_hooks = prefix, hooks
        loop.counters.update({k: v for k, v in counters.items() if k not in _KEEP})
    seconds = time.perf_counter() - t0
    captures = loop.counters["decode_captures"] - counters["decode_captures"]
    prefill = loop.counters["prefill_captures"] - counters["prefill_captures"]
    log.info("warm-up: %d rounds, %d requests, %d decode and %d prefill graphs captured, %.1f s", len(plan), n,
             captures, prefill, seconds)
    return {"buckets": sizes, "rounds": len(plan), "requests": n, "seconds": round(seconds, 3), "captures": captures,
            "prefill_captures": prefill}
