"""Image preprocessing as the published ``inference/image_processor.py`` does it (docs/vision.md).

An image becomes a ``n_vit_h x n_vit_w`` grid of ``p x p`` patches for the ViT; the aligner merges
``r x r`` patches into one token, so the LLM sees a ``n_llm_h x n_llm_w`` grid laid out as

    IMAGE_START, (IMAGE * n_llm_w, IMAGE_NEW_LINE) * n_llm_h, IMAGE_END

Every position of that span carries ``image_token_id``; only its token type tells them apart.

Size rule (``p`` = ``vision_patch_size``, ``r`` = ``vision_downsample_ratio``, budget =
``vision_max_n_token``): a width above ``vision_max_wh_ratio`` x height counts as that ratio; an
image under ``vision_min_pixels`` counts as scaled up to it (``int`` of each side times
``sqrt(min / area)``); each side is rounded up to a multiple of ``p``. When the span of that size
would exceed the budget, the size is solved from the aspect ratio ``a = h / w``:
``w* = sqrt((budget - 2) / a + 1/4) - 1/2``, ``h* = a w*`` (the real solution of
``h* (w* + 1) + 2 = budget``); below one cell (``p r``) in width the image becomes one column of
``(budget - 2) // 2`` cells, below one cell in height one row of ``budget - 3`` cells; otherwise
``beta = min(floor(w*) p r / w, floor(h*) p r / h)`` and each side is ``floor(side beta / p) p``.

Pixels: RGB (``convert("RGB")``, as published: alpha is dropped, not composited; a palette is
looked up; grey is repeated; 16-bit grey saturates at 255; CMYK as Pillow converts it; an animated
image gives its first frame), stretched to the size when the source width is at least
``vision_max_wh_ratio`` x its height, else fitted inside it with the aspect kept and centred on
grey 127 (Pillow's ``ImageOps.pad``, bicubic), scaled to ``[-1, 1]`` (``(x / 255 - 0.5) / 0.5``)
and cast to bf16; patches in row-major grid order, each ``[3, p, p]``. The published processor
reads pixels as stored and ignores the EXIF orientation tag; ``exif_transpose=True`` applies it.
"""
from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
MAX_SOURCE_PIXELS = 89_478_485  # Pillow's decompression-bomb threshold: larger sources are refused
PAD_GREY = (127, 127, 127)
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError as exc:  # a dependency of the package; only a broken install lacks it
        raise ImportError("images need Pillow (pip install Pillow)") from exc
    return Image, ImageOps


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    """Tokens of an image span: one per grid cell, one newline per row, start and end."""
    return n_llm_h * (n_llm_w + 1) + 2


def span_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    """Token types of an image span, in order."""
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]


