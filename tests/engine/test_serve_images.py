"""Images in ``/v1/chat/completions`` (in process, httpx over ASGI, the built-in tiny-vl): an
``image_url`` data-URL part gives the greedy tokens ``flashrt.generate`` gives with that image
(prefill chunks that cut the span), the image spans sit where the parts stand, the prefix store
tells images of one size apart and reuses an image's prefix; refusals (URLs that are not data
URLs, file paths, ``image`` parts, undecodable data, images on a text-only model or outside user
turns, spans that overflow the context) are 400s that never reach the engine."""
import asyncio
import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

httpx = pytest.importorskip("httpx")

import flashrt  # noqa: E402
from flashrt.engine import Engine, text  # noqa: E402
from flashrt.engine.server.app import create_app  # noqa: E402
from flashrt.engine.snapshot import chunk_keys  # noqa: E402
from flashrt.graphs import chat_format  # noqa: E402
from flashrt.graphs.image_processor import preprocess  # noqa: E402

from serving_text import tiny_tokenizer  # noqa: E402

CHAT = "/v1/chat/completions"
NO_THINK = {"chat_template_kwargs": {"thinking": False}, "temperature": 0}  # greedy


def data_url(w: int, h: int, seed: int, fmt: str = "PNG") -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def messages(url: str, before: str = "look at ", after: str = " and describe it") -> list[dict]:
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": before},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": after}]}]


def post(app, body: dict):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(CHAT, content=json.dumps(body).encode())
    return asyncio.run(go())


def served(engine, model_name: str, body: dict):
    app = create_app(engine, model_name)
    engine.start()
    try:
        return post(app, body)
    finally:
        engine.shutdown(grace_s=0)


def reference_tokens(model, msgs, max_tokens: int) -> list[int]:
    tok = model.tokenizer
    ids = chat_format.encode(tok, msgs, thinking=False)
    out = flashrt.generate(model, [ids], max_tokens, images=[chat_format.images(msgs)], eos_token_id=tok.eos_id)
    return out.tokens[0]


def served_tokens(model, r) -> list[bytes]:
    assert r.status_code == 200, r.text
    return [bytes(e["bytes"]) for e in r.json()["choices"][0]["logprobs"]["content"]]


def as_bytes(model, tokens: list[int]) -> list[bytes]:
    return [text.token_bytes(model.tokenizer, t) or b"" for t in tokens]


@pytest.mark.parametrize("chunk", [16, 64])
def test_image_part_gives_generates_greedy_tokens(vl, chunk):
    url = data_url(int(torch.randint(20, 70, ())), int(torch.randint(20, 70, ())), seed=int(torch.randint(0, 99, ())))
    msgs = messages(url)
    engine = Engine(vl, max_model_len=512, prefill_chunk=chunk, max_step_tokens=64)
    r = served(engine, "tiny-vl", {"model": "tiny-vl", "messages": msgs, "max_tokens": 8, "logprobs": True, **NO_THINK})
    want = reference_tokens(vl, msgs, 8)
    assert served_tokens(vl, r) == as_bytes(vl, want)
    n_image = preprocess(url, vl.cfg).n_tokens
    text_only = chat_format.encode(vl.tokenizer, messages(url)[:1] + [{"role": "user", "content": "look at  and describe it"}],
                                   thinking=False)
    assert r.json()["usage"]["prompt_tokens"] == len(text_only) + n_image  # the span replaced one placeholder


def test_image_span_sits_where_the_part_stands(vl):
    url = data_url(40, 30, seed=1)
    engine = Engine(vl, max_model_len=512, prefill_chunk=16, max_step_tokens=64)
    first, second = (messages(url, before="", after="x" * 9), messages(url, before="x" * 9, after=""))
    tok, tid = vl.tokenizer, vl.cfg.image_token_id
    starts = []
    for msgs in (first, second):
        ids = chat_format.encode(tok, msgs, thinking=False)
        starts.append(ids.index(tid))
    assert starts[1] > starts[0]
    for msgs in (first, second):  # each answer is generate's with the span at that place
        engine = Engine(vl, max_model_len=512, prefill_chunk=16, max_step_tokens=64)
        r = served(engine, "tiny-vl", {"model": "tiny-vl", "messages": msgs, "max_tokens": 4, "logprobs": True,
                                       **NO_THINK})
        assert served_tokens(vl, r) == as_bytes(vl, reference_tokens(vl, msgs, 4))


