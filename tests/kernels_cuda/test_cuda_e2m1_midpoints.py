"""The ``fp4_b16`` element encoders that compare with the E2M1 midpoints times the block's E4M3 scale
(``kernels_cuda/codecs_e2m1.py``) give the reference's codes: the PTX text two bf16 elements a call
(through the PTX emulator, and natively on sm_90 in the quantize kernels), and the fp32 form in the
kernels under the interpreter."""
import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kernel_check import DEVICE, GPU, requires_kernels, run_both  # noqa: E402
from ptx_emulator import bf16_bits, run_ptx  # noqa: E402

from flashrt import formats  # noqa: E402
from flashrt.kernels_cuda import quant  # noqa: E402
from flashrt.kernels_cuda.codecs_e2m1 import E2M1_MIDPOINTS_TEXT  # noqa: E402

pytestmark = requires_kernels
MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
TIES_UP = (0.75, 1.75, 3.5)  # a tie there goes to the even code above: compared with the number below
SCALES = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every positive E4M3, 2**-9 .. 448
SM90 = GPU and torch.cuda.get_device_capability() >= (9, 0)


def _near_midpoints(s: float, rng) -> torch.Tensor:
    """bf16 values at every midpoint times ``s`` and up to 3 bf16 steps either side, both signs, plus
    random values over the block's range and the special ones, in a random order."""
    at = bf16_bits(torch.tensor(MIDS) * s).astype(np.int64)  # exact in bf16
    steps = np.arange(-3, 4)
    near = torch.from_numpy((at[:, None] + steps[None, :]).astype(np.int16).reshape(-1).copy()).view(torch.bfloat16)
    rand = (torch.rand(64, generator=rng) * 16 - 8) * s
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3e38, 6 * s, 8 * s])
    vals = torch.cat([near.float(), -near.float(), rand, special]).to(torch.bfloat16)
    return vals[torch.randperm(vals.numel(), generator=rng)]


def _want_bytes(x: torch.Tensor, s: float) -> np.ndarray:
    """The reference's byte of each pair: the E2M1 codes of the fp32 quotients, the first in the low nibble."""
    codes = formats.e2m1_codes(x.float() / torch.tensor(s, dtype=torch.float32)).numpy().astype(np.uint32)
    return codes[0::2] | (codes[1::2] << 4)


def test_the_ptx_codes_pairs_as_the_reference_at_every_scale(rng):
    """Every positive E4M3 scale; at each, the midpoints times it and their bf16 neighbours, random
    values, zeros of both signs, infinities, NaN, subnormals: the PTX's byte equals the reference's
    codes of the fp32 quotient (its clamp, ties to even, the sign from x)."""
    for s in SCALES.tolist():
        x = _near_midpoints(s, rng)
        x = x[: x.numel() // 2 * 2]
        bits = bf16_bits(x)
        words = bits[0::2] | (bits[1::2] << 16)  # the register a pair of consecutive bf16 makes
        thr = {}
        for i, m in enumerate(MIDS):
            t = int(bf16_bits(torch.tensor([m * s]))[0])
            assert torch.tensor([m * s]).to(torch.bfloat16).float().item() == m * s  # exact in bf16
            t -= m in TIES_UP
            thr[2 + i] = np.full(words.shape, t * 0x10001, dtype=np.uint32)
        out = run_ptx(E2M1_MIDPOINTS_TEXT, {1: words, **thr})["$0"]
        np.testing.assert_array_equal(out, _want_bytes(x, s), err_msg=f"scale {s}")


def _blocks_near_midpoints(rng, dtype) -> torch.Tensor:
    """Blocks of 16 whose amax ``6 * s`` makes the scale ``s``, every E4M3 scale, the other 15
    elements from :func:`_near_midpoints` (finite ones: a block's infinity would move its scale)."""
    blocks = []
    for s in SCALES.tolist():
        vals = _near_midpoints(s, rng).float()
        vals = vals[torch.isfinite(vals) & (vals.abs() <= 6 * s)]
        for chunk in vals.split(15):
            blocks.append(torch.cat([torch.tensor([6 * s]), chunk, torch.zeros(15 - chunk.numel())]))
    blocks += [torch.zeros(16)] * (-len(blocks) % 32)
    return torch.stack(blocks).view(-1, 512).to(dtype)


@pytest.mark.parametrize("pairs", [False, pytest.param(True, marks=pytest.mark.skipif(
    not SM90, reason="the PTX pairs need sm_90 (the interpreter takes the comparisons either way)"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp4_b16_compares_as_the_reference(dtype, pairs, rng, monkeypatch):
    """The quantize kernel's fp4_b16 elements (the fp32 comparisons; on sm_90 with bf16 and
    ``pairs`` the PTX) near every midpoint of every scale, byte for byte."""
    monkeypatch.setitem(quant.TILES, "quantize", {**quant.TILES["quantize"], "pairs": pairs})
    x = _blocks_near_midpoints(rng, dtype).to(DEVICE)
    got, want = run_both("quantize", x, "fp4_b16")
    assert torch.equal(got.scale.view(torch.uint8).cpu(), want.scale.view(torch.uint8).cpu())
    assert torch.equal(got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8).cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the bf16x2 comparisons need sm_90")
@pytest.mark.parametrize("pairs", [False, True])
def test_gpu_quantize_store_pairs(pairs, rng, monkeypatch):
    """``tiles.quant.quantize.pairs`` on sm_90: the PTX pairs in the kernel store the reference's bytes
    (blocks near every midpoint of every scale, through a slot map with skipped rows)."""
    monkeypatch.setitem(quant.TILES, "quantize", {**quant.TILES["quantize"], "pairs": pairs})
    x = _blocks_near_midpoints(rng, torch.bfloat16).to(DEVICE)
    assert quant.pairs_apply("fp4_b16", x.dtype) == pairs
    n = x.shape[0]
    data = torch.zeros(2 * n, 256, dtype=torch.uint8, device=DEVICE)
    scale = torch.zeros(2 * n, 32, dtype=torch.uint8, device=DEVICE)
    slots = torch.randperm(2 * n, generator=rng)[:n]
    slots[::7] = -1
    quant.quantize_store(x, "fp4_b16", data, scale, slots.to(DEVICE))
    q = formats.quantize(x.cpu(), "fp4_b16")
    keep = slots >= 0
    assert torch.equal(data.cpu()[slots[keep]], q.data.view(torch.uint8)[keep])
    assert torch.equal(scale.cpu()[slots[keep]], q.scale.view(torch.uint8)[keep])
