"""The packed E2M1 decode (``tiles.linear.fp4_decode: packed``, ``codecs.E2M1_PAIRS_TEXT``).

Its PTX text runs here through a small emulator of the instructions it uses (``prmt``, shifts,
masks, ``mul.rn.bf16x2``) on every byte and a spread of UE8M0 scales, against the ``fp4_w``
format's values; on an sm_90 GPU, ``linear`` and ``moe_experts`` with the packed decode against
the bit decode and the reference. Under the interpreter the launcher falls back to the bit decode."""
import dataclasses
import re

import numpy as np
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import DEVICE, GPU, pinned_tiles, rel_err, requires_kernels
from ptx_emulator import (assert_fold_exact, bf16_bits as _bf16_bits, bf16_values, e2m1_in_order, lanes, run_ptx,
                          words_of)

pytestmark = requires_kernels
codecs = pytest.importorskip("flashrt.kernels_cuda.codecs")
lin = pytest.importorskip("flashrt.kernels_cuda.linear")

PACKED = dict(fp4_decode="packed")
SM90 = GPU and torch.cuda.get_device_capability() >= (9, 0)


def test_the_ptx_decodes_every_byte_and_scale(rng):
    """Words of four random fp4 bytes (every byte value among them) and per-pair scales from the
    whole UE8M0 range: each output lane is the byte's low / high code times its scale, in bf16."""
    assert set(re.findall(r"^\s*([a-z][a-z0-9.]*)\s", codecs.E2M1_PAIRS_TEXT, re.M)) <= {
        "mov.b32", "prmt.b32", "shl.b32", "and.b32", "or.b32", "mul.rn.bf16x2"}
    n = 4096
    data = torch.randint(0, 256, (n, 4), generator=rng, dtype=torch.uint8)
    data[:64] = torch.arange(256, dtype=torch.uint8).view(64, 4)
    scale_bytes = torch.randint(0, 256, (n, 2), generator=rng)
    scale_bytes[:8] = torch.tensor([[0, 1], [126, 127], [128, 200], [254, 255], [100, 3], [120, 122], [140, 9], [60, 0]])
    scales = torch.where(scale_bytes == 255, float("nan"), torch.exp2(scale_bytes.double() - 127))
    word = words_of(data)
    sb = _bf16_bits(scales)  # exact: powers of two in bf16's range (2**-127 a subnormal), NaN
    out = run_ptx(codecs.E2M1_PAIRS_TEXT, {4: word, 5: sb[:, 0] * 0x10001, 6: sb[:, 1] * 0x10001})
    codes = torch.stack([data & 15, data >> 4], dim=-1).long()  # [n, 4 bytes, low / high]
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    want = _bf16_bits(values * scales.repeat_interleave(2, dim=1)[:, :, None])  # bytes 0, 1 scale 0; 2, 3 scale 1
    lanes = {0: (0, 0), 1: (2, 0), 2: (0, 1), 3: (2, 1)}  # output reg -> (first byte, low / high nibble)
    for reg, (first, nibble) in lanes.items():
        got = out[f"${reg}"]
        for half in (0, 1):
            g = (got >> (16 * half)) & 0xFFFF
            w = want[:, first + half, nibble]
            nan = np.isnan(scales[:, (first + half) // 2].numpy())
            np.testing.assert_array_equal(g[~nan], w[~nan], err_msg=f"${reg} lane {half}")
            assert ((g[nan] & 0x7F80) == 0x7F80).all() and (g[nan] & 0x7F).all()  # NaN for the NaN scale


def test_the_ordered_ptx_gives_the_pairs_values_in_element_order(rng):
    """``E2M1_ORDERED_TEXT``: register r holds byte r's low and high codes, the values the pairs decode gives
    (bytes 0, 1 scaled by $5, bytes 2, 3 by $6), for every byte value and scales from the whole range; one
    byte permute, shift and mask a register, one shift a word, no merge."""
    n = 4096
    data = torch.randint(0, 256, (n, 4), generator=rng, dtype=torch.uint8)
    data[:64] = torch.arange(256, dtype=torch.uint8).view(64, 4)
    scale_bytes = torch.randint(0, 255, (n, 2), generator=rng)
    scale_bytes[:2] = torch.tensor([[0, 1], [253, 254]])
    sb = _bf16_bits(torch.exp2(scale_bytes.double() - 127))
    ops_ = {4: words_of(data), 5: sb[:, 0] * 0x10001, 6: sb[:, 1] * 0x10001}
    pairs, ordered = run_ptx(codecs.E2M1_PAIRS_TEXT, ops_), run_ptx(codecs.E2M1_ORDERED_TEXT, ops_)
    want = e2m1_in_order(data, torch.exp2(scale_bytes.double() - 127))  # the codes' values, lane by lane
    finite = (scale_bytes < 255).repeat_interleave(4, dim=1).numpy()
    np.testing.assert_array_equal(lanes(ordered)[finite], want[finite])
    half = lambda reg, h: (reg >> (16 * h)) & 0xFFFF
    for byte in range(4):  # the pairs decode: $0 / $1 low codes of bytes 0, 1 / 2, 3, $2 / $3 the high ones
        lo, hi = pairs[f"${byte // 2}"], pairs[f"${2 + byte // 2}"]
        np.testing.assert_array_equal(half(ordered[f"${byte}"], 0), half(lo, byte % 2), err_msg=f"byte {byte} low")
        np.testing.assert_array_equal(half(ordered[f"${byte}"], 1), half(hi, byte % 2), err_msg=f"byte {byte} high")
    ops = re.findall(r"^\s*([a-z][a-z0-9.]*)\s", codecs.E2M1_ORDERED_TEXT, re.M)
    assert ops.count("prmt.b32") == 4 and ops.count("shl.b32") == 5 and ops.count("and.b32") == 4
    assert "or.b32" not in ops


def test_the_ordered_ptx_folded_takes_the_rebias_from_its_scales(rng):
    """``E2M1_ORDERED_FOLDED_TEXT`` with a scale that holds 2**63 of the 2**126 re-bias (the ws attention's
    fp4_b16 rows): the ordered decode's values times 2**-63, bit for bit, for E4M3-valued scales."""
    finite = torch.arange(256, dtype=torch.uint8)
    finite = finite[~finite.view(torch.float8_e4m3fn).float().isnan()]
    n = 4096
    data = torch.randint(0, 256, (n, 4), generator=rng, dtype=torch.uint8)
    data[:64] = torch.arange(256, dtype=torch.uint8).view(64, 4)
    scales = finite[torch.randint(0, finite.numel(), (n, 2), generator=rng)].view(torch.float8_e4m3fn).double()
    sb, sb63 = _bf16_bits(scales), _bf16_bits(scales * 2.0 ** 63)
    word = words_of(data)
    plain = run_ptx(codecs.E2M1_ORDERED_TEXT, {4: word, 5: sb[:, 0] * 0x10001, 6: sb[:, 1] * 0x10001})
    down = run_ptx(codecs.E2M1_ORDERED_FOLDED_TEXT, {4: word, 5: sb63[:, 0] * 0x10001, 6: sb63[:, 1] * 0x10001})
    np.testing.assert_array_equal(lanes(down), _bf16_bits(bf16_values(lanes(plain)) * 2.0 ** -63))
    # and against the codes' values times the scales times 2**-63 (every product a normal bf16)
    np.testing.assert_array_equal(lanes(down), e2m1_in_order(data, scales * 2.0 ** -63))


def test_the_interpreter_keeps_the_bit_decode():
    """The E2M1 constexpr: the decode (0 bits, 1 dot_scaled, 2 packed: sm_90 only) plus 8 where the
    scales are loaded a block ahead ("packed_prefetch", whose decode falls back as "packed" does)."""
    want = {"bits": 0, "dot_scaled": 1, "packed": 2 if SM90 else 0, "packed_prefetch": 10 if SM90 else 8}
    for name, e2m1 in want.items():
        with pinned_tiles(linear=dict(fp4_decode=name)):
            assert lin.fp4_decode() == e2m1, name
            assert lin._linear_plan(1, 64, 64, torch.bfloat16, "fp4_w")["constexprs"]["E2M1"] == e2m1


@pytest.mark.parametrize("m,n,k,split", [(3, 72, 96, None), (20, 40, 320, 2), (1, 64, 160, 3)])
def test_scales_loaded_ahead_equal_the_plain_loop(rng, m, n, k, split):
    """Scales loaded a K block ahead ("packed_prefetch") give the plain loop's results bit for bit:
    ragged K (a masked last scale group, and a prefetch past k_hi), column tiles past N, split K
    (each split's first block loaded before its loop); ``linear`` and ``moe_experts`` (routed and
    shared fp4_w experts, DUAL up and single down). Under the interpreter both take the bit decode."""
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    w = formats.quantize(torch.randn(n, k, generator=rng) * 0.25, "fp4_w").to(DEVICE)
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    E, top, I = 4, 2, 64  # I: the experts' inner width (W2 is quantized along it: a multiple of 32)
    idx = torch.stack([torch.randperm(E, generator=rng)[:top] for _ in range(m)]).to(DEVICE, torch.int32)
    rw = torch.rand(m, top, generator=rng).to(DEVICE)
    experts = [formats.quantize(torch.randn(*s, generator=rng) * 0.25, "fp4_w").to(DEVICE)
               for s in ((E, I, k), (E, I, k), (E, k, I))]
    shared = tuple(formats.quantize(torch.randn(1, *s, generator=rng) * 0.25, "fp4_w").to(DEVICE)
                   for s in ((I, k), (I, k), (k, I)))
    out = {}
    for name in ("packed", "packed_prefetch"):
        tiles = dict(linear=dict(fp4_decode=name, linear=[[None, tile]], split_k=split),
                     moe=dict(experts=[[None, dict(tile, split_k=split or 1)]]))
        with flashrt.use_backend("cuda"), pinned_tiles(**tiles):
            out[name] = (ops.linear(x, w), ops.moe_experts(x, rw, idx, *experts, 10.0, shared=shared))
    assert torch.equal(out["packed"][0], out["packed_prefetch"][0])
    assert torch.equal(out["packed"][1], out["packed_prefetch"][1])
    with flashrt.use_backend("reference"):
        assert rel_err(out["packed_prefetch"][0], ops.linear(x, w)) < 1e-3
        assert rel_err(out["packed_prefetch"][1], ops.moe_experts(x, rw, idx, *experts, 10.0, shared=shared)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("decode", ["packed", "packed_prefetch"])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_linear_packed_gpu(rng, m, decode):
    x = torch.randn(m, 5120, generator=rng).to(DEVICE, torch.bfloat16)
    w = formats.quantize(torch.randn(2304, 5120, generator=rng) * 0.05, "fp4_w").to(DEVICE)
    with flashrt.use_backend("cuda"):
        with pinned_tiles(linear=dict(fp4_decode=decode)):
            got = ops.linear(x, w)
        with pinned_tiles():
            bits = ops.linear(x, w)
    with flashrt.use_backend("reference"):
        want = ops.linear(x, w)
    assert rel_err(got, bits) < 1e-6 and rel_err(got, want) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("n", [1, 8, 64])
def test_experts_packed_gpu(rng, n):
    """Routed fp4 experts with an fp8 shared expert in the same launches."""
    E, k, D, I = 64, 6, 1024, 512
    x = torch.randn(n, D, generator=rng).to(DEVICE, torch.bfloat16)
    idx = torch.rand(n, E, generator=rng).topk(k).indices.to(DEVICE, torch.int32)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    ws = [formats.quantize(torch.randn(*s, generator=rng) * 0.05, "fp4_w").to(DEVICE)
          for s in ((E, I, D), (E, I, D), (E, D, I))]
    shared = tuple(formats.quantize(torch.randn(1, *s, generator=rng) * 0.05, "fp8_w").to(DEVICE)
                   for s in ((I, D), (I, D), (D, I)))
    args = (x, rw, idx, *ws, 10.0)
    with flashrt.use_backend("cuda"):
        with pinned_tiles(linear=PACKED):
            got = ops.moe_experts(*args, shared=shared)
        with pinned_tiles():
            bits = ops.moe_experts(*args, shared=shared)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, shared=shared)
    assert rel_err(got, bits) < 1e-6 and rel_err(got, want) < 2e-3


def test_the_folded_ptx_equals_the_rebias(rng):
    """The decode with its 2**126 re-bias folded into the scales (``E2M1_PAIRS_FOLDED_TEXT``, scale
    ``2**(u - 1)``) gives the plain decode's bits for every byte and every scale byte it is used for
    (0..128), and one multiply a register fewer."""
    assert_fold_exact(rng, codecs.E2M1_PAIRS_TEXT, codecs.E2M1_PAIRS_FOLDED_TEXT, 126, lin.FOLD_MAX_SCALE, (4, 5, 6), 4)
    count = lambda text: text.count("mul.rn.bf16x2")
    assert count(codecs.E2M1_PAIRS_FOLDED_TEXT) == count(codecs.E2M1_PAIRS_TEXT) - 4 == 4


def test_the_fold_needs_the_tile_the_packed_decode_and_known_small_scales(rng):
    """``fold_scales`` adds 16 to a packed decode's E2M1 only with the ``fp4_scale_fold`` tile on and
    every fp4_w weight's recorded largest scale byte at most 128; other formats do not count."""
    w = formats.quantize(torch.randn(64, 64, generator=rng), "fp4_w")
    small, large = formats.with_scale_max(w), dataclasses.replace(formats.with_scale_max(w), scale_max=129)
    assert small.scale_max == int(w.scale.view(torch.uint8).max()) <= 128 and w.scale_max is None
    fp8 = formats.quantize(torch.randn(64, 64, generator=rng), "fp8_w")
    with pinned_tiles(linear=dict(fp4_scale_fold=True)):
        assert lin.fold_scales(2, small) == 18 and lin.fold_scales(10, small, fp8) == 26
        assert lin.fold_scales(10, small, large) == 10 and lin.fold_scales(2, w) == 2
        assert lin.fold_scales(0, small) == 0 and lin.fold_scales(8, small) == 8  # the bit decode: nothing to fold
    with pinned_tiles():
        assert lin.fold_scales(2, small) == 2
    assert small.narrow(0, 0, 8).scale_max == small.to("cpu").scale_max == small.scale_max
    assert formats.with_k_major_scales(small).scale_max == small.scale_max
    meta = formats.QTensor(w.data.to("meta"), w.scale.to("meta"), w.fmt, w.shape)  # shapes only: nothing to measure
    assert formats.with_scale_max(meta).scale_max is None


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("n", [1, 8, 300])
def test_folded_scales_gpu(rng, n):
    """The re-bias folded into the scales gives the packed decode's bits: ``linear`` and the
    experts (routed and shared fp4_w, their scales' largest bytes recorded), prefetch on; both
    within the reference backend's tolerance."""
    E, k, D, I = 16, 4, 1024, 512
    x = torch.randn(n, D, generator=rng).to(DEVICE, torch.bfloat16)
    idx = torch.rand(n, E, generator=rng).topk(k).indices.to(DEVICE, torch.int32)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    q = lambda *s: formats.with_scale_max(formats.quantize(torch.randn(*s, generator=rng) * 0.05, "fp4_w").to(DEVICE))
    ws, shared, w = [q(E, I, D), q(E, I, D), q(E, D, I)], (q(1, I, D), q(1, I, D), q(1, D, I)), q(I, D)
    out = {}
    for fold in (False, True):
        with flashrt.use_backend("cuda"), pinned_tiles(linear=dict(fp4_decode="packed_prefetch", fp4_scale_fold=fold)):
            assert (lin.fold_scales(lin.fp4_decode(), w, *ws, *shared) & lin.SCALE_FOLD) == fold * lin.SCALE_FOLD
            out[fold] = (ops.linear(x, w), ops.moe_experts(x, rw, idx, *ws, 10.0, shared=shared))
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    with flashrt.use_backend("reference"):
        assert rel_err(out[True][0], ops.linear(x, w)) < 1e-3
        assert rel_err(out[True][1], ops.moe_experts(x, rw, idx, *ws, 10.0, shared=shared)) < 1e-2


def test_the_ptx_with_e4m3_scales_is_exact(rng):
    """``fp4_b16`` rows (``codecs.dequant_rows`` on sm_90): the packed decode with a bf16 scale that
    is an E4M3 value (every finite byte, subnormals included) gives the code times the scale exactly,
    the value the code-by-code fp32 path rounds to bf16."""
    finite = torch.arange(256, dtype=torch.uint8)
    finite = finite[~finite.view(torch.float8_e4m3fn).float().isnan()]
    n = 4096
    data = torch.randint(0, 256, (n, 4), generator=rng, dtype=torch.uint8)
    data[:64] = torch.arange(256, dtype=torch.uint8).view(64, 4)
    pick = torch.randint(0, finite.numel(), (n, 2), generator=rng)
    m = finite.numel() // 2
    pick[:m] = torch.arange(2 * m).view(m, 2)  # every scale byte among them
    scales = finite[pick].view(torch.float8_e4m3fn).double()
    assert torch.equal(scales.to(torch.bfloat16).double(), scales)  # E4M3 values are exact in bf16
    word = words_of(data)
    sb = _bf16_bits(scales)
    out = run_ptx(codecs.E2M1_PAIRS_TEXT, {4: word, 5: sb[:, 0] * 0x10001, 6: sb[:, 1] * 0x10001})
    codes = torch.stack([data & 15, data >> 4], dim=-1).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    exact = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0) * scales.repeat_interleave(2, dim=1)[:, :, None]
    assert torch.equal(exact.to(torch.bfloat16).double(), exact)  # every product is a bf16 value
    want = _bf16_bits(exact)
    for reg, (first, nibble) in {0: (0, 0), 1: (2, 0), 2: (0, 1), 3: (2, 1)}.items():
        for half in (0, 1):
            np.testing.assert_array_equal((out[f"${reg}"] >> (16 * half)) & 0xFFFF, want[:, first + half, nibble])
