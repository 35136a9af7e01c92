"""Projections of one input fused into one weight (graphs/fused_weights.py): the fused GEMM's
column slices equal the separate GEMMs bit for bit (reference and CUDA backends, fresh random
weights and inputs), the names stay bound to views of one copy, and a checkpoint of the model's
weights keeps the original names and bytes."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from flashrt.formats import QTensor
from flashrt.graphs import checkpoint as ckpt
from flashrt.graphs.fused_weights import can_concat, concat_out, fuse_in_place, out_rows
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model


def _weights(rng, fmt, outs, k):
    ws = [torch.randn(o, k, generator=rng) * 0.3 for o in outs]
    return [formats.quantize(w, fmt) if fmt else w.to(torch.bfloat16) for w in ws]


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("fmt,outs", [("fp8_w", (64, 96)), ("fp8_w", (32, 40)), ("fp4_w", (24, 40)),
                                      (None, (20, 44))])
def test_fused_linear_columns_equal_the_separate_linears(rng, backend, fmt, outs):
    if backend == "cuda":
        pytest.importorskip("flashrt.kernels_cuda.linear")
    k = 64
    parts = _weights(rng, fmt, outs, k)
    w = {"a": parts[0], "b": parts[1]}
    fused, widths = fuse_in_place(w, ["a", "b"])
    assert widths == outs
    x = (torch.randn(3, 2, k, generator=rng) * 2).to(torch.bfloat16)
    with flashrt.use_backend(backend):
        ya, yb = ops.linear(x, fused).split(widths, dim=-1)
        assert torch.equal(ya, ops.linear(x, parts[0])) and torch.equal(yb, ops.linear(x, parts[1]))
        # the rebound names compute what the originals did
        assert torch.equal(ops.linear(x, w["a"]), ya) and torch.equal(ops.linear(x, w["b"]), yb)


def test_fusing_again_reuses_the_fused_storage(rng):
    w = dict(zip("ab", _weights(rng, "fp8_w", (64, 32), 96)))
    first, _ = fuse_in_place(w, ["a", "b"])
    again, _ = fuse_in_place(w, ["a", "b"])
    assert again.data.data_ptr() == first.data.data_ptr() and again.scale.data_ptr() == first.scale.data_ptr()
    assert torch.equal(again.data.view(torch.uint8), first.data.view(torch.uint8))


def test_incompatible_weights_are_left_apart(rng):
    fp8 = _weights(rng, "fp8_w", (40, 32), 64)  # 40 rows: the second part would start inside a tile
    assert not can_concat(fp8)
    w = dict(zip("ab", fp8))
    assert fuse_in_place(w, ["a", "b"]) is None and w["a"] is fp8[0]
    mixed = [_weights(rng, "fp8_w", (32,), 64)[0], _weights(rng, "fp4_w", (32,), 64)[0]]
    assert not can_concat(mixed)
    assert not can_concat(_weights(rng, None, (32,), 64) + _weights(rng, None, (32,), 96))
    with pytest.raises(ValueError, match="weights: expected"):
        concat_out(mixed)
    with pytest.raises(ValueError, match="start: expected a multiple"):
        out_rows(concat_out(_weights(rng, "fp8_w", (64, 32), 64)), 16, 64)


def test_model_fuses_wq_a_and_wkv_and_saves_the_original_names(cfg, tmp_path):
    weights = init_weights(cfg, seed=1, device="cpu")
    before = {n: (t.data.clone(), t.scale.clone()) if isinstance(t, QTensor) else t.clone() for n, t in weights.items()}
    model = Model(cfg, dict(weights))
    attn = model.blocks[0].attn
    assert attn.latent_w is not None
    fused, widths = attn.latent_w
    assert widths == (cfg.q_lora_rank, attn.wkv.shape[0])
    assert attn.wq_a.data.data_ptr() == fused.data.data_ptr()  # a view: one copy
    _, loaded = ckpt.load(ckpt.save(model.weights, cfg, tmp_path / "ck"), cfg)
    assert list(loaded) == list(before)
    for name, ref in before.items():
        got = loaded[name]
        if isinstance(got, QTensor):
            assert torch.equal(got.data.view(torch.uint8), ref[0].view(torch.uint8)), name
            assert torch.equal(got.scale.view(torch.uint8), ref[1].view(torch.uint8)), name
        else:
            assert torch.equal(got, ref), name


def test_ratio_one_source_fuses_its_compressor_and_head_weight_rows(rng, monkeypatch):
    """``tiny``'s ratio-1 KV source computes its compressor's ``wkv`` and its indexer's head
    weights in one GEMM over views of one copy; a prefill and decode steps give the logits of the
    model built without that fusion, bit for bit (reference backend, fresh random weights and ids)."""
    from flashrt.graphs import attention
    from flashrt.graphs.config import shipped_config

    cfg = shipped_config("tiny")
    layer = next(l for l in cfg.kv_source_layers if cfg.ratio(l) == 1)
    weights = init_weights(cfg, seed=int(torch.randint(0, 1000, (1,), generator=rng)), device="cpu")
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=rng)

    def logits(model):
        with flashrt.use_backend("reference"):
            state = model.new_state(2, 16)
            out = [model.forward(ids, state=state)]
            for _ in range(3):
                out.append(model.forward(out[-1].argmax(-1, keepdim=True), state=state))
        return out

    fused = Model(cfg, dict(weights))
    attn = fused.blocks[layer].attn
    assert attn.h_rows is not None and attn.h_rows[1] == (cfg.head_dim, cfg.index_n_heads)
    assert attn.idx_weights.data_ptr() - attn.compressor.wkv.data_ptr() == cfg.head_dim * cfg.dim * 2
    real = attention.fuse_in_place
    monkeypatch.setattr(attention, "fuse_in_place",
                        lambda w, names: None if "indexer.weights_proj.weight" in names[-1] else real(w, names))
    plain = Model(cfg, dict(weights))
    assert plain.blocks[layer].attn.h_rows is None
    for a, b in zip(logits(fused), logits(plain)):
        assert torch.equal(a, b)
