"""Images as they come: every Pillow mode becomes RGB as the published processor's
``convert("RGB")`` makes it (checked against numpy restatements), an animated GIF gives its first
frame, and broken or hostile files (truncated, empty, zero-sized, decompression bombs, text, random
corruption) are one ``ValueError`` each, in ``preprocess`` and in ``flashrt run --image``."""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from flashrt.cli.commands import main
from flashrt.graphs import image_processor as ip

from test_image_processor import SMALL


@pytest.fixture
def rng():
    return np.random.default_rng(int(torch.randint(0, 1 << 30, ())))


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def same(source, rgb: np.ndarray) -> bool:
    got, want = ip.preprocess(source, SMALL), ip.preprocess(Image.fromarray(rgb.astype(np.uint8), "RGB"), SMALL)
    return (got.n_vit_h, got.n_vit_w) == (want.n_vit_h, want.n_vit_w) and torch.equal(got.patches, want.patches)


def size(rng):
    return int(rng.integers(9, 40)), int(rng.integers(9, 40))


def test_alpha_is_dropped_not_composited(rng):
    h, w = size(rng)
    rgba = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    assert same(encode(Image.fromarray(rgba, "RGBA"), "PNG"), rgba[..., :3])
    la = rng.integers(0, 256, (h, w, 2), dtype=np.uint8)
    assert same(encode(Image.fromarray(la, "LA"), "PNG"), np.repeat(la[..., :1], 3, axis=2))


def test_grey_bilevel_and_palette(rng):
    h, w = size(rng)
    grey = rng.integers(0, 256, (h, w), dtype=np.uint8)
    assert same(encode(Image.fromarray(grey, "L"), "PNG"), np.repeat(grey[..., None], 3, axis=2))
    bits = rng.integers(0, 2, (h, w)).astype(bool)
    assert same(encode(Image.fromarray(bits), "PNG"), np.repeat(bits[..., None] * 255, 3, axis=2))
    palette = rng.integers(0, 256, (256, 3), dtype=np.uint8)
    index = rng.integers(0, 256, (h, w), dtype=np.uint8)
    pal = Image.fromarray(index, "P")
    pal.putpalette(palette.ravel().tolist())
    assert same(encode(pal, "PNG", transparency=int(index[0, 0])), palette[index])


def test_sixteen_bit_grey_saturates(rng):
    h, w = size(rng)
    deep = rng.integers(0, 600, (h, w), dtype=np.uint16)  # about half the values above 255
    data = encode(Image.fromarray(deep), "PNG")  # a 16-bit grey PNG
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    assert same(data, np.repeat(np.minimum(deep, 255)[..., None], 3, axis=2))


def test_cmyk(rng):
    h, w = size(rng)
    cmyk = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    got = np.asarray(ip.open_image(encode(Image.fromarray(cmyk, "CMYK"), "TIFF")), dtype=np.int32)
    c, k = cmyk[..., :3].astype(np.int32), cmyk[..., 3:].astype(np.int32)
    assert np.abs(got - (255 - c) * (255 - k) / 255).max() <= 1  # subtractive, black scales every channel
    assert same(encode(Image.fromarray(cmyk, "CMYK"), "JPEG"),
                np.asarray(Image.open(io.BytesIO(encode(Image.fromarray(cmyk, "CMYK"), "JPEG"))).convert("RGB")))


@pytest.mark.parametrize("fmt, kw", [("GIF", {}), ("PNG", {}), ("WEBP", {"lossless": True})])
def test_animated_image_gives_its_first_frame(rng, fmt, kw):
    h, w = size(rng)
    colours = rng.integers(0, 256, (8, 3), dtype=np.uint8)  # few colours: the GIF palette holds them exactly
    frames = [colours[rng.integers(0, 8, (h, w))] for _ in range(3)]
    data = encode(Image.fromarray(frames[0]), fmt, save_all=True,
                  append_images=[Image.fromarray(f) for f in frames[1:]], duration=50, loop=0, **kw)
    assert Image.open(io.BytesIO(data)).n_frames == 3
    assert same(data, frames[0]) and not same(data, frames[1])
    opened = Image.open(io.BytesIO(data))
    opened.seek(2)  # a PIL image left on a later frame still gives the first
    assert same(opened, frames[0])


def png_header(width: int, height: int) -> bytes:
    base = encode(Image.new("RGB", (4, 4)), "PNG")
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return base[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + base[33:]


def bad_files(rng) -> list[tuple[bytes, str]]:
    h, w = size(rng)
    pic = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    png, jpg = encode(pic, "PNG"), encode(pic, "JPEG")
    return [
        (png[: int(rng.integers(40, len(png) - 20))], "cannot decode"),  # truncated in the pixel data
        (jpg[: int(rng.integers(200, len(jpg) - 10))], "cannot decode"),
        (png[:20], "cannot decode"),  # truncated in the header
        (b"", "holds no bytes"),
        (png_header(0, 7), "cannot decode"),  # a zero-sized image (Pillow refuses its header)
        (png_header(30000, 30000), "pixel limit"),  # a decompression bomb: refused from the header
        (png_header(10000, 9000), "pixel limit"),  # between Pillow's warning and its error
        ("the quick brown fox\n".encode() * 20, "not in an image format Pillow reads"),
    ]


def test_bad_files_are_one_value_error(rng, tmp_path):
    for k, (data, match) in enumerate(bad_files(rng)):
        with pytest.raises(ValueError, match=match):
            ip.preprocess(data, SMALL)
        path = tmp_path / f"bad{k}.png"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=match):
            ip.preprocess(str(path), SMALL)
    with pytest.raises(ValueError, match="a directory"):
        ip.preprocess(str(tmp_path), SMALL)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP"])
def test_corrupted_bytes_never_escape_as_other_errors(rng, fmt):
    pic = Image.fromarray(rng.integers(0, 256, (24, 20, 3), dtype=np.uint8))
    data = bytearray(encode(pic, fmt))
    for _ in range(40):
        bad = bytearray(data)
        for i in rng.integers(0, len(bad), int(rng.integers(1, 8))):
            bad[i] = int(rng.integers(0, 256))
        bad = bytes(bad[: int(rng.integers(1, len(bad) + 1))])
        try:
            out = ip.preprocess(bad, SMALL)
        except ValueError as exc:
            assert str(exc).startswith("image:"), exc
        else:
            assert out.patches.shape[1:] == (3, 4, 4)


def test_cli_run_refuses_bad_images_in_one_line(rng, tmp_path, capsys, monkeypatch):
    from flashrt.engine import run as run_mod
    monkeypatch.setattr(run_mod, "load_model", lambda *a, **k: pytest.fail("loaded a model for a bad image"))
    for k, (data, match) in enumerate(bad_files(rng)):
        path = tmp_path / f"in{k}.img"
        path.write_bytes(data)
        rc = main(["run", "--model", "tiny-vl", "--image", str(path), "--prompt", "x", "--max-new-tokens", "1"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "\n" not in err and "Traceback" not in err, err
        assert match in err and str(path) in err, err
