"""The OpenAI-compatible HTTP API over an :class:`~flashrt.engine.Engine` (FastAPI).

``/v1/models``, ``/v1/completions`` (text prompts through the model's tokenizer),
``/v1/chat/completions`` (the model's chat format, :mod:`.chat`), ``/health``, ``/metrics``;
``stream: true`` sends server-sent events in OpenAI's chunk format, then a usage chunk, then
``[DONE]``. Every
error is OpenAI's error body. Bodies are decoded and validated here (:mod:`.protocol`) before the
engine sees anything; a client that goes away aborts its requests, which frees their pages.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..errors import EngineStopped, PromptTooLong, QueueFull, RequestError
from . import chat
from .images import DECODE_WORKERS, has_images, request_images
from .metrics import Metrics
from .protocol import BadRequest, ChatCompletionRequest, CompletionRequest, parse
from .responses import Renderer, sse

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
            "code": code}
    return JSONResponse({"error": body}, status_code=status)


def as_error(exc: Exception, prompt_param: str = "prompt") -> JSONResponse:
    """The response for an exception a request raised (the one place statuses are decided)."""
    if isinstance(exc, BadRequest):
        return error(exc.status, str(exc), exc.param)
    if isinstance(exc, PromptTooLong):
        return error(400, str(exc).replace("prompt:", f"{prompt_param}:", 1), prompt_param, "context_length_exceeded")
    if isinstance(exc, RequestError):
        return error(400, str(exc), prompt_param if exc.param == "prompt" else exc.param)
    if isinstance(exc, QueueFull):
        return error(429, f"{exc}; retry later", None, "queue_full")
    if isinstance(exc, EngineStopped):
        return error(503, str(exc), None, "shutting_down")
    raise exc


def create_app(engine, model_name: str, api_key: str | None = None) -> FastAPI:
    metrics = Metrics(engine)
    # image decoding and preprocessing run here, off the event loop, a few at a time
    decoders = ThreadPoolExecutor(DECODE_WORKERS, thread_name_prefix="flashrt-images")

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown(grace_s=0)
        decoders.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="flashrt", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail), None, None)

    def unauthorized(request: Request) -> JSONResponse | None:
        if api_key is None or request.headers.get("authorization") == f"Bearer {api_key}":
            return None
        return error(401, "Incorrect or missing API key (Authorization: Bearer <key>)", None, "invalid_api_key")

    @app.get("/health")
    async def health():
        ok = engine.accepting and engine.step_error is None
        return JSONResponse({"status": "ok" if ok else "unavailable", "error": engine.step_error},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "flashrt",
                "max_model_len": engine.config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, "chat")

    async def serve(request: Request, kind: str):
        if (denied := unauthorized(request)) is not None:
            return denied
        prompt_param = "prompt" if kind == "completion" else "messages"
        try:
            body = await read_json(request)
            req = parse(CompletionRequest if kind == "completion" else ChatCompletionRequest, body)
            if req.model != model_name:
                return error(404, f"The model `{req.model}` does not exist.", "model", "model_not_found")
            params = req.params()
            opts = chat.options(req) if kind == "chat" else None
            prompts, images = (req.prompts(), None) if kind == "completion" else await chat_ids(engine, req, opts,
                                                                                               decoders)
            rids = submit(engine, prompts, params, prompt_param, images)
        except (ValueError, QueueFull, EngineStopped) as exc:
            return as_error(exc, prompt_param)
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        render = Renderer(kind, f"{prefix}-{uuid.uuid4().hex}", model_name, engine.tokenizer, params.n,
                          thinking=opts.thinking if opts else True)
        if req.stream:
            return EventStream(stream(engine, rids, render, req.include_usage), engine, rids)
        return await complete(engine, rids, render, request)

    return app


class EventStream(StreamingResponse):
    """Server-sent events that abort their requests however the response ends (finished, client
    gone before or while streaming, server shutting down); aborting a finished request is a no-op."""

    def __init__(self, events, engine, rids: list[str]):
        super().__init__(events, media_type="text/event-stream")
        self.engine, self.rids = engine, rids

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for rid in self.rids:
                self.engine.abort(rid)


async def chat_ids(engine, req: ChatCompletionRequest, opts: chat.ChatOptions,
                   decoders: ThreadPoolExecutor) -> tuple[list[list[int]], list]:
    """([the prompt ids of a chat request in the model's chat format], its images in order). The
    images are decoded and preprocessed in ``decoders``' threads, so a large or slow image never
    holds up the event loop (other requests, /health, streams)."""
    if not req.messages:
        raise BadRequest("messages", "messages: expected a non-empty list of messages, got []")
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    images = []
    if any(has_images(m.get("content")) for m in messages):
        loop = asyncio.get_running_loop()
        images = await loop.run_in_executor(decoders, request_images, engine.model, engine.tokenizer, messages)
    return [chat.prompt_ids(engine.tokenizer, messages, opts)], images


async def read_json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(None, f"the request body is not valid JSON ({exc})") from None


def submit(engine, prompts, params, prompt_param: str, images=None) -> list[str]:
    """Add one engine request per prompt (with ``images``, the images of its placeholders); on a
    failure none stays behind."""
    rids = []
    try:
        for p in prompts:
            rids.append(engine.add_request(p, params, images=images))
    except Exception:
        for rid in rids:
            engine.abort(rid)
        raise
    return rids


async def outputs_of(engine, rids: list[str]):
    """(prompt index, RequestOutput) of every request as they come, merged."""
    if len(rids) == 1:
        async for out in engine.stream(rids[0]):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, rid):
        async for out in engine.stream(rid):
            await queue.put((i, out))

    tasks = [asyncio.ensure_future(pump(i, rid)) for i, rid in enumerate(rids)]
    try:
        for _ in range(len(rids)):
            while True:
                i, out = await queue.get()
                yield i, out
                if out.finished:
                    break
    finally:
        for t in tasks:
            t.cancel()


async def stream(engine, rids: list[str], render: Renderer, include_usage: bool):
    finished, prompt_tokens, completion_tokens = set(), 0, 0
    try:
        async for i, out in outputs_of(engine, rids):
            if out.error:
                yield sse({"error": {"message": out.error, "type": "server_error", "param": None, "code": None}})
                break
            for event in render.chunks(i, out):
                yield event
            if out.finished:
                finished.add(rids[i])
                prompt_tokens += len(out.prompt_token_ids)
                completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if include_usage and len(finished) == len(rids):
            yield render.usage_chunk(prompt_tokens, completion_tokens)
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or an error): whatever is still running stops and frees its pages
        for rid in rids:
            if rid not in finished:
                engine.abort(rid)


async def complete(engine, rids: list[str], render: Renderer, request: Request):
    async def final():
        last = {}
        async for i, out in outputs_of(engine, rids):
            last[i] = out
        return [last[i] for i in range(len(rids))]

    task = asyncio.ensure_future(final())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            break
        if await request.is_disconnected():
            task.cancel()
            for rid in rids:
                engine.abort(rid)
            return Response(status_code=499)
    outs = task.result()
    failed = next((o.error for o in outs if o.error), None)
    if failed is not None:
        status = 429 if failed.startswith("QueueFull") else 500
        return error(status, failed, None, None)
    return render.full(outs)
