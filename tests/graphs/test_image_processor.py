"""Image preprocessing (graphs/image_processor.py) against independent computations of the
published rule: sizes and grids, pixels and patch order, EXIF, input kinds and bad inputs."""
from __future__ import annotations

import base64
import io
import math
import random
import struct
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from flashrt.graphs import image_processor as ip

RELEASE = SimpleNamespace(vision_patch_size=14, vision_downsample_ratio=3, vision_max_n_token=1024,
                          vision_min_pixels=544 * 544, vision_max_wh_ratio=None, image_token_id=129264,
                          vision_n_layers=32)
CAPPED = SimpleNamespace(vision_patch_size=14, vision_downsample_ratio=3, vision_max_n_token=384,
                         vision_min_pixels=147456, vision_max_wh_ratio=8, image_token_id=7, vision_n_layers=2)
SMALL = SimpleNamespace(vision_patch_size=4, vision_downsample_ratio=2, vision_max_n_token=40,
                        vision_min_pixels=0, vision_max_wh_ratio=None, image_token_id=7, vision_n_layers=2)


def rule(w, h, cfg):
    """The published size rule, restated step by step: (grid h, grid w, pixel h, pixel w)."""
    p, r, n = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    if cfg.vision_max_wh_ratio is not None:
        w = min(w, h * cfg.vision_max_wh_ratio)
    if w * h < cfg.vision_min_pixels:
        k = math.sqrt(cfg.vision_min_pixels / (w * h))
        w, h = int(w * k), int(h * k)
    ph, pw = -(-h // p) * p, -(-w // p) * p

    def cells(ph, pw):
        return -(-(ph // p) // r), -(-(pw // p) // r)

    gh, gw = cells(ph, pw)
    if gh * (gw + 1) + 2 > n:
        a = h / w
        ws = math.sqrt((n - 2) / a + 0.25) - 0.5
        hs = ws * a
        c = p * r
        if ws < 1:
            ph, pw = (n - 2) // 2 * c, c
        elif hs < 1:
            ph, pw = c, (n - 3) * c
        else:
            beta = min(math.floor(ws) * c / w, math.floor(hs) * c / h)
            ph, pw = math.floor(h * beta / p) * p, math.floor(w * beta / p) * p
        gh, gw = cells(ph, pw)
    return gh, gw, ph, pw


@pytest.mark.parametrize("cfg", [RELEASE, CAPPED, SMALL])
def test_grid_plan_matches_the_rule_and_fits_the_budget(cfg):
    rng = random.Random(hash(cfg.vision_max_n_token))
    sizes = [(rng.randint(1, 6000), rng.randint(1, 6000)) for _ in range(400)]
    sizes += [(1, 4000), (4000, 1), (1, 1), (20000, 3), (3, 20000)]
    for w, h in sizes:
        got = ip.grid_plan(w, h, cfg)
        assert got == rule(w, h, cfg), (w, h)
        gh, gw, ph, pw = got
        assert ip.span_length(gh, gw) <= cfg.vision_max_n_token
        assert ph % cfg.vision_patch_size == 0 and pw % cfg.vision_patch_size == 0 and ph > 0 and pw > 0


def test_grid_plan_hand_computed_release_cases():
    # 1920x1080: rounded up 78x138 patches -> 26x46 cells (1224 tokens) > 1024; solved:
    # w* = sqrt(1022 / 0.5625 + 1/4) - 1/2 = 42.13, h* = 23.70; beta = min(42*42/1920, 23*42/1080)
    assert ip.grid_plan(1920, 1080, RELEASE) == (23, 41, 966, 1708)
    # 100x50 is under 544^2 pixels: scaled by sqrt(295936 / 5000) to 769x384, rounded up to 770x392
    assert ip.grid_plan(100, 50, RELEASE) == (10, 19, 392, 770)
    # 1008x1008: 72x72 patches -> 24x24 cells, 24 * 25 + 2 = 602 tokens fit
    assert ip.grid_plan(1008, 1008, RELEASE) == (24, 24, 1008, 1008)


def test_span_layout():
    assert ip.span_types(2, 3) == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]
    assert ip.span_length(2, 3) == 10
    assert (ip.TEXT, ip.IMAGE_START, ip.IMAGE, ip.IMAGE_NEW_LINE, ip.IMAGE_END) == (-1, 0, 1, 2, 3)


def rgb(w, h, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def bf16(x):
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)


def test_pixels_normalisation_and_patch_order():
    pix = rgb(24, 16)  # already the planned size under SMALL: no resize, no padding
    item = ip.preprocess(Image.fromarray(pix), SMALL)
    assert (item.n_vit_h, item.n_vit_w, item.n_llm_h, item.n_llm_w) == (4, 6, 2, 3)
    p = 4
    want = torch.empty(24, 3, p, p, dtype=torch.bfloat16)
    for i in range(4):
        for j in range(6):
            block = pix[i * p:(i + 1) * p, j * p:(j + 1) * p].transpose(2, 0, 1)
            want[i * 6 + j] = bf16((block / 255.0 - 0.5) / 0.5)
    assert item.patches.dtype == torch.bfloat16
    assert torch.equal(item.patches, want)


def test_padding_centres_the_image_on_grey():
    pix = rgb(10, 24, seed=1)  # planned 12 x 24 (10 rounded up to the patch): one grey column each side
    item = ip.preprocess(Image.fromarray(pix), SMALL)
    assert ip.grid_plan(10, 24, SMALL) == (3, 2, 24, 12)
    assert (item.n_vit_h, item.n_vit_w) == (6, 3)
    image = item.patches.view(6, 3, 3, 4, 4).permute(2, 0, 3, 1, 4).reshape(3, 24, 12)
    grey = bf16(np.array((127 / 255 - 0.5) / 0.5))
    assert torch.all(image[:, :, 0] == grey) and torch.all(image[:, :, 11] == grey)
    assert torch.equal(image[:, :, 1:11], bf16((pix.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5))


def exif_png(w, h, orientation) -> bytes:
    image = Image.fromarray(rgb(w, h, seed=2))
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    image.save(buf, format="JPEG", exif=exif, quality=95)
    return buf.getvalue()


def test_exif_orientation_ignored_as_published_applied_on_request():
    data = exif_png(48, 24, orientation=6)  # stored landscape; the tag says rotate 90 degrees clockwise
    plain = ip.preprocess(data, SMALL)
    upright = ip.preprocess(data, SMALL, exif_transpose=True)
    assert plain.n_vit_w > plain.n_vit_h and upright.n_vit_h > upright.n_vit_w
    rotated = Image.open(io.BytesIO(data)).convert("RGB").transpose(Image.Transpose.ROTATE_270)
    assert torch.equal(upright.patches, ip.preprocess(rotated, SMALL).patches)
    assert torch.equal(plain.patches, ip.preprocess(Image.open(io.BytesIO(data)), SMALL).patches)


def png_bytes(w, h, seed=3) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb(w, h, seed)).save(buf, format="PNG")
    return buf.getvalue()


def test_every_input_kind_gives_the_same_patches(tmp_path):
    data = png_bytes(30, 18)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    items = [ip.preprocess(s, SMALL) for s in (str(path), path, data, bytearray(data), url,
                                                Image.open(io.BytesIO(data)))]
    for item in items[1:]:
        assert torch.equal(item.patches, items[0].patches)
        assert item.digest == items[0].digest
    assert ip.preprocess(items[0], SMALL) is items[0]
    assert ip.preprocess(png_bytes(30, 18, seed=4), SMALL).digest != items[0].digest


@pytest.mark.parametrize("source, match", [
    ("https://example.com/cat.png", "network"),
    ("ftp://host/x.png", "network"),
    ("data:image/png,notbase64", "base64 data URL"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("/no/such/file.png", "no such file"),
    (12, "got int"),
    (b"", "no bytes"),
    (b"not an image at all", "cannot decode"),
])
def test_bad_sources_are_clear_errors(source, match):
    with pytest.raises(ValueError, match=match):
        ip.preprocess(source, SMALL)


def test_truncated_zero_sized_and_huge_images():
    data = png_bytes(64, 64)
    with pytest.raises(ValueError, match="cannot decode"):
        ip.preprocess(data[: len(data) // 2], SMALL)
    with pytest.raises(ValueError, match="non-empty image"):
        ip.preprocess(Image.new("RGB", (0, 5)), SMALL)
    # PNGs whose header claims 12000^2 / 20000^2 pixels: refused from the header, before decoding
    for side in (12000, 20000):
        chunk = b"IHDR" + struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
        huge = data[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[33:]
        with pytest.raises(ValueError, match="pixel limit"):
            ip.preprocess(huge, SMALL)


def test_expand_prompt_places_spans():
    a, b = Image.fromarray(rgb(24, 16)), Image.fromarray(rgb(8, 8))
    tokens, types, spans = ip.expand_prompt([5, 7, 9, 7], [a, b], SMALL)
    (s0, i0), (s1, i1) = spans
    assert s0 == 1 and s1 == 1 + i0.n_tokens + 1
    assert tokens == [5] + [7] * i0.n_tokens + [9] + [7] * i1.n_tokens
    assert types == [-1] + i0.types + [-1] + i1.types
    with pytest.raises(ValueError, match="2 image placeholder"):
        ip.expand_prompt([7, 7], [a], SMALL)
    with pytest.raises(ValueError, match="no vision tower"):
        ip.expand_prompt([7], [a], SimpleNamespace(**{**vars(SMALL), "vision_n_layers": 0}))
