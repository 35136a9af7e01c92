"""``EngineClient``: the serving engine run in a process of its own (:mod:`flashrt.engine.core_process`),
with the asynchronous interface of :class:`~flashrt.engine.Engine` (``add_request`` / ``stream`` /
``abort`` / ``stats`` / ``shutdown``), for the HTTP server.

Requests are checked here, before they are sent, with the engine's own
:class:`~flashrt.engine.limits.RequestLimits` and tokenizer (both sent by the engine process once
it is ready), so bad input is refused with the same errors as in process. A reader thread receives
the engine's messages: each step's outputs (slim while a request runs: only what is new, see
:mod:`flashrt.engine.wire`) are rebuilt whole and go to their requests' queues in one hand-off per
event loop; statistics are kept for ``stats()``; finished-request records go to :meth:`on_finish` hooks.
If the engine process dies, every open request ends with an error output and ``step_error`` says so.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass

from .core_process import CoreSpec, main
from .errors import EngineStopped
from .front import AsyncSink, EngineFront, deliver_grouped
from .request import CompletionOutput, RequestOutput
from .wire import Accumulator, is_last

log = logging.getLogger("flashrt.engine")


@dataclass(frozen=True)
class ModelInfo:
    """What the server process knows of the model: its config and whether it has a vision tower."""
    cfg: object
    vision: bool | None  # truthy when the model takes images (None otherwise, as Model.vision)


def _stop_at_exit(proc, conn) -> None:
    """At interpreter exit, an engine process not shut down: close the pipe (the process then stops at
    once), wait a little for it, then kill it (multiprocessing would otherwise wait for it forever)."""
    if proc.is_alive():
        conn.close()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


class EngineClient(EngineFront):
    def __init__(self, spec: CoreSpec, start_timeout_s: float = 3600.0):
        """Start the engine process and wait until its model is loaded (RuntimeError if it fails)."""
        ctx = multiprocessing.get_context("spawn")  # a CUDA process cannot be forked
        self._conn, child = ctx.Pipe()
        # not daemonic: the engine process forks its compile workers (a daemonic process may not have
        # children); it stops by itself when this end of the pipe closes, which _stop_at_exit ensures
        self._proc = ctx.Process(target=main, args=(child, spec), name="flashrt-engine", daemon=False)
        self._proc.start()
        child.close()
        atexit.register(_stop_at_exit, self._proc, self._conn)
        info = self._first_message(start_timeout_s)
        self.model = ModelInfo(info["limits"].cfg, True if info["has_vision"] else None)
        self.tokenizer, self.config, self.limits = info["tokenizer"], info["config"], info["limits"]
        self._stats = info["stats"]
        self._init_front()
        self._lock = threading.Lock()  # sends, and the map of open requests
        self._open: dict[str, AsyncSink] = {}
        self._sofar: dict[str, Accumulator] = {}  # per open request: what its slim outputs add to
        self._unstarted = 0  # requests sent that have no output yet
        self._hooks: list = []
        self._stopped = threading.Event()
        self.accepting = True
        self.step_error: str | None = None
        self._reader = threading.Thread(target=self._read, name="flashrt-engine-reader", daemon=True)
        self._reader.start()

    def _first_message(self, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited with {self._proc.exitcode} while starting")
            if time.monotonic() > end:
                self._proc.kill()
                raise RuntimeError(f"the engine process was not ready after {timeout:.0f} s")
        kind, *rest = self._conn.recv()
        if kind != "ready":  # the engine's own error (a bad --model is a ValueError, as in process)
            self._proc.join(timeout=30)
            raise rest[0]
        return rest[0]

    # ----- the interface the server uses ----------------------------------------------------------
    def start(self) -> None:
        """The engine runs from construction on (kept for the server's lifespan, as Engine.start)."""

    def on_finish(self, hook) -> None:
        """Call ``hook`` with a :class:`~flashrt.engine.request.Finished` record of each finished request."""
        self._hooks.append(hook)

    def stats(self) -> dict:
        """The engine's counters and gauges as last reported (at most a fraction of a second old)."""
        return dict(self._stats)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop admitting; the engine lets running requests finish for up to ``grace_s`` seconds,
        aborts the rest and exits."""
        self.accepting = False
        if self._proc.is_alive():
            self._send("shutdown", grace_s)
            self._stopped.wait(timeout=grace_s + 30)
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()

    def _waiting(self) -> int:
        """Requests sent that have no output yet (waiting, in flight to the engine or prefilling)."""
        return self._unstarted

    def _submit(self, rid, ids, params, sink, images=None) -> None:
        with self._lock:
            self._open[rid] = sink
            self._sofar[rid] = Accumulator(ids)
            self._unstarted += 1
        if not self._send("add", rid, ids, params, images):
            with self._lock:
                self._open.pop(rid, None)
                self._sofar.pop(rid, None)
                self._unstarted -= 1
            self._queues.pop(rid, None)
            raise EngineStopped(self.step_error or "the engine process is gone")

    def _send(self, *msg) -> bool:
        with self._lock:
            try:
                self._conn.send(msg)
                return True
            except (BrokenPipeError, EOFError, OSError):
                return False

    # ----- the reader thread -------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                kind, *rest = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "out":
                self._outputs(*rest)
            elif kind == "stats":
                self._stats = rest[0]
            elif kind == "error":
                self.step_error = rest[0]
            elif kind == "stopped":
                self._stats = rest[0]
                break
        self._stopped.set()
        self._fail_open("the engine process stopped" if not self.accepting else "the engine process exited")

    def _outputs(self, items, records, stats) -> None:
        if stats is not None:
            self._stats = stats
        for record in records:  # before the outputs, as in process: a caller that saw its request end finds it counted
            for hook in self._hooks:
                hook(record)
        taken = []
        with self._lock:
            for rid, out in items:
                sink = self._open.get(rid)
                if sink is None:
                    continue
                if not sink.started:
                    sink.started = True
                    self._unstarted -= 1
                if is_last(out):
                    del self._open[rid]
                    taken.append((sink, self._sofar.pop(rid), out))
                else:
                    taken.append((sink, self._sofar[rid], out))
        # rebuilt outside the lock (only this thread changes an accumulator): sends need not wait
        deliver_grouped([(sink, sofar.take(out)) for sink, sofar, out in taken], self.abort)

    def _fail_open(self, why: str) -> None:
        """Every request still open ends with an error output (the engine cannot answer any more)."""
        with self._lock:
            open_, self._open, self._sofar, self._unstarted = self._open, {}, {}, 0
        if self.accepting:
            self.step_error = self.step_error or why
            log.error("%s; %d open requests fail", why, len(open_))
        for rid, sink in open_.items():
            out = RequestOutput(rid, [], [CompletionOutput(0, "", [], None, "error")], True, why)
            AsyncSink.deliver_batch([(sink, out)])
