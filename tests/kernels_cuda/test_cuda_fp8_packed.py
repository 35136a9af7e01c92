"""The packed E4M3 decode of fp8_w weights in the dequantizing MMA loops (``codecs_e4m3``): its PTX,
run through the emulator on every byte and a spread of UE8M0 scales, gives each byte's value times
its scale in bf16 (the NaN codes +-480, as the MMA operand decode reads them); the launches take it
where the packed decodes run and the weights are dequantized (not the fp8 MMA); on an sm_90 GPU the
experts' fp8 shared expert and ``linear`` without the fp8 MMA give the byte-by-byte decode's bits."""
import dataclasses

import numpy as np
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import DEVICE, GPU, pinned_tiles, rel_err, requires_kernels
from ptx_emulator import assert_fold_exact, bf16_bits, lanes, run_ptx, words_of

pytestmark = requires_kernels
e4m3 = pytest.importorskip("flashrt.kernels_cuda.codecs_e4m3")
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
SM90 = GPU and torch.cuda.get_device_capability() >= (9, 0)


def test_the_ptx_decodes_every_byte_and_scale(rng):
    n = 4096
    data = torch.randint(0, 256, (n, 4), generator=rng, dtype=torch.uint8)
    data[:64] = torch.arange(256, dtype=torch.uint8).view(64, 4)
    scale_bytes = torch.randint(0, 256, (n, 2), generator=rng)
    scale_bytes[:4] = torch.tensor([[0, 1], [126, 127], [134, 135], [254, 255]])
    scales = torch.where(scale_bytes == 255, float("nan"), torch.exp2(scale_bytes.double() - 127))
    sb = bf16_bits(scales)
    word = words_of(data)
    out = run_ptx(e4m3.E4M3_PAIRS_TEXT, {2: word, 3: sb[:, 0] * 0x10001, 4: sb[:, 1] * 0x10001})
    values = data.view(torch.float8_e4m3fn).double()
    values = torch.where(values.isnan(), torch.where(data >= 128, -480.0, 480.0), values)  # as e4m3_x256 reads them
    want = bf16_bits(values * scales.repeat_interleave(2, dim=1))  # bytes 0, 1 scale 0; 2, 3 scale 1
    for reg in (0, 1):
        got = out[f"${reg}"]
        for half in (0, 1):
            byte = 2 * reg + half
            g, w = (got >> (16 * half)) & 0xFFFF, want[:, byte]
            nan = np.isnan(scales[:, reg].numpy())
            np.testing.assert_array_equal(g[~nan], w[~nan], err_msg=f"${reg} lane {half}")
            assert ((g[nan] & 0x7F80) == 0x7F80).all() and (g[nan] & 0x7F).all()  # NaN for the NaN scale


def test_the_folded_ptx_equals_the_rebias(rng):
    """The decode with its 2**120 in the scales (``E4M3_PAIRS_FOLDED_TEXT``, scale ``2**(u - 7)``)
    gives the plain decode's bits for every byte and every scale byte it is used for (0..134), and
    one multiply a register fewer."""
    assert_fold_exact(rng, e4m3.E4M3_PAIRS_TEXT, e4m3.E4M3_PAIRS_FOLDED_TEXT, 120, e4m3.FOLD_MAX_SCALE, (2, 3, 4), 2)
    count = lambda text: text.count("mul.rn.bf16x2")
    assert count(e4m3.E4M3_PAIRS_FOLDED_TEXT) == count(e4m3.E4M3_PAIRS_TEXT) - 2 == 2


