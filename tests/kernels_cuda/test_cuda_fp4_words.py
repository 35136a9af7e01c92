"""fp4 codes in the E2M1 word layout (``expert_fp4: words``, ``codecs_words``): the packed decode's
PTX on words gives the ordered standard decode's registers bit for bit (the codes in element order,
emulated here on every byte value and UE8M0 scale); ``linear``, ``moe_experts`` and the dequantize
kernel on words give the results of the same codes in nibbles, bit for bit (under the interpreter the
words are put back in nibbles in registers; on an sm_90 GPU the packed decode reads them); a launch
refuses to mix the layouts."""
import numpy as np
import pytest
import torch

import flashrt
from flashrt import e2m1_words, formats, ops
from kernel_check import DEVICE, GPU, pinned_tiles, rel_err, requires_kernels
from ptx_emulator import bf16_bits, e2m1_in_order, lanes, run_ptx, words_of

pytestmark = requires_kernels
codecs = pytest.importorskip("flashrt.kernels_cuda.codecs")
words_codecs = pytest.importorskip("flashrt.kernels_cuda.codecs_words")
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
quant = pytest.importorskip("flashrt.kernels_cuda.quant")
SM90 = GPU and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.parametrize("folded", [False, True])
def test_the_words_ptx_gives_the_nibbles_ptx_registers(rng, folded):
    n = 4096
    data = torch.randint(0, 256, (n, 4), generator=rng, dtype=torch.uint8)
    data[:64] = torch.arange(256, dtype=torch.uint8).view(64, 4)
    top = 129 if folded else 256  # the folded scales: bytes up to 128 (linear.FOLD_MAX_SCALE)
    scale_bytes = torch.randint(0, top, (n, 2), generator=rng)
    scale_bytes[:2] = torch.tensor([[0, 1], [top - 2, top - 1]])
    exponent = scale_bytes.double() - (1 if folded else 127)
    scales = torch.where(scale_bytes == 255, float("nan"), torch.exp2(exponent))
    sb = bf16_bits(scales)
    ops_ = {5: sb[:, 0] * 0x10001, 6: sb[:, 1] * 0x10001}
    # the words' decode gives the ordered decode's registers (codes in element order, two a register)
    nibbles, words = ((codecs.E2M1_ORDERED_FOLDED_TEXT, words_codecs.E2M1_WORDS_FOLDED_TEXT) if folded
                      else (codecs.E2M1_ORDERED_TEXT, words_codecs.E2M1_WORDS_TEXT))
    want = run_ptx(nibbles, {4: words_of(data), **ops_})
    got = run_ptx(words, {4: words_of(e2m1_words.to_words(data)), **ops_})
    for reg in range(4):
        np.testing.assert_array_equal(got[f"${reg}"], want[f"${reg}"], err_msg=f"${reg}")
    # and the codes' own values times the scales (2**126 held by the folded ones), in element order
    ok = (scale_bytes < 255).repeat_interleave(4, dim=1).numpy()
    np.testing.assert_array_equal(lanes(got)[ok], e2m1_in_order(data, scales / (2.0 ** 126 if folded else 1))[ok])
    # no more instructions than the nibbles' decode, and no byte permutes
    count = lambda text: sum(1 for line in text.splitlines() if line and line[0].isalpha() and line[:4] != "mov.")
    assert count(words) <= count(nibbles) and "prmt" not in words


def test_the_dequantize_kernel_reads_words(rng):
    w = formats.quantize(torch.randn(3, 64, 96, generator=rng), "fp4_b32").to(DEVICE)
    for q in (w, formats.with_e2m1_words(w)):
        assert torch.equal(quant.dequantize(q, torch.float32), formats.dequantize(w).to(DEVICE))


def _experts(rng, m, k, E, top, I, shared_fmt, words):
    idx = torch.stack([torch.randperm(E, generator=rng)[:top] for _ in range(m)]).to(DEVICE, torch.int32)
    rw = torch.rand(m, top, generator=rng).to(DEVICE)
    q = lambda fmt, *s: formats.quantize(torch.randn(*s, generator=rng) * 0.25, fmt).to(DEVICE)
    experts = [q("fp4_w", *s) for s in ((E, I, k), (E, I, k), (E, k, I))]
    shared = tuple(q(shared_fmt, 1, *s) for s in ((I, k), (I, k), (k, I)))
    stack = lambda ws, w: [formats.as_expert_stack(x, True, w) for x in ws]
    return idx, rw, {w: (stack(experts, w), tuple(stack(shared, w))) for w in (False, words)}


