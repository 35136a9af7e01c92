"""The serving engine in a process of its own (the child side of :mod:`flashrt.engine.client`).

The HTTP server's event loop and an engine thread in one interpreter take turns holding it: the
streaming work of every step (one chunk per running request) delays the next engine step, and the
engine's host work delays the streams. With the engine here, each has an interpreter of its own.

The child loads the model, runs an :class:`~flashrt.engine.Engine` with its loop thread, and
talks to the server process over one pipe (``multiprocessing`` connections, pickled messages):

server -> engine: ``("add", rid, ids, params, images)``, ``("abort", rid)``,
``("shutdown", grace_s)``.
engine -> server: ``("ready", info)`` or ``("failed", exception)`` once; then ``("out", [(rid,
output)], finished_records, stats or None)`` once per step with new outputs (each output as
:func:`flashrt.engine.wire.slim` makes it: only what is new while its request runs; the
statistics when requests finished in it); ``("stats", dict)`` at most every
:data:`STATS_EVERY_S` while busy; ``("error", message)`` when a step failed; ``("stopped", stats)``
last. Requests were checked by the server process with the same
:class:`~flashrt.engine.limits.RequestLimits`; the engine checks them again and reports a failure
as that request's error output.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

from .config import EngineConfig
from .front import BatchSink
from .wire import slim

STATS_EVERY_S = 0.2
log = logging.getLogger("flashrt.engine")


@dataclass(frozen=True)
class CoreSpec:
    """What the engine process builds: the model (as ``flashrt serve --model`` names it) and the engine's settings."""
    model: str
    device: str | None
    seed: int
    config: EngineConfig
    threads: int | None = None
    log_level: str = "warning"


class PipeSink(BatchSink):
    """Outputs of requests added through the pipe: one message per step for all of them, each
    output slimmed to what is new (the server process rebuilds the rest)."""

    def __init__(self, request_id: str, channel: "Channel"):
        self.request_id, self.channel, self.batch_key = request_id, channel, channel

    @staticmethod
    def deliver_batch(items) -> bool:
        return items[0][0].channel.outputs([(sink.request_id, slim(out)) for sink, out in items])


class Channel:
    """The child's end of the pipe: sends from the loop thread and the main thread, one at a time;
    finished-request records ride with the next outputs."""

    def __init__(self, conn, stats=None):
        """``stats()``: the engine's statistics, sent with the outputs of a step where requests
        finished (so a client reading the counters after its request ends sees it counted)."""
        self.conn, self.lock, self.records, self.stats = conn, threading.Lock(), [], stats

    def send(self, *msg) -> bool:
        with self.lock:
            try:
                self.conn.send(msg)
                return True
            except (BrokenPipeError, EOFError, OSError):  # the server process is gone
                return False

    def outputs(self, items) -> bool:
        with self.lock:
            records, self.records = self.records, []
        stats = self.stats() if records and self.stats is not None else None
        return self.send("out", items, records, stats)

    def finished(self, record) -> None:
        with self.lock:
            self.records.append(record)


def build(spec: CoreSpec):
    """The engine ``spec`` describes: the model loaded and the engine warmed up, with the kernel
    variants compiled on a pool of workers meanwhile on a CUDA device
    (:func:`flashrt.engine.precompile.compiles_beside`; the process must not have made a CUDA context
    yet). ``flashrt serve`` calls it in its own process or in the engine's."""
    import torch

    from . import Engine
    from .precompile import compiles_beside
    from .run import load_model, pick_device

    if spec.threads:
        torch.set_num_threads(spec.threads)
    dev = pick_device(spec.device)
    quiet = spec.log_level not in ("info", "debug")  # loading progress on the server's stderr
    with compiles_beside(spec.model, dev) as compiles:
        model = load_model(spec.model, dev, spec.seed, quiet=quiet, profile=compiles.profile)
        engine = Engine(model, config=spec.config)
        if engine.config.warmup_on(model):  # before the server reports ready
            from .warmup import log_progress

            engine.warm_up(log_progress)
        compiles.cfg = model.cfg
    if compiles.report is not None:
        jit = compiles.report
        logging.getLogger("flashrt").info(
            "kernels: %d compiled in this process, %s of %s on the compile pool, %d added to the plan",
            len(jit["compiled_in_process"]), (jit["precompile"] or {}).get("compiled"),
            (jit["precompile"] or {}).get("variants"), jit["plan_added"])
    return engine


def describe(engine) -> dict:
    """What the server process needs to check, encode and render requests without the model."""
    m = engine.model
    return {"has_vision": m.vision is not None, "tokenizer": engine.tokenizer, "config": engine.config,
            "limits": engine.limits, "stats": engine.stats()}


def main(conn, spec: CoreSpec) -> None:
    """The engine process: build, report, serve commands until shut down or the server is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process decides when to stop (its SIGTERM / Ctrl-C)
    logging.basicConfig(level=spec.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    channel = Channel(conn)
    try:
        engine = build(spec)
        info = describe(engine)
    except Exception as exc:  # noqa: BLE001 - reported to the server process, which raises it
        try:
            channel.send("failed", exc)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its words
            channel.send("failed", RuntimeError(f"{type(exc).__name__}: {exc}"))
        return
    channel.stats = engine.stats
    engine.on_finish(channel.finished)
    channel.send("ready", info)
    engine.start()
    serve(engine, conn, channel)


def serve(engine, conn, channel: Channel) -> None:
    reported, error, last = 0.0, None, None
    while True:
        try:
            ready = conn.poll(STATS_EVERY_S)
            msg = conn.recv() if ready else None
        except (EOFError, OSError):  # the server process is gone: stop at once
            engine.shutdown(grace_s=0)
            return
        if msg is not None:
            kind = msg[0]
            if kind == "add":
                _, rid, ids, params, images = msg
                engine._submit(rid, ids, params, PipeSink(rid, channel), images)
            elif kind == "abort":
                engine.abort(msg[1])
            elif kind == "shutdown":
                engine.shutdown(grace_s=msg[1])
                channel.send("stopped", engine.stats())
                return
        if engine.step_error is not None and engine.step_error != error:
            error = engine.step_error
            channel.send("error", error)
        now = time.monotonic()
        if now - reported >= STATS_EVERY_S:
            reported, stats = now, engine.stats()
            if stats != last:  # an idle engine sends nothing
                last = stats
                channel.send("stats", stats)
