"""The server's refusals, in process (httpx over ASGI): a table of bad requests, each with its status,
OpenAI error body and message, none reaching the engine; chat without a chat-capable tokenizer; 429 when the queue is full; a client that
disconnects (whole or streamed response) aborts its request and every page goes back."""
import asyncio
import json
import time

import pytest

httpx = pytest.importorskip("httpx")

from flashrt.engine import Engine  # noqa: E402
from flashrt.engine.server.app import create_app  # noqa: E402
from flashrt.graphs.tokenizer import ByteTokenizer  # noqa: E402

from serving_text import tiny_tokenizer  # noqa: E402

KEY = "k1"
AUTH = {"authorization": f"Bearer {KEY}"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "hi"}
MSG = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}

BAD = [  # (path, body, headers, status, param, message part)
    (C, {**OK, "max_tokens": "5"}, AUTH, 400, "max_tokens", "valid integer"),
    (C, {**OK, "max_tokens": -3}, AUTH, 400, "max_tokens", "max_tokens: expected an int >= 1 or None, got -3"),
    (C, {**OK, "foo": 1}, AUTH, 400, "foo", "foo: unknown field"),
    (C, b"{bad json", AUTH, 400, None, "not valid JSON"),
    (C, [1, 2], AUTH, 400, None, "expected a JSON object"),
    (C, {**OK, "prompt": [7] * 80}, AUTH, 400, "prompt", "80 prompt tokens + max_tokens 16 = 96 exceed the model's context of 64"),
    (CHAT, {**MSG, "messages": [{"role": "user", "content": "y" * 70}]}, AUTH, 400, "messages", "context of 64 tokens"),
    (C, {**OK, "model": "gpt-9"}, AUTH, 404, "model", "The model `gpt-9` does not exist."),
    (C, OK, {}, 401, None, "API key"),
    (C, OK, {"authorization": "Bearer wrong"}, 401, None, "API key"),
    (C, {**OK, "temperature": -1}, AUTH, 400, "temperature", "temperature: expected a number >= 0, got -1"),
    (C, {"model": "tiny"}, AUTH, 400, "prompt", "prompt: required"),
    (C, {**OK, "prompt": []}, AUTH, 400, "prompt", "non-empty"),
    (C, {**OK, "prompt": [5, 999]}, AUTH, 400, "prompt", "prompt: expected token ids in [0, 320), got 999"),
    (C, {**OK, "n": 0}, AUTH, 400, "n", "n: expected an int >= 1, got 0"),
    (C, {**OK, "top_p": 2}, AUTH, 400, "top_p", "top_p: expected a number in (0, 1]"),
    (C, {**OK, "logprobs": 50}, AUTH, 400, "logprobs", "logprobs: expected an int in [0, 20]"),
    (C, {**OK, "logit_bias": {"5": 1}}, AUTH, 400, "logit_bias", "not supported"),
    (C, {**OK, "stop_token_ids": [999]}, AUTH, 400, "stop_token_ids", "below the vocabulary size 320"),
    (C, {**OK, "stream": "yes"}, AUTH, 400, "stream", "valid boolean"),
    (CHAT, {**MSG, "messages": [{"role": "wizard", "content": "x"}]}, AUTH, 400, "messages[0].role", "expected one of"),
    (CHAT, {**MSG, "messages": []}, AUTH, 400, "messages", "non-empty"),
    (CHAT, {**MSG, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, AUTH, 400,
     "messages[0].content[0]", "takes no images"),
    (CHAT, {**MSG, "messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]}, AUTH, 400,
     "messages[0].content", "a list of text parts"),
    (CHAT, {**MSG, "reasoning_effort": "extreme"}, AUTH, 400, "reasoning_effort", "reasoning_effort: expected one of"),
    (CHAT, {**MSG, "chat_template_kwargs": {"thinking": 1}}, AUTH, 400, "chat_template_kwargs.thinking", "a bool"),
    (CHAT, {**MSG, "tool_choice": "required"}, AUTH, 400, "tool_choice", "only 'auto' and 'none'"),
    (CHAT, {**MSG, "top_logprobs": 2}, AUTH, 400, "top_logprobs", "needs logprobs: true"),
    (CHAT, {**MSG, "max_completion_tokens": 0}, AUTH, 400, "max_completion_tokens", "max_completion_tokens: expected an int >= 1"),
    (CHAT, {**MSG, "tools": [{"type": "function"}]}, AUTH, 400, "tools[0]", "tools[0]: expected {'type': 'function'"),
    (CHAT, {"model": "tiny"}, AUTH, 400, "messages", "messages: required"),
]


@pytest.fixture
def engine(model):
    return Engine(model, tiny_tokenizer(), max_model_len=64, max_waiting=1, prefill_chunk=16, max_step_tokens=32)


def request(app, method, path, body=None, headers=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
            return await c.request(method, path, content=content, headers=headers or {})
    return asyncio.run(go())


@pytest.mark.parametrize("path, body, headers, status, param, part", BAD,
                         ids=[f"{i}-{b[3]}-{b[4]}" for i, b in enumerate(BAD)])
def test_bad_requests_never_reach_the_engine(engine, path, body, headers, status, param, part):
    app = create_app(engine, "tiny", api_key=KEY)
    r = request(app, "POST", path, body, headers)
    err = r.json()["error"]
    assert r.status_code == status and part in err["message"], err
    assert err["param"] == param and set(err) == {"message", "type", "param", "code"}
    assert not engine._commands and not engine.step_loop.requests


def test_unknown_route_and_method_use_the_error_body(engine):
    app = create_app(engine, "tiny", api_key=KEY)
    r = request(app, "GET", "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and "message" in r.json()["error"]
    r = request(app, "GET", C, headers=AUTH)
    assert r.status_code == 405 and "message" in r.json()["error"]


def test_chat_needs_a_tokenizer_with_the_chat_tokens(model):
    app = create_app(Engine(model, ByteTokenizer(), max_model_len=64), "tiny")
    r = request(app, "POST", CHAT, MSG)
    assert r.status_code == 400 and "the chat format needs the tokens" in r.json()["error"]["message"]


def test_queue_full_is_429(engine):
    app = create_app(engine, "tiny")  # engine loop not started: the first request stays queued

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            first = asyncio.ensure_future(c.post(C, json=OK))
            while not engine._commands:
                await asyncio.sleep(0.01)
            second = await c.post(C, json=OK)
            first.cancel()
            return second
    r = asyncio.run(go())
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert "1 requests waiting" in r.json()["error"]["message"]


async def call_then_disconnect(app, path, body, after_s):
    """One raw ASGI request whose client goes away ``after_s`` seconds after sending it."""
    sent, pending = [], [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    gone = asyncio.get_running_loop().time() + after_s

    async def receive():  # like a server's: a pending message comes at once, else it waits
        if pending:
            return pending.pop()
        if asyncio.get_running_loop().time() < gone:
            await asyncio.sleep(gone - asyncio.get_running_loop().time())
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "client": ("c", 1),
             "server": ("t", 80), "headers": [(b"content-type", b"application/json")]}
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_and_frees_pages(model, stream):
    engine = Engine(model, prefill_chunk=16, max_step_tokens=32)
    app = create_app(engine, "tiny")
    engine.start()
    try:
        # ignore_eos: the request must still be running when the client leaves, however fast the machine
        body = {**OK, "max_tokens": 400, "temperature": 0, "stream": stream, "ignore_eos": True}
        asyncio.run(asyncio.wait_for(call_then_disconnect(app, C, body, after_s=1.5), 60))
        deadline = time.monotonic() + 60  # the loop thread applies the abort after its current step
        # the counters are read from another thread: wait for the request to be counted as well
        while (engine.step_loop.has_work or not engine.stats()["aborted"] + engine.stats()["finished"]) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = engine.stats()
        assert stats["aborted"] == 1 and stats["finished"] == 0 and not engine.step_loop.has_work, stats
        assert engine.step_loop.pool.pages_in_use == 0 and engine.step_loop.pool.index_pool.pages_in_use == 0
    finally:
        engine.shutdown(grace_s=0)
