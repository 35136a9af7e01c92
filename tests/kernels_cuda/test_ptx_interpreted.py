"""The sm_90 inline-PTX paths run whole on the CPU: the interpreter evaluates each ``tl.inline_asm_elementwise``
call with the PTX emulator (``ptx_interpreter.emulated_ptx``), so the packed decodes and encoders are checked
together with the Triton code around them (which register holds which element, the joins and permutes after a
call) against the paths without PTX, bit for bit, and against the reference: the experts' words, the fp8
weights four bytes a call, the attention's packed rows, the indexer's packed keys, the fp4_b16 encoder's pairs,
and the ``tiny`` model's forward under the h200 profile. (The Gluon kernels do not run in the interpreter.)"""
import contextlib

import numpy as np
import pytest
import torch

import flashrt
from flashrt import formats, ops, profiles
from kernel_check import (DEVICE, GPU, assert_calls_match_reference, pinned_tiles, recorded_calls, rel_err,
                          requires_kernels)

pytestmark = [requires_kernels, pytest.mark.skipif(GPU, reason="emulates PTX in the interpreter")]
codecs = pytest.importorskip("flashrt.kernels_cuda.codecs")
codecs_e2m1 = pytest.importorskip("flashrt.kernels_cuda.codecs_e2m1")
codecs_e4m3 = pytest.importorskip("flashrt.kernels_cuda.codecs_e4m3")
codecs_words = pytest.importorskip("flashrt.kernels_cuda.codecs_words")
quant = pytest.importorskip("flashrt.kernels_cuda.quant")
from ptx_interpreter import emulated_ptx, evaluate  # noqa: E402  (imports Triton's interpreter)


def _both(call, tiles=None):
    """(``call()`` without PTX, with the PTX emulated, the PTX texts run), each under ``tiles`` (the
    sections of ``kernel_check.pinned_tiles``; None: the active profile's)."""
    pinned = (lambda: contextlib.nullcontext()) if tiles is None else (lambda: pinned_tiles(**tiles))
    with flashrt.use_backend("cuda"), pinned():
        plain = call()
    with emulated_ptx() as run, flashrt.use_backend("cuda"), pinned():
        emulated = call()
        texts = set(run)
    return plain, emulated, texts


def test_a_call_takes_pack_consecutive_elements_the_first_in_the_low_bits(rng):
    """Bytes reversed within each register by ``prmt``, and two bf16 outputs a register: the groups are
    the last dimension's consecutive elements, the outputs' registers numbered first."""
    x = torch.randint(0, 256, (3, 8), generator=rng, dtype=torch.uint8).numpy()
    (out,) = evaluate("prmt.b32 $0, $1, 0, 0x0123;", "=r,r", [(x, 8)], [8], 4)
    np.testing.assert_array_equal(out, x.reshape(3, 2, 4)[:, :, ::-1].reshape(3, 8))
    h = torch.randint(0, 1 << 16, (2, 4), generator=rng, dtype=torch.int32).numpy().astype(np.uint16)
    lo, hi = evaluate("mov.b32 $0, $5;\nmov.b32 $1, $4;\nmov.b32 $2, $4;\nmov.b32 $3, $5;", "=r,=r,=r,=r,r,r",
                      [(h, 16)], [16, 16], 4)
    np.testing.assert_array_equal(lo, h.reshape(2, 2, 2)[:, ::-1].reshape(2, 4))
    np.testing.assert_array_equal(hi, h)
    with pytest.raises(NotImplementedError, match="last dimension"):
        evaluate("mov.b32 $0, $1;", "=r,r", [(x[:, :6], 8)], [8], 4)


