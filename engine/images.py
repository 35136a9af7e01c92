"""Images of serving requests (docs/vision.md, docs/serving.md).

A request's prompt holds one ``image_token_id`` placeholder per image; :func:`prompt_images`
replaces each by its image's span (checked against the model, the tokenizer and the context) and
returns a :class:`PromptImages` that travels with the request: the preprocessed images with the
start of their spans, and the digests that enter the prefix store's keys. The step loop asks
:func:`chunk_spans` for the image spans of each prefill chunk; a request's images are encoded once
per prefill of its prompt (again only if a preemption makes it recompute).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from flashrt.graphs import chat_format
from flashrt.graphs.image_processor import expand_prompt

from .errors import PromptTooLong, RequestError


@dataclass
class PromptImages:
    """``found``: ``[(span start, ImageInput)]`` over the expanded prompt; ``keys``: ``[(span
    start, digest)]`` (what the images add to a prefix key); ``spans``: the encoded spans of the
    whole prompt while it is being prefilled."""

    found: list
    keys: list = field(default_factory=list)
    spans: object = None

    @property
    def n_tokens(self) -> int:
        return sum(item.n_tokens for _, item in self.found)


def check_vision(model, tokenizer, param: str = "images") -> None:
    """``RequestError`` unless ``model`` has a vision tower and ``tokenizer`` spells the image
    placeholder as the config's ``image_token_id``."""
    if model.vision is None:
        raise RequestError(param, f"model {model.cfg.name!r} takes no images (it has no vision tower: "
                           f"vision_n_layers = 0)")
    token_id = getattr(tokenizer, "token_id", None)
    tid = token_id(chat_format.IMAGE) if token_id is not None else None
    if tid != model.cfg.image_token_id:
        raise RequestError(param, f"the tokenizer spells the image placeholder {chat_format.IMAGE} as {tid}, "
                           f"expected the config's image_token_id {model.cfg.image_token_id}")


def prompt_images(model, tokenizer, ids: list[int], images, max_tokens: int | None,
                  max_model_len: int) -> tuple[list[int], PromptImages | None]:
    """(``ids`` with every placeholder expanded to its image's span, the request's images) or
    (``ids``, None) without images. ``images``: the prompt's images in order (a path, bytes, PIL
    image, data URL or ``ImageInput`` each). Bad images, a model without a vision tower, a count
    that does not match the placeholders and spans that leave no room in the context are
    ``RequestError``s (``PromptTooLong`` for the last)."""
    if images is None or (isinstance(images, (list, tuple)) and not images):
        return ids, None
    if not isinstance(images, (list, tuple)):
        raise RequestError("images", f"expected a list of images, got {type(images).__name__}")
    check_vision(model, tokenizer)
    try:
        expanded, _, found = expand_prompt(ids, list(images), model.cfg)
    except ValueError as exc:
        text = str(exc)
        raise RequestError(text.split(":", 1)[0] if text.startswith(("image", "images")) else "images",
                           text) from None
    pics = PromptImages(found, [(start, item.digest) for start, item in found])
    n, new = len(expanded), max(max_tokens or 1, 1)
    if n + new > max_model_len:
        raise PromptTooLong("prompt", f"{n} prompt tokens ({pics.n_tokens} of them in {len(found)} image "
                            f"span(s)) + max_tokens {new} exceed the model's context of {max_model_len} tokens")
    return expanded, pics


def batch_images(model, tokenizer, ids: list[list[int]], images, params: list, max_model_len: int):
    """``prompt_images`` for each prompt of a batch: ``images`` is None or one entry per prompt (a
    list of images, one image, or None). Returns ``[(ids, PromptImages | None)]``; errors name the
    prompt (``images[i]``)."""
    if images is None:
        return [(p, None) for p in ids]
    if not isinstance(images, (list, tuple)) or len(images) != len(ids):
        got = f"{len(images)} entries" if isinstance(images, (list, tuple)) else type(images).__name__
        raise RequestError("images", f"expected one entry (a list of images or None) per prompt ({len(ids)}), "
                           f"got {got}")
    out = []
    for i, (p, entry, sp) in enumerate(zip(ids, images, params)):
        entry = entry if entry is None or isinstance(entry, (list, tuple)) else [entry]
        try:
            out.append(prompt_images(model, tokenizer, p, entry, sp.max_tokens, max_model_len))
        except RequestError as exc:
            text = str(exc).removeprefix(f"{exc.param}:").strip()
            raise type(exc)(f"images[{i}]" if exc.param != "prompt" else f"prompts[{i}]", text) from None
    return out


def chunk_spans(model, pics: PromptImages | None, prompt_len: int, c0: int, c1: int):
    """The image spans (:class:`~flashrt.graphs.vision.ImageSpans`) of prompt positions ``c0 ..
    c1 - 1``, or None. The whole prompt's spans are encoded at the first chunk that needs them and
    dropped after the prompt's last chunk."""
    if pics is None or c0 >= prompt_len:
        return None
    if pics.spans is None:
        pics.spans = model.image_spans([pics.found], prompt_len)
    part = pics.spans.chunk(c0, min(c1, prompt_len))
    if c1 >= prompt_len:
        pics.spans = None
    return part


def image_keys(pics: PromptImages | None) -> list:
    """``[(span start, digest)]`` of a request's images (empty without images)."""
    return [] if pics is None else pics.keys