def test_the_down63_ptx_is_the_values_times_2_to_the_minus_63(rng):
    """``E4M3_PAIRS_DOWN63_TEXT`` (the ws attention's fp8 rows): every byte times its UE8M0 scale times 2**-63,
    the plain decode's bits with 63 off their exponent wherever the plain product is finite and its 2**-63
    multiple a normal bf16 (the rows' values); no more instructions than the plain one."""
    n = 4096
    data = torch.randint(0, 256, (n, 4), generator=rng, dtype=torch.uint8)
    data[:64] = torch.arange(256, dtype=torch.uint8).view(64, 4)
    data[(data & 0x7F) == 0] = 1  # zero codes aside: their bits carry no exponent to compare
    scale_bytes = torch.randint(80, 255, (n, 2), generator=rng)
    sb = bf16_bits(torch.exp2(scale_bytes.double() - 127))
    ops_ = {2: words_of(data), 3: sb[:, 0] * 0x10001, 4: sb[:, 1] * 0x10001}
    p = lanes(run_ptx(e4m3.E4M3_PAIRS_TEXT, ops_), 2)  # byte j in column j
    d = lanes(run_ptx(e4m3.E4M3_PAIRS_DOWN63_TEXT, ops_), 2)
    exponent = (p >> 7) & 0xFF  # a finite product whose 2**-63 multiple is a normal bf16
    normal = (exponent > 63 + 1) & (exponent < 0xFF)
    np.testing.assert_array_equal(d[normal], p[normal] - (63 << 7))
    # and each byte's own value (0x7F / 0xFF as +-480) times its scale times 2**-63
    value = data.view(torch.float8_e4m3fn).double()
    value = torch.where(value.isnan(), torch.where(data >= 128, -480.0, 480.0), value)
    value = value * torch.exp2(scale_bytes.repeat_interleave(2, dim=1).double() - 190)
    np.testing.assert_array_equal(d[normal], bf16_bits(value)[normal])
    assert e4m3.E4M3_PAIRS_DOWN63_TEXT.count("\n") == e4m3.E4M3_PAIRS_TEXT.count("\n")


def test_a_register_of_two_values_takes_four_instructions():
    """The folded decode spends a byte permute (the sign replicated above each byte), a shift, a mask and
    the scale's multiply on each output register: no merge of separately shifted fields."""
    body = [line.split()[0] for line in e4m3.E4M3_PAIRS_FOLDED_TEXT.splitlines()
            if line.strip() and line.split()[0][0].isalpha() and not line.startswith(("mov", ".reg"))]
    assert sorted(body) == sorted(["prmt.b32", "shl.b32", "and.b32", "mul.rn.bf16x2"] * 2)


def test_the_fold_needs_the_packed_decode_and_known_small_scales(rng):
    """``fold_fp8`` adds FP8_FOLD only to a packed fp8 decode (FP8_PACKED in E2M1) whose fp8_w weights
    all have their largest scale byte recorded at most 134; fp4 weights do not count; the MoE layers
    record it for fp8_w stacks too."""
    w = formats.quantize(torch.randn(64, 64, generator=rng), "fp8_w")
    small = formats.with_scale_max(w)
    large = dataclasses.replace(small, scale_max=e4m3.FOLD_MAX_SCALE + 1)
    fp4 = formats.with_scale_max(formats.quantize(torch.randn(64, 64, generator=rng), "fp4_w"))
    packed = 2 + lin.FP8_PACKED
    assert small.scale_max <= e4m3.FOLD_MAX_SCALE
    assert lin.fold_fp8(packed, small) == lin.fold_fp8(packed, small, fp4) == packed + lin.FP8_FOLD
    assert lin.fold_fp8(packed, small, large) == packed and lin.fold_fp8(packed, w) == packed
    assert lin.fold_fp8(packed, fp4) == packed and lin.fold_fp8(2, small) == 2
    stack = formats.as_expert_stack(formats.quantize(torch.randn(3, 64, 64, generator=rng), "fp8_w"), k_major=True)
    assert stack.scale_max == int(stack.scale.view(torch.uint8).max())


def test_a_models_linear_weights_record_their_largest_scale_byte(rng):
    """``with_scale_maxes`` at a model's build: every fp8_w / fp4_w weight without one gets its largest scale
    byte (what the fp8 fold reads), the same tensors; plain weights and recorded ones are left as they are;
    a tiny model built from its weights holds them recorded."""
    a = formats.quantize(torch.randn(64, 96, generator=rng) * 3.0, "fp8_w")
    b = formats.quantize(torch.randn(32, 64, generator=rng), "fp4_w")
    c = dataclasses.replace(formats.quantize(torch.randn(32, 64, generator=rng), "fp8_w"), scale_max=7)
    plain = torch.randn(8, 8, generator=rng)
    weights = {"a": a, "b": b, "c": c, "p": plain}
    formats.with_scale_maxes(weights)
    for name, w in (("a", a), ("b", b)):
        assert weights[name].scale_max == int(w.scale.view(torch.uint8).max())
        assert weights[name].data is w.data and weights[name].scale is w.scale
    assert weights["c"].scale_max == 7 and weights["p"] is plain
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    cfg = shipped_config("tiny")
    model = Model(cfg, init_weights(cfg, seed=0))
    linears = [w for w in model.weights.values() if isinstance(w, formats.QTensor) and w.fmt == "fp8_w"]
    assert linears and all(w.scale_max is not None for w in linears)


