"""The asynchronous request interface shared by the in-process :class:`~flashrt.engine.Engine` and
the client of an engine in its own process (:class:`~flashrt.engine.client.EngineClient`):
prompts to token ids, checks before queueing, a queue of the caller's event loop per request,
``stream`` / ``abort``.

A subclass provides ``model`` (``cfg`` and ``vision`` are read), ``tokenizer``, ``config``,
``accepting``, ``limits`` (:class:`~flashrt.engine.limits.RequestLimits`) and three methods:
``_submit(rid, ids, params, sink, images)``, ``abort(rid)`` and ``_waiting()`` (requests queued
and not yet started, for ``max_waiting``).
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from . import outputs
from .errors import EngineStopped, QueueFull, RequestError
from .images import prompt_images
from .request import RequestOutput
from .sampling import SamplingParams


def is_token_list(p) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


class BatchSink:
    """Where one request's outputs go; the outputs of one engine step whose sinks share a
    ``batch_key`` travel together (``deliver_batch([(sink, output)])``, False when nobody listens)."""

    request_id: str
    batch_key: object

    def __call__(self, out: RequestOutput) -> None:
        self.deliver_batch([(self, out)])


def deliver_grouped(pairs, abort) -> None:
    """``[(BatchSink, output)]`` in one hand-off per ``batch_key``; ``abort(request_id)`` for the
    requests of a hand-off nobody listens to any more."""
    batches: dict = {}
    for sink, out in pairs:
        batches.setdefault(sink.batch_key, (sink.deliver_batch, []))[1].append((sink, out))
    for deliver, items in batches.values():
        if not deliver(items):
            for sink, _ in items:
                abort(sink.request_id)


class AsyncSink(BatchSink):
    """Where a request's outputs go when it was added from an event loop: a queue of that loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.request_id, self.loop, self.queue = request_id, loop, queue
        self.batch_key = loop
        self.started = False  # an output has come (engine/client.py counts the requests without one)

    @staticmethod
    def deliver_batch(items) -> bool:
        """``[(AsyncSink, output)]`` of one loop into their queues: one wake-up of that loop.
        False when the loop is gone (nobody is listening)."""
        try:
            items[0][0].loop.call_soon_threadsafe(_put_all, items)
            return True
        except RuntimeError:
            return False


def _put_all(items) -> None:
    """On the event loop's thread: each output into its request's queue."""
    for sink, out in items:
        sink.queue.put_nowait(out)


class EngineFront:
    def _init_front(self) -> None:
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}

    def encode(self, prompt, param: str = "prompt") -> list[int]:
        """Text (through the tokenizer, BOS as its config says) or token ids -> token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError(param, "expected a non-empty prompt, got ''")
            return self.tokenizer.encode(prompt)
        if is_token_list(prompt):
            return list(prompt)
        raise RequestError(param, f"expected a string or a non-empty list of token ids, got {prompt!r:.80}")

    def _new_id(self, request_id: str | None) -> str:
        return request_id if request_id is not None else f"req-{next(self._ids)}"

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    images=None) -> str:
        """Queue a request; returns its id. Call :meth:`stream` (same event loop) for its outputs.
        ``images``: one per image placeholder of the prompt, in order (engine/images.py).
        Raises RequestError / PromptTooLong (bad input), QueueFull, EngineStopped."""
        if not self.accepting:
            raise EngineStopped("the engine is shutting down")
        params = params or SamplingParams()
        ids, pics = prompt_images(self.model, self.tokenizer, self.encode(prompt), images, params.max_tokens,
                                  self.config.max_model_len)
        self.limits.check(ids, params)
        rid = self._new_id(request_id)
        limit = self.config.max_waiting
        if limit is not None and self._waiting() >= limit:
            raise QueueFull(f"the queue is full ({limit} requests waiting)")
        sink = AsyncSink(rid, asyncio.get_running_loop(), asyncio.Queue())
        self._queues[rid] = sink.queue
        self._submit(rid, ids, params, sink, pics)
        return rid

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a request as they come (each with the deltas since the previous one); the
        last has ``finished`` set. Outputs that queued up while the caller was busy come as one
        (the latest, its deltas covering them all). Leaving the iteration early aborts the request."""
        queue = self._queues.get(request_id)
        if queue is None:
            raise RequestError("request_id", f"expected a request added by add_request, got {request_id!r}")
        finished = False
        try:
            while not finished:
                out = await queue.get()
                while not out.finished and not queue.empty():  # behind the engine: one output for all
                    out = outputs.merge(out, queue.get_nowait())
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)
