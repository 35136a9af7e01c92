"""The vision encoder (ViT), the aligner and image-span embeddings (docs/vision.md).

ViT over one image's ``n_vit_h x n_vit_w`` patches (``x [N, vision_dim]``, bf16):

    x = patch_embed(flatten(patches))                                  # linear + bias
    per block:  h = rms_norm(x, norm1, 1e-6);  q, k, v = split(wqkv(h) + bias) per head
                q, k = rope2d(q), rope2d(k)
                x = x + wo(dense_attention(q, k, v, head_dim**-0.5)) + bias
                h = rms_norm(x, norm2, 1e-6);  gate, up = halves of w1(h)
                x = x + w2(silu(gate) * up)
    x = rms_norm(x, norm, 1e-6)

2-D rotary embedding: the two halves of a head form the pairs ``(x[j], x[j + hd/2])``; pair ``j``
turns by ``row * f_j`` for ``j < hd/4`` and by ``col * f_{j - hd/4}`` after, with
``f_i = theta**(-4 i / hd)`` and ``(row, col)`` the patch's grid position. It runs as
``ops.rope`` (adjacent pairs) on q and k with their halves interleaved: attention scores are sums
over the head dim, which the same reordering of q and k leaves unchanged, and v is not reordered.

Aligner: the patch grid, zero-padded at the bottom and right to multiples of ``r``, is cut into
``r x r`` blocks in reading order; a block's features are ordered channel-major (channel, row in
the block, column in the block), as ``F.unfold`` orders them; then ``w2(gelu(w1(u) + b1)) + b2``
gives one ``dim`` row per LLM token. The image's span is ``image_start``, each grid row of
aligner outputs followed by ``image_newline``, then ``image_end``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashrt import ops

from .image_processor import ImageInput

VIT_EPS = 1e-6


def rope2d_factors(n_h: int, n_w: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """complex64 ``[n_h * n_w, head_dim / 2]``: the rotation of each pair of the interleaved halves."""
    quarter = head_dim // 4
    freqs = 1.0 / (theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter)))
    rows = torch.arange(n_h).repeat_interleave(n_w)
    cols = torch.arange(n_w).repeat(n_h)
    angles = torch.cat([rows[:, None].float() * freqs, cols[:, None].float() * freqs], dim=1)
    return torch.polar(torch.ones_like(angles), angles).to(device)


def interleave_halves(x: torch.Tensor) -> torch.Tensor:
    """``[..., hd]`` -> ``[..., hd]`` ordered ``x[0], x[hd/2], x[1], x[hd/2 + 1], ...``."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).transpose(-1, -2).flatten(-2)


