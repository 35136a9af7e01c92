"""``flashrt serve --tp N --ep M``: one serving engine across ``N * M`` ranks (docs/parallel.md).

Every rank builds the same :class:`~flashrt.engine.Engine` over its shards of the model; rank 0
also runs the HTTP server and owns the requests. The engines are replicas in lockstep: each turn of
rank 0's step loop first sends that turn's commands (requests added with their token ids and
sampling parameters, aborts) to every other rank (:meth:`Lockstep.share`, one ``broadcast_object``),
then every rank applies them and runs the same step. The scheduler, the page pool, the prefix
store and the samplers are deterministic functions of those commands, and the logits are the same
on every rank (the tensor-parallel sums are all-reduced), so every rank schedules, runs and samples
the same thing: the forward's collectives line up without any per-step plan on the wire. Every
group runs every sequence (``Parallel(dispatch="replicated")``: the experts are split over all
ranks, one all-reduce per MoE layer, attention repeated on each group), unless ``--dp-attention``
spreads them: then each turn also carries the group rank 0 chose for each new request, and each
group runs only its own (:mod:`flashrt.engine.parallel_groups`).

Each turn also carries a digest of rank 0's requests (tokens, states, counters) after the previous
step; a rank whose own digest differs stops with an error naming it, never decodes on silently.
While rank 0 is idle it sends an empty turn every ``tick_s`` seconds, so the others' wait never
reaches the collective timeout. A collective that fails (a rank died, or stopped answering past
``--collective-timeout``) fails every request on rank 0 with that error, stops the server, and the
launcher ends every rank and names the one at fault.
"""
from __future__ import annotations

import hashlib
import logging
import signal
import threading

from flashrt import distributed
from flashrt.errors import CollectiveError, FlashrtError

from .request import RequestOutput

log = logging.getLogger("flashrt.engine")
STOP = "stop"


class Diverged(FlashrtError):
    """A rank's engine no longer matches rank 0's (its requests, tokens or counters differ)."""


def state_digest(engine) -> str:
    """A fingerprint of an engine's requests and counters (equal on every rank in lockstep; the
    step timers, ``*_seconds``, differ between ranks and are left out). With data-parallel attention
    (:class:`~flashrt.engine.parallel_groups.GroupStepLoop`) only what every rank holds alike: every
    request's group, tokens and finish, and the counters of the whole server."""
    core, h = engine.step_loop, hashlib.blake2b(digest_size=8)
    if hasattr(core, "shared_state"):
        h.update(repr(core.shared_state()).encode())
        return h.hexdigest()
    h.update(counters_repr(core.counters))
    for rid, req in sorted(core.requests.items()):
        h.update(repr((rid, [(s.status.name, len(s.tokens), s.tokens[-1:]) for s in req.seqs])).encode())
    return h.hexdigest()


def counters_repr(counters: dict) -> bytes:
    """The counters a digest covers: all but the ``*_seconds`` timers (they differ between ranks)."""
    return repr(sorted((k, v) for k, v in counters.items() if not k.endswith("_seconds"))).encode()


class Lockstep:
    """Rank 0's side: every turn of its engine's loop goes to the other ranks first.

    Attach with ``engine.lockstep = Lockstep(engine, ...)``; the engine's loop calls :meth:`share`
    with each turn's commands. ``on_failure(exc)`` is called once when a collective fails (the
    server stops then)."""

    def __init__(self, engine, tick_s: float, on_failure=None):
        self.engine, self.tick_s, self.on_failure = engine, tick_s, on_failure
        self.failed: CollectiveError | None = None
        self._closed = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="flashrt-lockstep", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        """An empty turn every ``tick_s`` seconds keeps the other ranks' wait short of the timeout."""
        engine = self.engine
        while not self._closed.wait(self.tick_s):
            with engine._cv:
                if not any(kind == "tick" for kind, _ in engine._commands):
                    engine._commands.append(("tick", None))
                engine._cv.notify()

    def share(self, commands: list) -> list:
        """Send this turn's commands to the other ranks; the commands rank 0 applies now."""
        commands = [c for c in commands if c[0] != "tick"]
        if self.failed is None and distributed.failure() is not None:  # a step's forward failed
            self._fail(distributed.failure())
        if self.failed is None and not self._closed.is_set():
            wire = [("add", arg[:3]) if kind == "add" else (kind, arg) for kind, arg in commands]
            try:
                distributed.broadcast_object((wire, state_digest(self.engine), self._place(commands)), 0)
            except CollectiveError as exc:
                self._fail(exc)
        if self.failed is None:
            return commands
        for kind, arg in commands:  # nothing more runs: new requests get the failure as their output
            if kind == "add":
                rid, ids, _, sink = arg
                sink(RequestOutput(rid, ids, [], True, f"{type(self.failed).__name__}: {self.failed}"))
        return [c for c in commands if c[0] == "abort"]

    def _place(self, commands: list) -> dict:
        """With data-parallel attention: the group of each request added this turn (request id -> group)."""
        place = getattr(self.engine.step_loop, "place", None)
        if place is None:
            return {}
        return {arg[0]: place(arg[0], arg[1]) for kind, arg in commands if kind == "add"}

    def _fail(self, exc: CollectiveError) -> None:
        log.error("a collective failed, the server stops: %s", exc)
        self.failed, engine = exc, self.engine
        engine.accepting = False
        engine.step_error = f"{type(exc).__name__}: {exc}"
        engine._fail_all(exc)
        if self.on_failure is not None:
            self.on_failure(exc)

    def close(self) -> None:
        """The server is done: tell the other ranks to stop (after the engine's loop has ended)."""
        self._closed.set()
        if self.failed is None:
            try:
                distributed.broadcast_object((STOP, state_digest(self.engine), {}), 0)
            except CollectiveError as exc:
                self.failed = exc


def follow(engine) -> int:
    """A rank other than 0: apply rank 0's commands and run the same steps until it stops; returns
    the steps run. Raises :class:`Diverged` when this engine no longer matches rank 0's."""
    quiet = lambda out: None  # noqa: E731 - rank 0 answers the clients
    rank, steps = distributed.rank(), 0
    while True:
        commands, digest, placement = distributed.broadcast_object(None, 0)
        if digest != state_digest(engine):
            raise Diverged(f"rank {rank}: its engine differs from rank 0's after {steps} steps "
                           f"(requests, tokens or counters); the ranks cannot stay in lockstep")
        if commands == STOP:
            return steps
        if placement:  # data-parallel attention: the groups rank 0 chose for this turn's requests
            engine.step_loop.placement.update(placement)
        engine._apply([("add", (*arg, quiet)) if kind == "add" else (kind, arg) for kind, arg in commands])
        if engine.step_loop.has_work:
            engine.step_loop.step()
            steps += 1
            if distributed.failure() is not None:
                raise distributed.failure()


def leave_signals_to_rank_0() -> None:
    """Ranks other than 0 ignore SIGINT and SIGTERM (Ctrl-C or a stop sent to the whole process
    group): rank 0 drains its requests, then stops them; the launcher kills what does not stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
