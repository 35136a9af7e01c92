"""Vision encoder time per image at the token budget's sizes, and time to first token of an
image + text prompt, on the automatic backend choice (CUDA kernels) and the reference backend.

    python benchmarks/vision.py --out benchmarks/results/h200-vision.json
    python benchmarks/vision.py --tiny --device cpu      # a smoke run at tiny-vl's dimensions

Encoder: the release vision tower (32 layers, width 1024, 16 heads, patch 14, aligner 3x3 to
5120) with random weights; per source size: the preprocessing (host), then ViT + aligner + span
embeddings (median of ``--repeats`` after a warm-up). TTFT: ``small`` with a vision tower of that
width (the aligner maps to small's width) through ``generate``: preprocessing, encoding and the
prefill of the whole prompt, to the first token's logits (median after a warm-up), against the
same text prompt without the image.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np
import torch
from PIL import Image

import flashrt
from flashrt.engine import generate
from flashrt.graphs.config import shipped_config
from flashrt.graphs.device_weights import device_weights
from flashrt.graphs.image_processor import preprocess
from flashrt.graphs.model import Model
from flashrt.graphs.vision import VisionTower
from results_io import write_json

RELEASE_VISION = dict(vision_n_layers=32, vision_dim=1024, vision_n_heads=16, vision_inter_dim=2816,
                      vision_patch_size=14, vision_rope_theta=10000.0, vision_downsample_ratio=3,
                      vision_max_n_token=1024, vision_min_pixels=544 * 544, vision_max_wh_ratio=None)
SIZES = ((448, 448), (1024, 768), (1920, 1080), (1344, 1344), (4000, 3000), (800, 3000))
TINY_SIZES = ((40, 40), (64, 48))


def picture(w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8))


def timed(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def backends(device: torch.device):
    yield "auto", contextlib.nullcontext()
    yield "reference", flashrt.use_backend("reference")


def encoder_rows(cfg, device, sizes, repeats, sync) -> list[dict]:
    weights = device_weights(cfg, device, select=lambda name: name.startswith(("vision.", "aligner.", "image_")))
    tower = VisionTower(cfg, weights)
    rows = []
    for w, h in sizes:
        img = picture(w, h)
        t0 = time.perf_counter()
        item = preprocess(img, cfg)
        pre_s = time.perf_counter() - t0
        row = {"source": f"{w}x{h}", "patches": item.patches.shape[0], "grid": [item.n_llm_h, item.n_llm_w],
               "span_tokens": item.n_tokens, "preprocess_ms": pre_s * 1e3}
        for name, ctx in backends(device):
            with ctx, flashrt.value_checks(False), torch.inference_mode():
                row[f"encode_ms_{name}"] = timed(lambda: tower.span_embeddings(item), repeats, sync) * 1e3
        rows.append(row)
        print(row, flush=True)
    return rows


def ttft_rows(cfg, device, size, text_tokens, repeats, sync) -> list[dict]:
    model = Model(cfg, device_weights(cfg, device))
    g = torch.Generator().manual_seed(3)
    text = torch.randint(3, cfg.image_token_id, (text_tokens,), generator=g).tolist()
    img = picture(*size)
    rows = []
    for name, ctx in backends(device):
        with ctx, flashrt.value_checks(False), torch.inference_mode():
            for label, prompt, images in (("image+text", [cfg.image_token_id] + text, [[img]]), ("text", text, None)):
                run = lambda: generate(model, [prompt], 1, images=images, cuda_graph=False)
                result = run()
                row = {"backend": name, "prompt": label, "prompt_tokens": result.prompt_tokens,
                       "image_tokens": result.image_tokens,
                       "ttft_ms": timed(lambda: run(), repeats, sync) * 1e3}
                rows.append(row)
                print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny-vl dimensions (a smoke run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for name in ("repeats", "text_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if args.tiny:
        enc_cfg = ttft_cfg = shipped_config("tiny-vl")
        sizes, ttft_size = TINY_SIZES, TINY_SIZES[-1]
    else:
        enc_cfg = shipped_config("v4.1-flash").replace(**RELEASE_VISION)
        ttft_cfg = shipped_config("small").replace(**RELEASE_VISION)
        sizes, ttft_size = SIZES, (1920, 1080)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "encoder_config": {k: getattr(enc_cfg, k) for k in RELEASE_VISION},
              "encoder": encoder_rows(enc_cfg, device, sizes, args.repeats, sync)}
    if not args.skip_ttft:
        result["ttft_model"] = ttft_cfg.name
        result["ttft_image"] = f"{ttft_size[0]}x{ttft_size[1]}"
        result["ttft"] = ttft_rows(ttft_cfg, device, ttft_size, args.text_tokens, args.repeats, sync)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
