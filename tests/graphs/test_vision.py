"""The vision encoder and aligner (graphs/vision.py) against an independent float64 computation of
the published math on random weights: patch embedding, blocks with 2-D rotary attention and a
SwiGLU MLP, the final norm, the aligner's zero padding and channel-major blocks, the span layout."""
import math

import pytest
import torch

from flashrt.graphs.config import shipped_config
from flashrt.graphs.image_processor import ImageInput
from flashrt.graphs.init_weights import init_param
from flashrt.graphs.params import param_specs
from flashrt.graphs.vision import ImageSpans, VisionTower, interleave_halves, rope2d_factors
from flashrt import ops

from kernel_check import rel_err


@pytest.fixture(scope="module")
def vl_cfg():
    return shipped_config("tiny-vl")


def vision_weights(cfg, seed):
    keep = ("vision.", "aligner.", "image_")
    return {s.name: init_param(s, seed) for s in param_specs(cfg) if s.name.startswith(keep)}


def random_image(cfg, n_h, n_w, g):
    p = cfg.vision_patch_size
    r = cfg.vision_downsample_ratio
    patches = (torch.rand(n_h * n_w, 3, p, p, generator=g) * 2 - 1).bfloat16()
    return ImageInput(patches, n_h, n_w, -(-n_h // r), -(-n_w // r))


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rotate(t, rows, cols, theta):
    """Half-split 2-D rotation in float64: pair (t[j], t[j + hd/2]) turns by row (j < hd/4) or col."""
    hd = t.shape[-1]
    inv = theta ** (-torch.arange(hd // 4, dtype=torch.float64) * 4 / hd)
    ang = torch.cat([rows[:, None] * inv, cols[:, None] * inv], 1)[:, None, :]  # [N, 1, hd/2]
    a, b = t[..., : hd // 2], t[..., hd // 2:]
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)


def oracle(cfg, w, item):
    """float64 ViT + aligner features [n_llm_h * n_llm_w, dim]."""
    f = lambda n: w[n].double()
    D, H = cfg.vision_dim, cfg.vision_n_heads
    hd, N = D // H, item.n_vit_h * item.n_vit_w
    rows = torch.arange(N, dtype=torch.float64) // item.n_vit_w
    cols = torch.arange(N, dtype=torch.float64) % item.n_vit_w
    x = item.patches.double().flatten(1) @ f("vision.patch_embed.proj.weight").T + f("vision.patch_embed.proj.bias")
    for i in range(cfg.vision_n_layers):
        b = f"vision.blocks.{i}."
        h = rms(x, f(b + "norm1.weight"))
        q, k, v = (h @ f(b + "attn.wqkv.weight").T + f(b + "attn.wqkv.bias")).view(N, 3, H, hd).unbind(1)
        q, k = rotate(q, rows, cols, cfg.vision_rope_theta), rotate(k, rows, cols, cfg.vision_rope_theta)
        att = torch.softmax(torch.einsum("shd,thd->hst", q, k) / math.sqrt(hd), -1)
        o = torch.einsum("hst,thd->shd", att, v).reshape(N, D)
        x = x + o @ f(b + "attn.wo.weight").T + f(b + "attn.wo.bias")
        gate, up = (rms(x, f(b + "norm2.weight")) @ f(b + "mlp.w1.weight").T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ f(b + "mlp.w2.weight").T
    x = rms(x, f("vision.norm.weight")).view(item.n_vit_h, item.n_vit_w, D)
    r = cfg.vision_downsample_ratio
    out = []
    for bi in range(item.n_llm_h):
        for bj in range(item.n_llm_w):
            vec = torch.zeros(D, r, r, dtype=torch.float64)  # channel, row in block, col in block
            for ki in range(r):
                for kj in range(r):
                    i, j = bi * r + ki, bj * r + kj
                    if i < item.n_vit_h and j < item.n_vit_w:  # zero padding past the grid
                        vec[:, ki, kj] = x[i, j]
            out.append(vec.flatten())
    u = torch.stack(out) @ f("aligner.w1.weight").T + f("aligner.w1.bias")
    u = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
    return u @ f("aligner.w2.weight").T + f("aligner.w2.bias")


@pytest.mark.parametrize("grid", [(4, 6), (5, 7), (1, 3)])
def test_tower_matches_float64_oracle(vl_cfg, rng, grid):
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    w = vision_weights(vl_cfg, seed)
    item = random_image(vl_cfg, *grid, rng)
    got = VisionTower(vl_cfg, w).image_features(item)
    assert got.shape == (item.n_llm_h * item.n_llm_w, vl_cfg.dim) and got.dtype == torch.bfloat16
    assert rel_err(got, oracle(vl_cfg, w, item)) < 3e-2


def test_span_embeddings_layout(vl_cfg, rng):
    w = vision_weights(vl_cfg, 3)
    tower = VisionTower(vl_cfg, w)
    item = random_image(vl_cfg, 5, 7, rng)
    span = tower.span_embeddings(item)
    feats = tower.image_features(item).view(item.n_llm_h, item.n_llm_w, -1)
    assert span.shape[0] == item.n_tokens == len(item.types)
    pos = 1
    assert torch.equal(span[0], w["image_start"]) and torch.equal(span[-1], w["image_end"])
    for row in range(item.n_llm_h):
        assert torch.equal(span[pos:pos + item.n_llm_w], feats[row])
        assert torch.equal(span[pos + item.n_llm_w], w["image_newline"])
        pos += item.n_llm_w + 1


def test_rope2d_is_the_half_split_rotation(rng):
    n_h, n_w, H, hd = 3, 5, 2, 16
    x = torch.randn(1, n_h * n_w, H, hd, generator=rng)
    got = ops.rope(interleave_halves(x), rope2d_factors(n_h, n_w, hd, 10000.0))
    idx = torch.arange(n_h * n_w, dtype=torch.float64)
    want = rotate(x[0].double(), idx // n_w, idx % n_w, 10000.0)
    assert torch.allclose(got[0].double(), interleave_halves(want), atol=1e-5)


def test_image_spans_index_and_chunks(vl_cfg, rng):
    tower = VisionTower(vl_cfg, vision_weights(vl_cfg, 5))
    a, b = random_image(vl_cfg, 4, 4, rng), random_image(vl_cfg, 2, 6, rng)
    spans = ImageSpans.build(tower, [[(2, a)], [(1, b), (20, a)]], 40, torch.bfloat16)
    assert spans.ranges == ((0, 2, 2 + a.n_tokens), (1, 1, 1 + b.n_tokens), (1, 20, 20 + a.n_tokens))
    assert torch.equal(spans.mask[0], (torch.arange(40) >= 2) & (torch.arange(40) < 2 + a.n_tokens))
    assert torch.equal(spans.rows[spans.index[1, 20:20 + a.n_tokens]], spans.rows[spans.index[0, 2:2 + a.n_tokens]])
    part = spans.chunk(16, 24)
    assert part.ranges == ((1, 4, 8),) and part.index.shape == (2, 8)
    assert spans.chunk(30, 40) is None
    assert ImageSpans.build(tower, [[], []], 8, torch.bfloat16) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("grid", [(24, 36), (37, 23)])
def test_tower_on_cuda_matches_float64_oracle(rng, grid):
    """The release tower's head dim (64) and grids of hundreds of patches, through the CUDA kernels."""
    cfg = shipped_config("tiny-vl").replace(vision_dim=256, vision_n_heads=4, vision_inter_dim=512,
                                             vision_patch_size=14, vision_downsample_ratio=3)
    w = vision_weights(cfg, int(torch.randint(0, 2**31, (1,), generator=rng)))
    item = random_image(cfg, *grid, rng)
    got = VisionTower(cfg, {k: v.cuda() for k, v in w.items()}).image_features(item)
    assert got.is_cuda and rel_err(got.cpu(), oracle(cfg, w, item)) < 3e-2


def test_small_tower_on_a_preprocessed_image_matches_float64_oracle(rng):
    """The built-in ``small``'s tower (release preprocessing, aligner to small's width) on a real image."""
    from PIL import Image

    from flashrt.graphs.image_processor import preprocess

    cfg = shipped_config("small")
    assert cfg.vision_n_layers > 0 and cfg.vision_patch_size == 14 and cfg.vision_downsample_ratio == 3
    w = vision_weights(cfg, int(torch.randint(0, 2**31, (1,), generator=rng)))
    size = torch.randint(20, 90, (2,), generator=rng).tolist()
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=rng, dtype=torch.uint8).numpy()
    item = preprocess(Image.fromarray(pixels), cfg)
    # Scaled up to the release minimum as published: each side times sqrt(min / area), truncated
    # to an int (so the area may fall a few pixels short of the minimum), then rounded up to 14.
    scale = max(1.0, (cfg.vision_min_pixels / (size[0] * size[1])) ** 0.5)
    assert item.n_vit_w * 14 >= int(size[0] * scale) > item.n_vit_w * 14 - 14
    assert item.n_vit_h * 14 >= int(size[1] * scale) > item.n_vit_h * 14 - 14
    tower = VisionTower(cfg, w)
    got = tower.image_features(item)
    assert got.shape == (item.n_llm_h * item.n_llm_w, cfg.dim) and got.dtype == torch.bfloat16
    assert rel_err(got, oracle(cfg, w, item)) < 3e-2
    assert tower.span_embeddings(item).shape == (item.n_tokens, cfg.dim)
