"""Weight scales laid out K major (``[.., K / 32, N]`` in memory, the same ``[.., N, K / 32]`` tensor):
``linear`` and ``moe_experts`` read them in place (``SCALE_K``: the scales' K stride) and give
exactly the results of the row-major layout, on every decode of the MMA loop (the kernels' own
E2M1 decode bit by bit or two a byte, with the scales loaded a block ahead, ``tl.dot_scaled``), the
multiply-add GEMV, fp8 promotion, split K and the shared expert; the reference's values; a scale
contiguous along neither dim is copied first."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import DEVICE, assert_counters_zero, pinned_tiles, rel_err, requires_kernels

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
moe = pytest.importorskip("flashrt.kernels_cuda.moe")

MMA = [[None, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)]]
FMA = [[None, dict(BLOCK_M=2, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)]]
DECODES = {name: dict(fp4_decode=name) for name in ("bits", "packed", "packed_prefetch", "dot_scaled")}


def k_major(w: formats.QTensor) -> formats.QTensor:
    """``formats.with_k_major_scales``: the same scale values and shape, the K groups' stride the
    rows' count, the data shared."""
    got = formats.with_k_major_scales(w)
    assert torch.equal(got.scale.view(torch.uint8), w.scale.view(torch.uint8)) and got.scale.shape == w.scale.shape
    assert got.scale.stride(-2) == 1 and got.scale.stride(-1) == w.scale.shape[-2] and got.data is w.data
    return got


def _weight(rng, fmt, *shape):
    return formats.quantize(torch.randn(*shape, generator=rng) * 0.25, fmt).to(DEVICE)


def _run(backend, op, *args, **kw):
    with flashrt.use_backend(backend):
        return getattr(ops, op)(*args, **kw)


@pytest.mark.parametrize("fmt,decode", [("fp4_w", "bits"), ("fp4_w", "packed"), ("fp4_w", "packed_prefetch"),
                                        ("fp4_w", "dot_scaled"), ("fp8_w", "bits")])
@pytest.mark.parametrize("rules", [MMA, FMA], ids=["mma", "fma"])
@pytest.mark.parametrize("m,n,k,split", [(3, 72, 320, None), (1, 64, 160, 3)])
def test_linear(rng, fmt, decode, rules, m, n, k, split):
    x = (torch.randn(m, k, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    w = _weight(rng, fmt, n, k)
    wk = k_major(w)
    with pinned_tiles(linear=dict(DECODES[decode], linear=rules, split_k=split)):
        got = _run("cuda", "linear", x, wk)
        assert_counters_zero(got)
        row = _run("cuda", "linear", x, w)
    assert torch.equal(got, row)
    assert rel_err(got, _run("reference", "linear", x, w)) < 1e-3


@pytest.mark.parametrize("mode", [True, False], ids=["fp8_mma", "dequant"])
def test_linear_fp8_promotion(rng, mode, monkeypatch):
    """fp8_w through the per-32 promotion (the tile scales' column loads) and through dequantization."""
    monkeypatch.setitem(lin.TILES, "fp8_mma", mode)
    x = torch.randn(20, 256, generator=rng).to(DEVICE, torch.bfloat16)
    w = _weight(rng, "fp8_w", 96, 256)
    with pinned_tiles(linear=dict(fp8_mma=mode, linear=MMA)):
        got, row = _run("cuda", "linear", x, k_major(w)), _run("cuda", "linear", x, w)
    assert torch.equal(got, row)
    assert rel_err(got, _run("reference", "linear", x, w)) < 1e-3


@pytest.mark.parametrize("decode", list(DECODES))
@pytest.mark.parametrize("block_m", [16, 4])
@pytest.mark.parametrize("n,shared_fmt,pair_tiles", [(1, None, 1), (6, "fp8_w", 0), (3, "fp4_w", 1)])
def test_experts(rng, decode, block_m, n, shared_fmt, pair_tiles):
    E, k, D, I = 6, 2, 96, 64
    x = torch.randn(n, D, generator=rng).to(DEVICE, torch.bfloat16)
    indices = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(n)]).to(DEVICE, torch.int32)
    weights = torch.rand(n, k, generator=rng).to(DEVICE)
    w1, w3, w2 = _weight(rng, "fp4_w", E, I, D), _weight(rng, "fp4_w", E, I, D), _weight(rng, "fp4_w", E, D, I)
    shared = None
    if shared_fmt:
        shared = (_weight(rng, shared_fmt, 1, I, D), _weight(rng, shared_fmt, 1, I, D),
                  _weight(rng, shared_fmt, 1, D, I))
    shared_k = tuple(k_major(w) for w in shared) if shared else None
    rules = dict(experts=[[None, dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2,
                                      split_k=2)]], pair_tiles=pair_tiles)
    with pinned_tiles(linear=DECODES[decode], moe=rules):
        got = _run("cuda", "moe_experts", x, weights, indices, k_major(w1), k_major(w3), k_major(w2), 1.0,
                   shared=shared_k)
        assert_counters_zero(got)
        row = _run("cuda", "moe_experts", x, weights, indices, w1, w3, w2, 1.0, shared=shared)
    assert torch.equal(got, row)
    want = _run("reference", "moe_experts", x, weights, indices, w1, w3, w2, 1.0, shared=shared)
    assert rel_err(got, want) < 1e-2


def test_operands_read_in_place_or_copied(rng):
    """K-major and row-major scales reach the kernels as they are; a scale contiguous along neither
    of its last two dims (every other row of a larger array) is copied, with the same results."""
    w = _weight(rng, "fp4_w", 4, 64, 128)
    for layout in (w, k_major(w)):
        _, scale = lin.weight_operands(layout)
        assert scale.data_ptr() == layout.scale.data_ptr() and scale.stride() == layout.scale.stride()
    big = torch.zeros(*w.scale.shape[:-1], 2 * w.scale.shape[-1], dtype=torch.uint8, device=DEVICE)
    big[..., ::2] = w.scale.view(torch.uint8)
    wide = formats.QTensor(w.data, big[..., ::2].view(w.scale.dtype), w.fmt, w.shape)
    assert wide.scale.stride(-1) == 2 and wide.scale.stride(-2) != 1
    _, scale = lin.weight_operands(wide)
    assert scale.is_contiguous() and torch.equal(scale, wide.scale.view(torch.uint8))
    x = torch.randn(2, 128, generator=rng).to(DEVICE, torch.bfloat16)
    flat = formats.QTensor(w.data[0], w.scale[0], w.fmt, w.shape[1:])
    odd = formats.QTensor(wide.data[0], wide.scale[0], w.fmt, w.shape[1:])
    got = _run("cuda", "linear", x, odd)
    assert torch.equal(got, _run("cuda", "linear", x, flat))
    assert rel_err(got, _run("reference", "linear", x, flat)) < 1e-3