@pytest.mark.parametrize("large", [False, True])
def test_the_experts_words_and_the_fp8_shared_expert(rng, large):
    """The experts in words (``expert_fp4: words``) at a few tokens under the h200 profile's tiles: fp4
    words decoded with the re-bias in the scales, the fp8 shared expert four bytes a call with its 2**120
    folded; ``large``: scale bytes over what the folds hold (the words' and the fp8 decode's own re-bias
    multiplies)."""
    m, k, E, top, inner = 3, 128, 4, 2, 64
    x = (torch.randn(m, k, generator=rng) * 2).to(DEVICE, torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=rng)[:top] for _ in range(m)]).to(DEVICE, torch.int32)
    rw = torch.rand(m, top, generator=rng).to(DEVICE)
    size = 2.0 ** 16 if large else 0.25  # scale bytes over 135, or about 125 (the folds: up to 128 / 134)
    q = lambda fmt, *s: formats.quantize(torch.randn(*s, generator=rng) * size, fmt).to(DEVICE)
    stack = lambda w: formats.with_scale_max(formats.as_expert_stack(w, True, True))
    experts = [stack(q("fp4_w", *s)) for s in ((E, inner, k), (E, inner, k), (E, k, inner))]
    shared = tuple(stack(q("fp8_w", 1, *s)) for s in ((inner, k), (inner, k), (k, inner)))
    with profiles.using("h200"):
        plain, emulated, texts = _both(lambda: ops.moe_experts(x, rw, idx, *experts, 10.0, shared=shared))
    want = ({codecs_words.E2M1_WORDS_TEXT, codecs_e4m3.E4M3_PAIRS_TEXT} if large
            else {codecs_words.E2M1_WORDS_FOLDED_TEXT, codecs_e4m3.E4M3_PAIRS_FOLDED_TEXT})
    assert want <= texts, [t.splitlines()[1] for t in texts]
    assert torch.equal(plain, emulated)
    nibbles = [formats.as_expert_stack(w, True, False) for w in experts]
    with flashrt.use_backend("reference"):
        assert rel_err(emulated, ops.moe_experts(x, rw, idx, *nibbles, 10.0, shared=shared)) < 1e-2


@pytest.mark.parametrize("fold,halves", [(False, False), (True, False), (True, True)])
def test_fp4_pairs_and_fp8_weights_in_linear(rng, fold, halves):
    """fp4_w codes two a byte (the nibble layout; ``halves``: in ``fp4_halves``' K order, the activations
    permuted to it) and fp8_w weights four bytes a call, each with and without the re-bias folded into
    the scales (the fold needs the weight's largest scale byte recorded); a 16-row MMA tile, K split in two."""
    x = (torch.randn(5, 192, generator=rng) * 2).to(DEVICE, torch.bfloat16)
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    tiles = dict(linear=dict(fp4_decode="packed", fp8_packed=True, fp8_mma=False, fp4_scale_fold=fold,
                             fp4_halves=halves, linear=[[None, tile]], split_k=2))
    for fmt, text in (("fp4_w", codecs.E2M1_PAIRS_FOLDED_TEXT if fold else codecs.E2M1_PAIRS_TEXT),
                      ("fp8_w", codecs_e4m3.E4M3_PAIRS_FOLDED_TEXT if fold else codecs_e4m3.E4M3_PAIRS_TEXT)):
        w = formats.quantize(torch.randn(72, 192, generator=rng) * 0.25, fmt).to(DEVICE)
        w = formats.with_scale_max(w) if fold else w
        plain, emulated, texts = _both(lambda: ops.linear(x, w), tiles)
        assert text in texts and torch.equal(plain, emulated), fmt
        with flashrt.use_backend("reference"):
            assert rel_err(emulated, ops.linear(x, w)) < 1e-3, fmt


def test_the_attention_kernels_packed_rows(rng):
    """fp4_b16 main rows and fp8 window rows through ``dequant_rows``' packed decodes in the sparse and
    the prefix attention kernels."""
    B, S, H, D, W, T, K = 2, 3, 16, 64, 8, 40, 24
    kv = lambda n, fmt: formats.quantize(torch.randn(B, n, D, generator=rng), fmt).to(DEVICE)
    cache = (kv(W, "fp8"), kv(S, "fp8"), kv(T, "fp4_b16"))
    idx = torch.randint(0, W + S + T, (B, S, K), generator=rng, dtype=torch.int32)
    idx[torch.rand(B, S, K, generator=rng) < 0.2] = -1
    q = torch.randn(B, S, H, D, generator=rng).to(DEVICE, torch.bfloat16)
    sink = torch.randn(H, generator=rng).to(DEVICE)
    positions = (torch.tensor([0, 3 * W + 1]).view(-1, 1) + torch.arange(S)).to(DEVICE)
    ring = torch.zeros(B, dtype=torch.int64, device=DEVICE)
    ent = (W + S + torch.stack([torch.randperm(T, generator=rng) for _ in range(B)])).to(DEVICE, torch.int32)
    vis = torch.randint(0, T + 1, (B, S), generator=rng, dtype=torch.int32).to(DEVICE)
    calls = {"sparse_attention": lambda: ops.sparse_attention(q, cache, idx.to(DEVICE), sink, D ** -0.5),
             "prefix_attention": lambda: ops.prefix_attention(q, cache, positions, ring, W, ent, vis, sink, D ** -0.5)}
    for name, call in calls.items():
        plain, emulated, texts = _both(call, dict(attention=dict(dequant=dict(packed_fp4_b16=True))))
        assert {codecs.E2M1_PAIRS_TEXT, codecs_e4m3.E4M3_PAIRS_TEXT} <= texts, name
        assert torch.equal(plain, emulated), name
        with flashrt.use_backend("reference"):
            assert rel_err(emulated.float(), call().float()) < 2e-2, name


