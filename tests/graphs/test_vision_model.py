"""Images inside the model (tiny-vl, CPU): span embeddings in the stream, Engram off and bias_vl
routing inside spans, text-only generation bit-exact with the text model, chunked prefill cutting a
span, prefix-cache keys that include the image."""
import numpy as np
import pytest
import torch
from PIL import Image

from flashrt import ops
from flashrt.engine import generate, prefix
from flashrt.graphs.config import shipped_config
from flashrt.graphs.image_processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, expand_prompt
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.kv.prefix_cache import PrefixCache

TOL = 1e-3


@pytest.fixture(scope="module")
def vl():
    cfg = shipped_config("tiny-vl")
    return Model(cfg, init_weights(cfg, seed=0))


def picture(seed, w=44, h=36):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def prompt(vl, seed, n_text=12):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, vl.cfg.image_token_id, (n_text,), generator=g).tolist()
    return text[:3] + [vl.cfg.image_token_id] + text[3:]


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def captured_first_layer_input(vl, monkeypatch, ids, spans):
    seen = {}
    run_layers = vl.run_layers

    def spy(x, pre, ctx, layers, **kw):
        seen.setdefault("x", x[:, :, 0].clone())
        seen.setdefault("ctx", ctx)
        return run_layers(x, pre, ctx, layers, **kw)

    monkeypatch.setattr(vl, "run_layers", spy)
    vl.forward(ids, spans=spans)
    return seen["x"], seen["ctx"]


def test_span_embeddings_and_masks_reach_the_layers(vl, monkeypatch):
    tokens, types, found = expand_prompt(prompt(vl, 1), [picture(1)], vl.cfg)
    ids = torch.tensor([tokens])
    x, ctx = captured_first_layer_input(vl, monkeypatch, ids, vl.image_spans([found], len(tokens)))
    (start, item), = found
    feats = iter(vl.vision.image_features(item))
    w = vl.weights
    for pos, (tok, kind) in enumerate(zip(tokens, types)):
        want = {TEXT: lambda: w["embed.weight"][tok], IMAGE_START: lambda: w["image_start"],
                IMAGE_END: lambda: w["image_end"], IMAGE_NEW_LINE: lambda: w["image_newline"],
                IMAGE: lambda: next(feats)}[kind]()
        assert torch.equal(x[0, pos], want), pos
    text = torch.tensor([types]) == TEXT
    assert torch.equal(ctx.token_mask, text) and torch.equal(ctx.vl_mask, ~text)
    # the first text token after the span has no n-gram history (image tokens are no tokens)
    after = start + item.n_tokens
    alone = vl.hasher.hash_ids(ids[:, after:after + 1])[0]
    assert torch.equal(ctx.engram_ids[:, after:after + 1], alone)