# rows, K (ragged in some), split K, the shared expert's format, tiles beyond the rule
CASES = [(1, 96, None, "fp8_w", dict(fp4_decode="packed_prefetch"), dict(pair_tiles=64)),
         (8, 160, 2, "fp4_w", dict(fp4_decode="packed_prefetch", fp4_halves=True), dict(pair_tiles=0)),
         (13, 224, None, "fp4_w", dict(fp4_decode="dot_scaled"), dict(act_dequantized=True)),
         (5, 128, 3, "fp8_w", dict(fp4_decode="bits", fp4_scale_fold=True), dict(act_dequantized=True))]


@pytest.mark.parametrize("m,k,split,shared_fmt,lin_tiles,moe_tiles", CASES)
def test_words_give_the_nibbles_results(rng, m, k, split, shared_fmt, lin_tiles, moe_tiles):
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    w = formats.with_scale_max(formats.quantize(torch.randn(72, k, generator=rng) * 0.25, "fp4_w").to(DEVICE))
    idx, rw, stacks = _experts(rng, m, k, 4, 2, 64, shared_fmt, True)
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    out = {}
    for words, (experts, shared) in stacks.items():
        decode = lin_tiles
        if not words and lin_tiles["fp4_decode"] == "dot_scaled":  # words take the bit decode instead
            decode = dict(lin_tiles, fp4_decode="bits")
        tiles = dict(linear=dict(decode, linear=[[None, tile]], split_k=split),
                     moe=dict(moe_tiles, experts=[[None, dict(tile, split_k=split or 1)]]))
        with flashrt.use_backend("cuda"), pinned_tiles(**tiles):
            weight = formats.with_e2m1_words(w) if words else w
            out[words] = (ops.linear(x, weight), ops.moe_experts(x, rw, idx, *experts, 10.0, shared=shared))
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    with flashrt.use_backend("reference"):
        assert rel_err(out[True][0], ops.linear(x, w)) < 1e-3
        experts, shared = stacks[False]
        assert rel_err(out[True][1], ops.moe_experts(x, rw, idx, *experts, 10.0, shared=shared)) < 1e-2


def test_the_constexpr_marks_words_and_refuses_a_mix(rng):
    w = formats.quantize(torch.randn(64, 64, generator=rng), "fp4_w")
    words = formats.with_e2m1_words(w)
    assert lin.with_words(2, w) == 2 and lin.with_words(2, words) == 2 + lin.WORDS
    assert lin.with_words(1, words) == lin.WORDS  # tl.dot_scaled reads nibbles: the bit decode instead
    fp8 = formats.quantize(torch.randn(64, 64, generator=rng), "fp8_w")
    assert lin.with_words(10, words, fp8) == 10 + lin.WORDS
    with pytest.raises(ValueError, match="one code layout"):
        lin.with_words(2, w, words)
    m, k = 3, 64
    x = torch.randn(m, k, generator=rng).to(DEVICE, torch.bfloat16)
    idx, rw, stacks = _experts(rng, m, k, 4, 2, 32, "fp4_w", True)
    with flashrt.use_backend("cuda"), pytest.raises(ValueError, match="one code layout"):
        ops.moe_experts(x, rw, idx, *stacks[True][0], 10.0, shared=stacks[False][1])


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("n", [1, 8, 64, 600])
def test_experts_words_gpu(rng, n):
    """At the profile's tiles (the packed decode on sm_90): routed fp4 experts with an fp4 shared
    expert, words against nibbles bit for bit, for decode rows and a prefill's 64-row tiles."""
    E, top, D, I = 64, 6, 1024, 512
    x = torch.randn(n, D, generator=rng).to(DEVICE, torch.bfloat16)
    idx, rw, stacks = _experts(rng, n, D, E, top, I, "fp4_w", True)
    out = {}
    with flashrt.use_backend("cuda"):
        for words, (experts, shared) in stacks.items():
            out[words] = ops.moe_experts(x, rw, idx, *experts, 10.0, shared=shared)
    assert torch.equal(out[True], out[False])
    with flashrt.use_backend("reference"):
        experts, shared = stacks[False]
        assert rel_err(out[True], ops.moe_experts(x, rw, idx, *experts, 10.0, shared=shared)) < 2e-3
