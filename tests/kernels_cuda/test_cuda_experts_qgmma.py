"""kernels_cuda/experts_qgmma.py: fp4_w expert rows on the fp8 warpgroup MMA, the weights its register operand.

Without a GPU: the bit-move decode (the kernel's PTX text, emulated) gives each MMA position the E2M1
value times 2**-6 of the K the kernel's activation order puts there, as an E4M3 byte (every code,
random rows). On an sm_90 GPU: the kernel's partial sums against float64 products of the codes' values and
scales, on fresh random inputs (8 and 16 tokens a tile, empty lanes, K splits, several experts, the
weights through a ring of copies or loaded where used)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashrt import formats
from kernel_check import GPU, rel_err
from ptx_emulator import run_ptx, words_of

q = pytest.importorskip("flashrt.kernels_cuda.experts_qgmma")
SM90 = GPU and torch.cuda.get_device_capability() >= (9, 0) and q.AVAILABLE


def _values(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of E2M1 codes (sign bit 3)."""
    mag = torch.tensor(formats.E2M1_VALUES, dtype=torch.float64)[(codes & 7).long()]
    return torch.where(codes & 8 > 0, -mag, mag)


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Standard packed fp4 bytes of codes [..., K]: code 2i in byte i's low nibble, 2i + 1 in its high one."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def test_decode_gives_each_mma_position_its_codes_value_times_2_pow_minus_6():
    """The kernel's PTX (emulated) on each 4-byte word a thread loads (at byte 4t of a block): its even
    codes fill MMA positions 4t..4t+3, its odd codes 16+4t..16+4t+3, each the code's value times 2**-6 in
    E4M3; position 16h + 4t + j is K 8t + 2j + h, the order the kernel stores the activations in."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    rows, K = 7, 256
    codes = torch.randint(0, 16, (rows, K), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)  # every code at least once
    words = words_of(_nibbles(codes).reshape(-1, 4))  # (row, block, t)
    regs = run_ptx(q.DECODE_PTX.value, {2: words})
    even, odd = (torch.from_numpy(regs[r].view(np.uint8).copy()).view(torch.float8_e4m3fn).double()
                 for r in ("$0", "$1"))
    # (row, block, t, j) at positions 32 block + 16 h + 4 t + j
    got = torch.stack([even.reshape(rows, K // 32, 4, 4), odd.reshape(rows, K // 32, 4, 4)], dim=2)
    h, t, j = torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(4), indexing="ij")
    k_of = (8 * t + 2 * j + h).reshape(32)  # K of each position in a block
    want = (_values(codes) * 2.0**-6).reshape(rows, K // 32, 32)[:, :, k_of]
    assert torch.equal(got.reshape(rows, K // 32, 32), want)


def _case(g, E, N, K, T, tokens, tiles, dev):
    codes = torch.randint(0, 16, (E, N, K), generator=g, dtype=torch.uint8)
    sbytes = torch.randint(118, 125, (E, N, K // 32), generator=g, dtype=torch.uint8)
    x = (torch.randn(T, K, generator=g) * 4).to(torch.float8_e4m3fn)
    xexp = torch.randint(-6, 4, (T, K // 32), generator=g).double()
    tile_e = torch.randint(0, E, (tiles,), generator=g, dtype=torch.int32)
    tile_tok = torch.randint(-1, T, (tiles, tokens), generator=g, dtype=torch.int32)
    wv = _values(codes) * torch.pow(2.0, sbytes.double() - 127).repeat_interleave(32, dim=2)
    xv = x.double() * torch.pow(2.0, xexp).repeat_interleave(32, dim=1)
    want = torch.zeros(tiles, tokens, N, dtype=torch.float64)
    for i in range(tiles):
        for c in range(tokens):
            if tile_tok[i, c] >= 0:
                want[i, c] = wv[tile_e[i]] @ xv[tile_tok[i, c]]
    xs = (torch.pow(2.0, xexp) * q.DECODE_SCALE).float()
    args = (x.to(dev), xs.to(dev), _nibbles(codes).to(dev), sbytes.to(dev), tile_e.to(dev), tile_tok.to(dev))
    return args, want


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("tokens,k_split,stages", [(8, 256, 4), (16, 128, 2), (8, 512, 0), (16, 256, 0), (8, 512, 3)])
def test_partials_sum_to_the_products(tokens, k_split, stages):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    args, want = _case(g, E=3, N=192, K=512, T=11, tokens=tokens, tiles=5, dev=torch.device("cuda"))
    out = q.experts_gemm(*args, k_split, stages)
    assert out.shape == (512 // k_split, 5, tokens, 192)
    got = out.sum(0).cpu()
    live = args[5].cpu() >= 0
    # each block's 32 products are summed inside one fp8 warpgroup MMA, whose accumulation keeps fewer bits
    # than fp32 (docs/performance.md gives what it measured to); the blocks are summed in fp32
    assert rel_err(got[live], want[live]) < 1e-4


def test_bad_shapes_are_refused_by_name():
    """The launcher refuses them before any launch (so on any device)."""
    g = torch.Generator().manual_seed(1)
    args, _ = _case(g, E=1, N=64, K=256, T=2, tokens=8, tiles=1, dev=torch.device("cpu"))
    with pytest.raises(ValueError, match="k_split of 128 dividing K, got N 64, K 256, k_split 192"):
        q.experts_gemm(*args, 192)
    with pytest.raises(ValueError, match="stages 0 or 2-6, got 1"):
        q.experts_gemm(*args, 128, 1)
    with pytest.raises(ValueError, match="8 or 16 tokens a tile, got 4"):
        q.experts_gemm(*args[:5], args[5][:, :4].contiguous(), 128)