def test_the_indexers_packed_keys(rng):
    """fp4_b32 keys under bf16 queries, a row of keys with scales below the packed decode's range (the
    kernel's exact decode for its tile) among them."""
    B, S, H, D, T = 2, 3, 4, 64, 37
    q = torch.randn(B, S, H, D, generator=rng).to(DEVICE, torch.bfloat16)
    raw = torch.randn(B, T, D, generator=rng)
    raw[1, 5] *= 2.0 ** -80  # scale bytes under 66
    k = ops.quantize(raw, "fp4_b32").to(DEVICE)
    w = torch.randn(B, S, H, generator=rng).to(DEVICE)
    vis = torch.randint(0, T + 1, (B, S), generator=rng, dtype=torch.int32).to(DEVICE)
    plain, emulated, texts = _both(lambda: ops.index_scores(q, k, w, vis))
    assert codecs.E2M1_PAIRS_FOLDED_TEXT in texts and torch.equal(plain, emulated)
    with flashrt.use_backend("reference"):
        assert rel_err(emulated, ops.index_scores(q, k, w, vis)) < 1e-3


def test_the_fp4_b16_encoder_two_elements_a_call(rng):
    """``tiles.quant.quantize.pairs``: bf16 rows coded two elements a PTX call, every midpoint among them."""
    x = torch.randn(9, 256, generator=rng)
    x[0, :128] = torch.arange(128) / 16 - 4  # every code's midpoint region, and exact midpoints
    x = x.to(DEVICE, torch.bfloat16)
    plain, emulated, texts = _both(lambda: quant.quantize(x, "fp4_b16"), dict(quant=dict(quantize=dict(pairs=True))))
    assert texts == {codecs_e2m1.E2M1_MIDPOINTS_TEXT}
    assert torch.equal(plain.data, emulated.data) and torch.equal(plain.scale, emulated.scale)
    want = formats.quantize(x, "fp4_b16")
    assert torch.equal(emulated.data, want.data) and torch.equal(emulated.scale, want.scale)


@pytest.mark.slow
def test_the_tiny_models_forward_under_the_h200_profile(cfg, weights, rng):
    """A prefill and a decode step of the ``tiny`` model (every layer role) under the h200 profile: every
    plain Triton kernel with inline PTX that the profile takes there gives the logits of its path without
    PTX, bit for bit, and every kernel call of the run with PTX matches the reference on its own inputs."""
    from flashrt.graphs.model import Model

    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=rng)
    nxt = torch.randint(0, cfg.vocab_size, (1, 1), generator=rng)

    def forward():
        with flashrt.use_backend("cuda"), flashrt.value_checks(False):
            state = model.new_state(1, 24)
            return model.forward(ids, state=state), model.forward(nxt, state=state)

    with profiles.using("h200"):
        model = Model(cfg, weights)
        plain = forward()
        with emulated_ptx() as run, recorded_calls() as calls:
            emulated = forward()
            texts = set(run)
        assert_calls_match_reference(calls)
    # the experts' codes in the standard nibbles (tiny's K is below what qgmma takes: the plain kernels decode them)
    want = {codecs.E2M1_PAIRS_FOLDED_TEXT, codecs_e4m3.E4M3_PAIRS_TEXT, codecs_e4m3.E4M3_PAIRS_FOLDED_TEXT,
            codecs.E2M1_PAIRS_TEXT}
    assert want <= texts, [t.splitlines()[1] for t in want - texts]
    assert torch.equal(plain[0], emulated[0]) and torch.equal(plain[1], emulated[1])