def test_prefix_store_keys_hold_the_image(vl):
    """Two images of one size give the same tokens, not the same prefix; the same image again hits."""
    a, b = data_url(48, 40, seed=2), data_url(48, 40, seed=3)
    assert preprocess(a, vl.cfg).n_tokens == preprocess(b, vl.cfg).n_tokens
    engine = Engine(vl, max_model_len=512, prefill_chunk=16, max_step_tokens=64)
    app = create_app(engine, "tiny-vl")
    engine.start()
    try:
        got = {}
        for name, url in (("a", a), ("b", b), ("a again", a)):
            hits = engine.stats()["prefix_hit_tokens"]
            r = post(app, {"model": "tiny-vl", "messages": messages(url), "max_tokens": 4, "logprobs": True, **NO_THINK})
            got[name] = (served_tokens(vl, r), engine.stats()["prefix_hit_tokens"] - hits)
    finally:
        engine.shutdown(grace_s=0)
    span_start = chat_format.encode(vl.tokenizer, messages(a), thinking=False).index(vl.cfg.image_token_id)
    assert got["b"][1] <= span_start  # b reused at most the text before the image
    assert got["a again"][1] > span_start  # a's own prefix, image included, came back
    assert got["a"][0] == got["a again"][0] == as_bytes(vl, reference_tokens(vl, messages(a), 4))
    assert got["b"][0] == as_bytes(vl, reference_tokens(vl, messages(b), 4))


def test_chunk_keys_mix_in_the_images_of_each_block():
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    tokens = torch.randint(0, 300, (40,), generator=g).tolist()
    plain = chunk_keys(tokens, 8)
    one = chunk_keys(tokens, 8, images=[(19, "d1")])
    assert one[:2] == plain[:2] and all(x != y for x, y in zip(one[2:], plain[2:]))
    assert chunk_keys(tokens, 8, images=[(19, "d2")])[2] != one[2]
    assert chunk_keys(tokens, 8, images=[(16, "d1")]) == one  # the same block, the same key


@pytest.fixture
def vl_engine(vl):
    return Engine(vl, max_model_len=80, prefill_chunk=16, max_step_tokens=32)


TRUNCATED = data_url(40, 30, seed=4)[:120]
BAD = [  # (content part, param suffix, message part)
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, ".image_url", "fetches no URLs"),
    ({"type": "image_url", "image_url": {"url": "/etc/hostname"}}, ".image_url", "expected a base64 data URL"),
    ({"type": "image_url", "image_url": "file:///etc/hostname"}, ".image_url", "expected a base64 data URL"),
    ({"type": "image_url", "image_url": {}}, ".image_url", "expected {'url'"),
    ({"type": "image", "image": "/etc/hostname"}, "", "expected an image_url part"),
    ({"type": "image_url", "image_url": {"url": TRUNCATED}}, ".image_url", "image:"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}, ".image_url", "holds no bytes"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, ".image_url", "not valid base64"),
]


@pytest.mark.parametrize("part, suffix, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_image_parts_are_400s(vl_engine, part, suffix, message):
    body = {"model": "tiny-vl", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    r = post(create_app(vl_engine, "tiny-vl"), body)
    err = r.json()["error"]
    assert r.status_code == 400 and message in err["message"], err
    assert err["param"] == "messages[0].content[1]" + suffix
    assert not vl_engine._commands and not vl_engine.step_loop.requests


def test_image_outside_a_user_turn_is_a_400(vl_engine):
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_url(8, 8, 0)}}]},
            {"role": "user", "content": "and?"}]
    r = post(create_app(vl_engine, "tiny-vl"), {"model": "tiny-vl", "messages": msgs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content[0]"
    assert "user turns only" in r.json()["error"]["message"]


def test_too_many_image_tokens_for_the_context_is_a_400(vl_engine, vl):
    url = data_url(64, 48, seed=5)
    n = preprocess(url, vl.cfg).n_tokens
    assert n < 80  # one image fits; two do not
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 2}]
    r = post(create_app(vl_engine, "tiny-vl"), {"model": "tiny-vl", "messages": msgs})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages", err
    assert f"{2 * n} of them in 2 image span(s)" in err["message"] and "context of 80 tokens" in err["message"]
    assert not vl_engine._commands and not vl_engine.step_loop.requests


def test_image_on_a_text_only_model_is_a_400(model):
    engine = Engine(model, tiny_tokenizer(), max_model_len=64)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(8, 8, 0)}}]}]
    r = post(create_app(engine, "tiny"), {"model": "tiny", "messages": msgs})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages[0].content[0]"
    assert "takes no images" in err["message"] and "vision_n_layers = 0" in err["message"]
    assert not engine._commands and not engine.step_loop.requests