@pytest.mark.parametrize("fp4,promote,want", [(130, False, 130), (138, False, 130), (250, False, 130),
                                               (2, False, 0), (10, False, 0), (0, False, 0), (130, True, 0)])
def test_fp8_launches_take_the_packed_decode_only_when_dequantizing(monkeypatch, fp4, promote, want):
    """An fp8-only launch's E2M1: 2 + FP8_PACKED where fp4_decode has the fp8 bit (the tile on, the
    packed decode on) and the loop dequantizes; 0 otherwise (the fp8 MMA's variants unchanged)."""
    monkeypatch.setattr(lin, "fp4_decode", lambda: fp4)
    assert lin.fp8_decode(promote) == want


def test_the_tile_adds_the_fp8_bit_only_to_the_packed_decode(monkeypatch):
    """As on an sm_90 GPU (the packed decode does not fall back): the bit joins packed launches only."""
    monkeypatch.setattr(lin, "ptx_sm90", lambda: True)
    for decode in ("bits", "dot_scaled", "packed", "packed_prefetch"):
        with pinned_tiles(linear=dict(fp4_decode=decode)):
            plain = lin.fp4_decode()
        with pinned_tiles(linear=dict(fp4_decode=decode, fp8_packed=True)):
            on = lin.fp4_decode()
        assert on == plain + (lin.FP8_PACKED if plain % 8 == 2 else 0)
        assert (on != plain) == decode.startswith("packed")


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_fp8_weights_packed_gpu(rng, m):
    """``linear`` on fp8_w without the fp8 MMA, and fp8_w experts with their activations dequantized
    (the shared expert alone and beside fp4 routed experts): the packed decode gives the bits of the
    byte-by-byte one (beside fp4 experts, the fp4 decodes' own tolerance) and stays within the
    reference's tolerance."""
    D, I, E, top = 1024, 512, 16, 4
    x = torch.randn(m, D, generator=rng).to(DEVICE, torch.bfloat16)
    w = formats.quantize(torch.randn(I, D, generator=rng) * 0.05, "fp8_w").to(DEVICE)
    q = lambda fmt, *s: formats.quantize(torch.randn(*s, generator=rng) * 0.05, fmt).to(DEVICE)
    shared = tuple(q("fp8_w", 1, *s) for s in ((I, D), (I, D), (D, I)))
    routed = [q("fp4_w", *s) for s in ((E, I, D), (E, I, D), (E, D, I))]
    idx = torch.rand(m, E, generator=rng).topk(top).indices.to(DEVICE, torch.int32)
    rw = torch.rand(m, top, generator=rng).to(DEVICE)
    ones, first = torch.ones(m, 1, device=DEVICE), torch.zeros(m, 1, dtype=torch.int32, device=DEVICE)
    shared = tuple(formats.with_scale_max(s) for s in shared)  # as the MoE layers record them: the fold applies
    assert lin.fold_fp8(2 + lin.FP8_PACKED, *shared) & lin.FP8_FOLD
    out = {}
    for decode in ("bits", "packed_prefetch"):
        tiles = dict(linear=dict(fp4_decode=decode, fp8_mma=False, fp8_packed=True), moe=dict(act_dequantized=True))
        with flashrt.use_backend("cuda"), pinned_tiles(**tiles):
            out[decode] = (ops.linear(x, w), ops.moe_experts(x, ones, first, *shared, 10.0),
                           ops.moe_experts(x, rw, idx, *routed, 10.0, shared=shared))
    got, bits = out["packed_prefetch"], out["bits"]
    assert torch.equal(got[0], bits[0]) and torch.equal(got[1], bits[1])
    assert rel_err(got[2], bits[2]) < 1e-6  # the fp4 routed experts' two decodes, as test_cuda_fp4_packed allows
    with flashrt.use_backend("reference"):
        assert rel_err(out["bits"][0], ops.linear(x, w)) < 1e-2
        assert rel_err(out["bits"][1], ops.moe_experts(x, ones, first, *shared, 10.0)) < 1e-2