def _llm_grid(height: int, width: int, p: int, r: int) -> tuple[int, int]:
    return math.ceil((height // p) / r), math.ceil((width // p) / r)


def _solve(height, width, p: int, r: int, budget: int) -> tuple[int, int]:
    """(height, width) in pixels from the aspect ratio when the rounded-up size is over budget."""
    aspect = height / width
    w_star = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    h_star = w_star * aspect
    cell = p * r
    if w_star < 1.0:
        return (budget - 2) // 2 * cell, cell
    if h_star < 1.0:
        return cell, (budget - 3) * cell
    beta = min(math.floor(w_star) * cell / width, math.floor(h_star) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def grid_plan(width: int, height: int, cfg) -> tuple[int, int, int, int]:
    """``(n_llm_h, n_llm_w, height, width)``: token grid and pixel size of a ``width x height``
    source under ``cfg``'s ``vision_*`` keys (module doc)."""
    p, r, budget = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    ratio = cfg.vision_max_wh_ratio
    if ratio is not None and width > height * ratio:
        width = height * ratio
    if 0 < width * height < cfg.vision_min_pixels:
        scale = (cfg.vision_min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_h, best_w = math.ceil(height / p) * p, math.ceil(width / p) * p
    grid = _llm_grid(best_h, best_w, p, r)
    if span_length(*grid) > budget:
        best_h, best_w = _solve(height, width, p, r, budget)
        grid = _llm_grid(best_h, best_w, p, r)
        assert span_length(*grid) <= budget, (width, height, grid)
    return grid[0], grid[1], best_h, best_w


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: bf16 ``patches [n_vit_h * n_vit_w, 3, p, p]`` and its grids."""

    patches: torch.Tensor = field(repr=False)
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def n_tokens(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)

    @property
    def types(self) -> list[int]:
        return span_types(self.n_llm_h, self.n_llm_w)

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of the grid and the patch bytes: what the image contributes to a prefix key
        (computed once per image)."""
        h = hashlib.sha256(f"{self.n_vit_h}x{self.n_vit_w}:{tuple(self.patches.shape)};".encode())
        h.update(self.patches.contiguous().view(torch.int16).numpy().tobytes())
        return h.hexdigest()


def _describe(source) -> str:
    """``source`` for an error message: a file path whole (the user must find the file), anything
    else (bytes, a data URL, an object) cut to 80 characters."""
    text = repr(source)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and not source.startswith("data:")):
        return text
    return text if len(text) <= 80 else text[:77] + "..."


def _bytes_of(source) -> bytes:
    """The encoded bytes of a path, raw bytes or a base64 ``data:`` URL."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, str) and source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or ";base64" not in header:
            raise ValueError(f"image: expected a base64 data URL (data:image/...;base64,...), got {_describe(source)}")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"image: the data URL's payload is not valid base64: {_describe(source)}") from None
    if isinstance(source, str) and URL_SCHEME.match(source):
        raise ValueError(f"image: {_describe(source)} is a URL; flashrt fetches nothing over the network "
                         f"(pass a file path, bytes, a PIL image or a base64 data URL)")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            why = "a directory" if path.is_dir() else "no such file"
            raise ValueError(f"image: expected an image file, got {str(path)!r} ({why})")
        return path.read_bytes()
    raise ValueError(f"image: expected a file path, bytes, a PIL image or a base64 data URL, "
                     f"got {type(source).__name__}")


def _decode_error(source, exc: Exception) -> ValueError:
    Image, _ = _pil()
    why = ("not in an image format Pillow reads" if isinstance(exc, Image.UnidentifiedImageError)
           else str(exc) or type(exc).__name__)
    return ValueError(f"image: cannot decode {_describe(source)}: {why}")


def open_image(source, exif_transpose: bool = False):
    """``source`` (path, bytes, PIL image, data URL) -> an RGB PIL image, checked: a truncated or
    unreadable file, a zero-sized image and one over ``MAX_SOURCE_PIXELS`` are ``ValueError``s.
    Any mode becomes RGB as Pillow's ``convert("RGB")`` makes it (module doc); an animated image
    gives its first frame."""
    Image, ImageOps = _pil()
    opened = source if isinstance(source, Image.Image) else None
    if opened is None:
        data = _bytes_of(source)
        if not data:
            raise ValueError(f"image: {_describe(source)} holds no bytes")
        try:
            with warnings.catch_warnings():  # the size is checked below, from the header
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                opened = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError:
            raise ValueError(f"image: {_describe(source)} is over the {MAX_SOURCE_PIXELS} pixel limit (Pillow "
                             f"refused it as a possible decompression bomb)") from None
        except Exception as exc:  # noqa: BLE001 - any failure to parse untrusted bytes is a bad image
            raise _decode_error(source, exc) from None
    width, height = opened.size
    if width <= 0 or height <= 0:
        raise ValueError(f"image: expected a non-empty image, got size {width}x{height} in {_describe(source)}")
    if width * height > MAX_SOURCE_PIXELS:
        raise ValueError(f"image: {_describe(source)} is {width}x{height} = {width * height} pixels, over the "
                         f"{MAX_SOURCE_PIXELS} pixel limit")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            if getattr(opened, "is_animated", False):
                opened.seek(0)
            if exif_transpose:
                opened = ImageOps.exif_transpose(opened)
            return opened.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt data surfaces on load
        raise _decode_error(source, exc) from None


def preprocess(source, cfg, exif_transpose: bool = False) -> ImageInput:
    """One image (path, bytes, PIL image, data URL, or an :class:`ImageInput` already made for
    ``cfg``) -> :class:`ImageInput` under ``cfg``'s ``vision_*`` keys."""
    p = cfg.vision_patch_size
    if isinstance(source, ImageInput):
        if tuple(source.patches.shape[1:]) != (3, p, p):
            raise ValueError(f"image: an ImageInput of {tuple(source.patches.shape[1:])} patches, "
                             f"expected (3, {p}, {p})")
        return source
    _, ImageOps = _pil()
    image = open_image(source, exif_transpose)
    n_llm_h, n_llm_w, height, width = grid_plan(image.width, image.height, cfg)
    ratio = cfg.vision_max_wh_ratio
    if ratio is not None and image.width >= ratio * image.height:
        image = image.resize((width, height))
    else:
        image = ImageOps.pad(image, (width, height), color=PAD_GREY)
    x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    n_vit_h, n_vit_w = height // p, width // p
    patches = x.reshape(3, n_vit_h, p, n_vit_w, p).permute(1, 3, 0, 2, 4).reshape(n_vit_h * n_vit_w, 3, p, p)
    return ImageInput(patches.contiguous(), n_vit_h, n_vit_w, n_llm_h, n_llm_w)


def expand_prompt(tokens: list[int], images: list, cfg) -> tuple[list[int], list[int], list[tuple[int, ImageInput]]]:
    """Replace each ``image_token_id`` of ``tokens`` by its image's span, in order.

    Returns (tokens, token types (``TEXT`` or a span type per position), [(span start, image)])."""
    tid = cfg.image_token_id
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"images: expected a list of images for one prompt, got {type(images).__name__}")
    if images and cfg.vision_n_layers <= 0:
        raise ValueError("images: this model has no vision tower (vision_n_layers = 0)")
    n_slots = sum(1 for t in tokens if t == tid)
    if n_slots != len(images):
        raise ValueError(f"images: the prompt has {n_slots} image placeholder(s) (token {tid}) "
                         f"but {len(images)} image(s) were given")
    out, types, spans = [], [], []
    queue = iter(images)
    for t in tokens:
        if t != tid:
            out.append(t)
            types.append(TEXT)
            continue
        item = preprocess(next(queue), cfg)
        spans.append((len(out), item))
        out += [tid] * item.n_tokens
        types += item.types
    return out, types, spans
