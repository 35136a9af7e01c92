"""Image parts of ``flashrt serve`` (built-in tiny-vl, httpx over ASGI): decoding runs in the
server's image threads, so a slow image holds up neither /health nor a text request; images of
every kind (modes, an animated GIF) answer as their RGB conversion does, broken ones (truncated,
empty, zero-sized, decompression bombs, text) are one-line 400s that never reach the engine."""
import asyncio
import base64
import io
import json
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

httpx = pytest.importorskip("httpx")

from flashrt.engine import Engine  # noqa: E402
from flashrt.engine.server import images as server_images  # noqa: E402
from flashrt.engine.server.app import create_app  # noqa: E402

from test_serve_images import NO_THINK, messages, served, served_tokens  # noqa: E402

SLOW_S = 1.5


def url_of(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def chat_body(url: str, max_tokens: int = 3) -> dict:
    return {"model": "tiny-vl", "messages": messages(url), "max_tokens": max_tokens, "logprobs": True, **NO_THINK}


def test_a_slow_image_blocks_neither_health_nor_text(vl, monkeypatch):
    real, threads = server_images.preprocess, []

    def slow(source, cfg):
        threads.append(threading.current_thread().name)
        time.sleep(SLOW_S)  # a large image's decode, holding its thread
        return real(source, cfg)

    monkeypatch.setattr(server_images, "preprocess", slow)
    rng = np.random.default_rng(int(torch.randint(0, 1 << 30, ())))
    url = url_of(encode(Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)), "PNG"))
    engine = Engine(vl, max_model_len=256, prefill_chunk=32, max_step_tokens=64)
    app = create_app(engine, "tiny-vl")
    done = {}

    async def timed(name, coro):
        r = await coro
        done[name] = (time.monotonic(), r)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            start = time.monotonic()
            image = asyncio.ensure_future(timed("image", c.post("/v1/chat/completions",
                                                                 content=json.dumps(chat_body(url)).encode())))
            await asyncio.sleep(0.2)  # the image request is decoding now
            await asyncio.gather(timed("health", c.get("/health")), timed("text", c.post(
                "/v1/completions", content=json.dumps({"model": "tiny-vl", "prompt": "hello", "max_tokens": 2}).encode())))
            await image
            return start

    engine.start()
    try:
        start = asyncio.run(go())
    finally:
        engine.shutdown(grace_s=0)
    assert done["image"][1].status_code == 200 and done["image"][0] - start >= SLOW_S
    for name in ("health", "text"):
        assert done[name][1].status_code == 200, done[name][1].text
        assert done[name][0] < done["image"][0] and done[name][0] - start < SLOW_S, name  # not queued behind it
    assert threads and all(t.startswith("flashrt-images") for t in threads)


def test_modes_and_animation_answer_as_their_rgb(vl):
    rng = np.random.default_rng(int(torch.randint(0, 1 << 30, ())))
    h, w = (int(x) for x in rng.integers(20, 60, 2))
    colours = rng.integers(0, 256, (6, 3), dtype=np.uint8)
    rgb = colours[rng.integers(0, 6, (h, w))]
    alpha = rng.integers(0, 256, (h, w, 1), dtype=np.uint8)
    other = colours[rng.integers(0, 6, (h, w))]
    variants = {
        "rgba": encode(Image.fromarray(np.concatenate([rgb, alpha], axis=2), "RGBA"), "PNG"),
        "gif": encode(Image.fromarray(rgb), "GIF", save_all=True, append_images=[Image.fromarray(other)], duration=40),
    }
    want = None
    for name, data in [("rgb", encode(Image.fromarray(rgb), "PNG")), *variants.items()]:
        engine = Engine(vl, max_model_len=256, prefill_chunk=32, max_step_tokens=64)
        got = served_tokens(vl, served(engine, "tiny-vl", chat_body(url_of(data))))
        want = got if want is None else want
        assert got == want, name


def png_header(width: int, height: int) -> bytes:
    import struct
    import zlib
    base = encode(Image.new("RGB", (4, 4)), "PNG")
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return base[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + base[33:]


def test_broken_images_are_one_line_400s(vl):
    rng = np.random.default_rng(int(torch.randint(0, 1 << 30, ())))
    png = encode(Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)), "PNG")
    cases = [
        (png[: int(rng.integers(40, len(png) - 20))], "cannot decode"),
        (b"", "holds no bytes"),
        (png_header(0, 9), "cannot decode"),
        (png_header(40000, 40000), "pixel limit"),
        (png_header(9500, 9500), "pixel limit"),
        (b"plain text, not a picture\n" * 8, "not in an image format Pillow reads"),
    ]
    engine = Engine(vl, max_model_len=256, prefill_chunk=32, max_step_tokens=64)
    app = create_app(engine, "tiny-vl")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post("/v1/chat/completions", content=json.dumps(chat_body(url_of(d))).encode())
                    for d, _ in cases]

    for r, (_, match) in zip(asyncio.run(go()), cases):
        err = r.json()["error"]
        assert r.status_code == 400 and match in err["message"] and "\n" not in err["message"], err
        assert err["param"] == "messages[1].content[1].image_url"
    assert not engine._commands and not engine.step_loop.requests
