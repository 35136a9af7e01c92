"""Image content parts of chat requests (OpenAI's ``image_url`` parts, docs/serving.md).

A user turn's ``content`` may mix ``{"type": "text", "text": ...}`` and ``{"type": "image_url",
"image_url": {"url": "data:image/...;base64,..."}}`` parts; each image part renders as one image
placeholder where it stands (``flashrt.graphs.chat_format``) and the engine expands it to the
image's span. Only base64 ``data:`` URLs are taken: the server fetches nothing over the network and
reads no file of its own. Every refusal is a :class:`~.protocol.BadRequest` naming the part.
"""
from __future__ import annotations

import os

from flashrt.graphs.image_processor import preprocess

from ..errors import RequestError
from ..images import check_vision
from .protocol import BadRequest

IMAGE_PART = "image_url"
DECODE_WORKERS = max(1, min(4, os.cpu_count() or 1))  # threads that decode request images at once


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in (IMAGE_PART, "image")


def has_images(content) -> bool:
    """True for a content list holding an image part."""
    return isinstance(content, list) and any(is_image_part(p) for p in content)


def _data_url(part: dict, where: str) -> str:
    if part.get("type") != IMAGE_PART:
        raise BadRequest(where, f"{where}: expected an image_url part with a base64 data URL, got a "
                         f"{part.get('type')!r} part")
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise BadRequest(f"{where}.image_url", f"{where}.image_url: expected {{'url': 'data:image/...;base64,...'}}, "
                         f"got {part.get('image_url')!r:.80}")
    if not url.startswith("data:"):
        raise BadRequest(f"{where}.image_url", f"{where}.image_url: expected a base64 data URL "
                         f"(data:image/...;base64,...), got {url!r:.80}; the server fetches no URLs")
    return url


def request_images(model, tokenizer, messages: list[dict]) -> list:
    """The preprocessed images (``ImageInput``) of a chat request's messages, in the order their
    placeholders are rendered; BadRequest for a model without a vision tower, a part that is not
    a data URL or an image that does not decode."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not has_images(content):
            continue
        for k, part in enumerate(content):
            if not is_image_part(part):
                continue
            where = f"messages[{i}].content[{k}]"
            if m.get("role") != "user":
                raise BadRequest(where, f"{where}: images are taken in user turns only, got one in a "
                                 f"{m.get('role')!r} turn")
            try:
                check_vision(model, tokenizer, where)
            except RequestError as exc:
                raise BadRequest(where, str(exc)) from None
            url = _data_url(part, where)
            try:
                item = preprocess(url, model.cfg)
            except ValueError as exc:
                raise BadRequest(f"{where}.image_url", f"{where}.image_url: {exc}") from None
            _ = item.digest  # hashed here, in the decoding thread, not on the event loop
            out.append(item)
    return out