def _affine(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ops.linear(x, w) + b


class VisionTower:
    """The ViT + aligner of a V4.1 model with ``vision_n_layers > 0``, from its weights dict."""

    def __init__(self, cfg, w: dict):
        self.cfg = cfg
        self.heads, self.head_dim = cfg.vision_n_heads, cfg.vision_dim // cfg.vision_n_heads
        pe = "vision.patch_embed.proj."
        self.patch = (w[pe + "weight"], w[pe + "bias"])
        self.blocks = []
        for i in range(cfg.vision_n_layers):
            b = f"vision.blocks.{i}."
            w1 = w[b + "mlp.w1.weight"]
            inter = w1.shape[0] // 2
            self.blocks.append(dict(
                norm1=w[b + "norm1.weight"], norm2=w[b + "norm2.weight"],
                wqkv=(w[b + "attn.wqkv.weight"], w[b + "attn.wqkv.bias"]),
                wo=(w[b + "attn.wo.weight"], w[b + "attn.wo.bias"]),
                gate=w1[:inter].unsqueeze(0), up=w1[inter:].unsqueeze(0), down=w[b + "mlp.w2.weight"].unsqueeze(0)))
        self.norm = w["vision.norm.weight"]
        self.aligner = ((w["aligner.w1.weight"], w["aligner.w1.bias"]), (w["aligner.w2.weight"], w["aligner.w2.bias"]))
        self.delims = {k: w[k] for k in ("image_start", "image_end", "image_newline")}
        self.device = self.norm.device
        self._mlp_route: dict = {}

    def _block(self, x: torch.Tensor, blk: dict, factors: torch.Tensor) -> torch.Tensor:
        N, H, hd = x.shape[0], self.heads, self.head_dim
        qkv = _affine(ops.rms_norm(x, blk["norm1"], VIT_EPS), *blk["wqkv"]).view(1, N, 3, H, hd)
        q, k = (ops.rope(interleave_halves(qkv[:, :, i]), factors) for i in (0, 1))
        o = ops.dense_attention(q, k, qkv[:, :, 2], hd ** -0.5)
        x = x + _affine(o.reshape(N, H * hd), *blk["wo"])
        h = ops.rms_norm(x, blk["norm2"], VIT_EPS)
        ones, first = self._route(N)
        return x + ops.moe_experts(h, ones, first, blk["gate"], blk["up"], blk["down"], 0.0).to(x.dtype)

    def _route(self, n: int):
        """Routing of a dense SwiGLU through ``moe_experts``: every row to expert 0 with weight 1."""
        if n not in self._mlp_route:
            self._mlp_route = {n: (torch.ones(n, 1, dtype=torch.float32, device=self.device),
                                   torch.zeros(n, 1, dtype=torch.int32, device=self.device))}
        return self._mlp_route[n]

    def encode(self, item: ImageInput) -> torch.Tensor:
        """ViT features ``[n_vit_h * n_vit_w, vision_dim]`` of one preprocessed image."""
        cfg = self.cfg
        patches = item.patches.to(self.device, self.patch[0].dtype)
        x = _affine(patches.flatten(1), *self.patch)
        factors = rope2d_factors(item.n_vit_h, item.n_vit_w, self.head_dim, cfg.vision_rope_theta, self.device)
        for blk in self.blocks:
            x = self._block(x, blk, factors)
        return ops.rms_norm(x, self.norm, VIT_EPS)

    def align(self, feats: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """Aligner: ``[n_h * n_w, vision_dim]`` -> ``[ceil(n_h / r) * ceil(n_w / r), dim]``."""
        r, D = self.cfg.vision_downsample_ratio, feats.shape[-1]
        x = F.pad(feats.view(n_h, n_w, D), (0, 0, 0, -n_w % r, 0, -n_h % r))
        hb, wb = x.shape[0] // r, x.shape[1] // r
        u = x.view(hb, r, wb, r, D).permute(0, 2, 4, 1, 3).reshape(hb * wb, D * r * r)
        (w1, b1), (w2, b2) = self.aligner
        return _affine(F.gelu(_affine(u, w1, b1)), w2, b2)

    def image_features(self, item: ImageInput) -> torch.Tensor:
        """``[n_llm_h * n_llm_w, dim]``: the aligner rows of one image, in reading order."""
        return self.align(self.encode(item), item.n_vit_h, item.n_vit_w)

    def span_embeddings(self, item: ImageInput, dtype=None) -> torch.Tensor:
        """``[item.n_tokens, dim]``: the embeddings of the image's whole span (module doc)."""
        feats = self.image_features(item)
        dtype = dtype or feats.dtype
        h, w, dim = item.n_llm_h, item.n_llm_w, feats.shape[-1]
        grid = torch.cat([feats.view(h, w, dim).to(dtype), self.delims["image_newline"].to(dtype).expand(h, 1, dim)], 1)
        return torch.cat([self.delims["image_start"].to(dtype)[None], grid.flatten(0, 1),
                          self.delims["image_end"].to(dtype)[None]])


@dataclass
class ImageSpans:
    """Image spans of a chunk of token rows ``[B, S]``: ``index[b, s]`` is the row of ``rows``
    holding that position's embedding (``-1``: a text position); ``ranges`` lists ``(b, start,
    end)`` of every span clipped to the chunk (host side, so slicing needs no device sync)."""

    index: torch.Tensor
    rows: torch.Tensor
    ranges: tuple

    @property
    def mask(self) -> torch.Tensor:
        """bool ``[B, S]``: True inside an image span."""
        return self.index >= 0

    def chunk(self, c0: int, c1: int) -> "ImageSpans | None":
        """The positions ``c0 .. c1 - 1`` of every row; None when no span reaches them."""
        ranges = tuple((b, max(s, c0) - c0, min(e, c1) - c0) for b, s, e in self.ranges if s < c1 and e > c0)
        return ImageSpans(self.index[:, c0:c1], self.rows, ranges) if ranges else None

    @classmethod
    def build(cls, tower: VisionTower, rows_spans: list, length: int, dtype) -> "ImageSpans | None":
        """From ``rows_spans[b] = [(start, ImageInput), ...]`` for rows of ``length`` tokens: every
        image encoded once; None when no row has an image."""
        if not any(rows_spans):
            return None
        index = torch.full((len(rows_spans), length), -1, dtype=torch.long)
        parts, ranges, n = [], [], 0
        for b, spans in enumerate(rows_spans):
            for start, item in spans:
                emb = tower.span_embeddings(item, dtype)
                index[b, start:start + emb.shape[0]] = torch.arange(n, n + emb.shape[0])
                parts.append(emb)
                ranges.append((b, start, start + emb.shape[0]))
                n += emb.shape[0]
        return cls(index.to(tower.device), torch.cat(parts), tuple(ranges))