def test_gate_uses_bias_vl_inside_spans(vl, monkeypatch, rng):
    moe = vl.blocks[3].ffn
    n = 10
    h = torch.randn(n, vl.cfg.dim, generator=rng).bfloat16()
    inside = torch.zeros(n, dtype=torch.bool)
    inside[torch.randperm(n, generator=rng)[:n // 2]] = True  # both kinds of row, in random places
    monkeypatch.setattr(moe, "bias_vl", torch.randn(moe.bias.shape, generator=rng) * 4)
    routes = []
    experts = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda x, w, i, w1, *a, **k: routes.append((w, i, w1))
                        or experts(x, w, i, w1, *a, **k))
    moe.forward(h, vl_mask=inside)
    routes = [(w, i) for w, i, w1 in routes if w1 is moe.w1]  # the routed experts' call, not the shared expert's
    cfg = vl.cfg
    text = ops.moe_route(h, moe.gate, moe.bias, moe.topk, cfg.score_func, cfg.norm_topk_prob, cfg.route_scale)
    image = ops.moe_route(h, moe.gate, moe.bias_vl, moe.topk, cfg.score_func, cfg.norm_topk_prob, cfg.route_scale)
    weights, indices = routes[0]
    for row in range(n):
        want = image if inside[row] else text
        assert torch.equal(weights[row], want[0][row]) and torch.equal(indices[row], want[1][row])
    assert not torch.equal(text[1][inside], image[1][inside])  # the bias made a difference


def test_bias_vl_changes_image_prompts_only(vl, monkeypatch, rng):
    tokens, _, found = expand_prompt(prompt(vl, 2), [picture(2)], vl.cfg)
    ids = torch.tensor([tokens])
    spans = vl.image_spans([found], len(tokens))
    text_ids = torch.tensor([prompt(vl, 3)])
    before = vl.forward(ids, spans=spans), vl.forward(text_ids)
    for block in vl.blocks:
        monkeypatch.setattr(block.ffn, "bias_vl", torch.randn(block.ffn.bias.shape, generator=rng) * 4)
    after = vl.forward(ids, spans=spans), vl.forward(text_ids)
    assert not torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@pytest.mark.parametrize("prefill", ["exact", "ced"])
def test_text_only_generation_is_bit_exact_with_the_text_model(vl, prefill, rng):
    text = Model(shipped_config("tiny"), init_weights(shipped_config("tiny"), seed=0))
    # no image placeholder (the last id): a prompt with one and no image is refused
    prompts = [torch.randint(0, vl.cfg.image_token_id, (n,), generator=rng).tolist() for n in (7, 23)]
    a = generate(text, prompts, 5, prefill=prefill)
    b = generate(vl, prompts, 5, prefill=prefill)
    c = generate(vl, prompts, 5, prefill=prefill, images=[None, []])
    assert a.tokens == b.tokens == c.tokens and b.image_tokens == 0
    assert torch.equal(a.first_logits, b.first_logits) and torch.equal(b.first_logits, c.first_logits)


def test_generate_with_an_image_end_to_end(vl, tmp_path):
    path = tmp_path / "pic.png"
    picture(4).save(path)
    p = prompt(vl, 4)
    one = generate(vl, [p], 4, images=[[str(path)]])
    again = generate(vl, [p], 4, images=[path.read_bytes()])
    other = generate(vl, [p], 4, images=[picture(5)])
    tokens, _, found = expand_prompt(p, [str(path)], vl.cfg)
    assert one.image_tokens == found[0][1].n_tokens and one.prompt_tokens == len(tokens)
    assert one.tokens == again.tokens and torch.equal(one.first_logits, again.first_logits)
    assert not torch.equal(one.first_logits, other.first_logits)  # the picture matters
    chunked = generate(vl, [p], 1, images=[[str(path)]], prefill_chunk=5)  # chunks cut the span
    assert rel(chunked.first_logits, one.first_logits) < TOL
    ced = generate(vl, [p], 1, images=[[str(path)]], prefill="ced", prefill_chunk=16)
    assert torch.isfinite(ced.first_logits).all()


def test_generate_image_errors(vl):
    p = prompt(vl, 6)
    with pytest.raises(ValueError, match="1 image placeholder"):
        generate(vl, [p], 1, images=[[picture(1), picture(2)]])
    with pytest.raises(ValueError, match="one entry"):
        generate(vl, [p, p], 1, images=[[picture(1)]])
    with pytest.raises(ValueError, match="image: .*network"):
        generate(vl, [p], 1, images=["https://example.com/a.png"])


def test_text_model_refuses_images(model):
    with pytest.raises(ValueError, match="no vision tower"):
        generate(model, [[1, 2, model.cfg.image_token_id % model.cfg.vocab_size]], 1, images=[[picture(1)]])


def test_prefix_cache_key_holds_the_image(vl, tmp_path):
    cache = PrefixCache(tmp_path / "cache")
    p = prompt(vl, 7, n_text=40)
    first = generate(vl, [p], 1, images=[picture(7)], prefix_cache=cache)
    assert (cache.hits, cache.misses) == (0, 1)
    generate(vl, [p], 1, images=[picture(7)], prefix_cache=cache)
    assert cache.hits == 1
    generate(vl, [p], 1, images=[picture(8)], prefix_cache=cache)  # same grid, other pixels
    assert cache.hits == 1
    # the stored state continues exactly as the prefill; a restore that replays the whole prefix
    # reproduces it too, images included
    tokens, _, found = expand_prompt(p, [picture(7)], vl.cfg)
    length = prefix.aligned(len(tokens), vl.cfg)
    ids = torch.tensor([tokens])
    spans = vl.image_spans([found], len(tokens))
    hit, entry = prefix.lookup(vl, cache, tokens, "exact", found)
    assert hit == length
    assert prefix.lookup(vl, cache, tokens, "exact")[0] == 0  # the image digest is part of the key
    want = vl.forward(ids[:, :length], spans=spans.chunk(0, length))
    exact = prefix.restore(vl, vl.new_state(1, len(tokens) + 1), [entry], ids, length, spans=spans)
    assert torch.equal(exact, want)
    got = prefix.restore(vl, vl.new_state(1, len(tokens) + 1), [entry], ids, length, replay=length, spans=spans)
    assert rel(got, want) < TOL
    assert first.tokens


def test_checkpoint_round_trip_keeps_the_vision_weights(vl, tmp_path):
    import flashrt
    from flashrt.graphs.params import param_specs

    names = {s.name for s in param_specs(vl.cfg)}
    assert {"vision.blocks.1.attn.wqkv.bias", "aligner.w2.weight", "image_newline",
            "layers.0.ffn.gate.bias_vl", "mtp.0.ffn.gate.bias_vl"} <= names
    vl.save(tmp_path / "ckpt")
    back = flashrt.load(tmp_path / "ckpt")
    for name in ("vision.blocks.0.mlp.w1.weight", "image_start", "layers.5.ffn.gate.bias_vl"):
        assert torch.equal(back.weights[name], vl.weights[name])
    p = prompt(vl, 9)
    a, b = generate(vl, [p], 2, images=[picture(9)]), generate(back, [p], 2, images=[picture(9)])
    assert a.tokens == b.tokens and torch.equal(a.first_logits, b.first_logits)
