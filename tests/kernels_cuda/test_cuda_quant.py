"""CUDA kernels of quant.py (quantize, dequantize, quantize_store) against the reference, byte for byte."""
import pytest
import torch

pytest.importorskip("triton")

from _formats_ref import rand_input  # noqa: E402
from kernel_check import CountingKernel, DEVICE, launches, requires_kernels, run_both  # noqa: E402,F401 (launches: a fixture)

import flashrt  # noqa: E402
from flashrt import dispatch, formats, ops  # noqa: E402
from flashrt.kernels_cuda import quant  # noqa: E402

pytestmark = requires_kernels
FMTS = ["fp8", "fp4_b16", "fp4_b32"]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MIDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _u8(t):
    return t.contiguous().view(torch.uint8).cpu()


def _same_q(got, want):
    assert got.fmt == want.fmt and got.shape == want.shape
    assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
    assert got.scale.dtype == want.scale.dtype and got.scale.shape == want.scale.shape
    assert torch.equal(_u8(got.scale), _u8(want.scale)), "scale bytes differ"
    assert torch.equal(_u8(got.data), _u8(want.data)), "data bytes differ"


def _same_floats(got, want):
    """Bit-equal floats, NaN wherever the reference has NaN (payloads may differ)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.cpu(), want.cpu()
    nan = torch.isnan(w)
    assert torch.equal(torch.isnan(g), nan)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
    zero = (w == 0) & ~nan  # the sign of a zero may differ on the GPU (-0.0 decodes as +0.0)
    assert torch.equal(g[zero], w[zero])
    assert torch.equal(g[~nan & ~zero].view(ints), w[~nan & ~zero].view(ints))


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 96), (2, 2, 3, 32)])
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_matches_reference(fmt, shape, dtype, rng):
    x = rand_input(shape, dtype, rng, spread=30).to(DEVICE)
    _same_q(*run_both("quantize", x, fmt))


def _edge_rows(fmt):
    """Zero and -0.0 blocks, midpoint ties, saturation, subnormals, huge and tiny blocks."""
    blk = formats.spec(fmt).block
    rows = [[0.0] * blk, [-0.0] * blk, [1e-40, -1e-40, 2e-45, -0.0] + [0.0] * (blk - 4)]
    if fmt == "fp8":  # scale 1 (amax 448): every E4M3 midpoint, and one ulp either side
        pos = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mids = (pos[:-1] + pos[1:]) / 2
        vals = torch.cat([mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 1e9))])
        vals = torch.cat([vals, -vals, torch.tensor([2.0**-10, -(2.0**-10), 3 * 2.0**-10, 2.0**-12])])
        vals = torch.cat([vals, torch.zeros(-vals.numel() % (blk - 1))]).view(-1, blk - 1)
        rows += torch.cat([torch.full((vals.shape[0], 1), 448.0), vals], 1).tolist()
    else:  # amax 6 * 2**k gives scale 2**k: every E2M1 midpoint (ties to even) at several k
        for k in (-9, -3, 0, 2, 8):
            s = 2.0**k
            vals = [6 * s] + [m * s for m in MIDS] + [-m * s for m in MIDS]
            rows.append(vals + [0.0] * (blk - len(vals)) if len(vals) <= blk else vals[:blk])
    big = [1e4, -3e4, 1.0, -0.0] + [2.5e3] * (blk - 4)  # fp4_b16: scale clamps to 448, elements to 6
    huge = [3e38, -1e38, 1e30, 1.0] + [0.0] * (blk - 4)
    tiny = [1e-30, -3e-35, 7e-38, -1e-38] + [1e-39] * (blk - 4)
    rows += [big, huge, tiny]
    x = torch.tensor(rows, dtype=torch.float32)
    return torch.cat([x, torch.zeros(x.shape[0], blk)], 1)  # two blocks a row, the second all zero


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_edge_cases(fmt):
    x = _edge_rows(fmt).to(DEVICE)
    got, want = run_both("quantize", x, fmt)
    _same_q(got, want)
    assert torch.equal(_u8(got.data)[1], _u8(want.data)[1]) and int(_u8(got.data)[1, 0]) in (0x80, 0x88)  # -0.0 kept


def test_quantize_fp4_b16_near_midpoints_of_every_scale(rng):
    """fp4_b16 divides by an E4M3 scale (not a power of two): the kernel's quotient must round to
    the same E2M1 code as the reference's division where that matters most, at every E2M1 midpoint
    times every scale and the fp32 values up to 3 ulp either side."""
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 2**-9 .. 448
    mids = torch.tensor(MIDS) * torch.tensor([[1.0], [-1.0]])  # both signs
    steps = torch.arange(-3, 4, dtype=torch.int32)
    blocks = []
    for s in scales.tolist():
        at = (mids.flatten() * s).view(torch.int32)  # each midpoint times s (rounded once), then its neighbours
        vals = (at[:, None] + steps[None, :]).flatten().view(torch.float32)
        vals = vals[torch.randperm(vals.numel(), generator=rng)]
        for chunk in vals.split(15):  # each block's amax 6 * s (exact) makes its scale s
            blocks.append(torch.cat([torch.tensor([6 * s]), chunk, torch.zeros(15 - chunk.numel())]))
    blocks += [torch.zeros(16)] * (-len(blocks) % 4)
    x = torch.stack(blocks).view(-1, 64).to(DEVICE)
    _same_q(*run_both("quantize", x, "fp4_b16"))


@pytest.mark.parametrize("elems", [64, 256])
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_tiling(fmt, elems, rng, monkeypatch):
    """Rows wider than a program's tile (a second grid axis over scale blocks) and ragged row tiles."""
    monkeypatch.setitem(quant.TILES, "quantize", {**quant.TILES["quantize"], "ELEMS": elems})
    monkeypatch.setitem(quant.TILES, "dequantize", {**quant.TILES["dequantize"], "ELEMS": elems})
    x = rand_input((5, 224), torch.float32, rng, spread=10).to(DEVICE)
    got, want = run_both("quantize", x, fmt)
    _same_q(got, want)
    _same_floats(*run_both("dequantize", got, torch.float32))


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_non_contiguous(fmt, rng):
    base = rand_input((6, 4, 96), torch.bfloat16, rng, spread=10).to(DEVICE)
    for x in (base[:, 1:3, :64], base.transpose(0, 1)[..., 32:]):
        _same_q(*run_both("quantize", x, fmt))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # fp16 outputs overflow, as in torch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_matches_reference(fmt, dtype, rng):
    q = formats.quantize(rand_input((3, 4, 64), torch.float32, rng, spread=20), fmt)
    q = formats.QTensor(q.data.to(DEVICE), q.scale.to(DEVICE), fmt, q.shape)
    _same_floats(*run_both("dequantize", q, dtype))
    _same_floats(*run_both("dequantize", q.narrow(1, 1, 2), dtype))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # huge scales give inf, as in torch
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_any_bytes(fmt, rng):
    """Every data byte (E4M3 NaN 0x7F included) with every scale byte (UE8M0 0 and 255 included)."""
    s = formats.spec(fmt)
    n = 512 if s.packed else 256
    data = torch.arange(256, dtype=torch.uint8).repeat(n // 256 * 8).view(8, -1)[:, torch.randperm(n, generator=rng)]
    scale = torch.randint(0, 256, (8, 2 * n // s.block if s.packed else n // s.block), generator=rng,
                          dtype=torch.uint8)
    q = formats.QTensor(data.view(s.data_dtype).to(DEVICE), scale.view(s.scale_dtype).to(DEVICE), fmt,
                        (8, 2 * n if s.packed else n))
    _same_floats(*run_both("dequantize", q, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 96), (45, 70), (3, 33, 40), (1, 1)])
def test_dequantize_fp8_weights(shape, dtype, rng, launches):
    """``fp8_w`` (32 x 32 scale tiles, ragged at the edges, leading dims as separate matrices): the
    reference's values exactly; one launch of the weight kernel."""
    q = formats.quantize(rand_input(shape, torch.float32, rng, spread=20), "fp8_w")
    q = formats.QTensor(q.data.to(DEVICE), q.scale.to(DEVICE), "fp8_w", q.shape)
    _same_floats(*run_both("dequantize", q, dtype))
    assert launches == ["_dequantize_w_kernel"]


def test_dequantize_fp8_weights_any_bytes(rng):
    """Every E4M3 byte (NaN 0x7F / 0xFF included) under random UE8M0 tile scales (0 and 255 included)."""
    data = torch.arange(256, dtype=torch.uint8).repeat(40)[torch.randperm(256 * 40, generator=rng)].view(80, 128)
    scale = torch.randint(0, 256, (3, 4), generator=rng, dtype=torch.uint8)
    scale[0, 0], scale[2, 3] = 0, 255
    q = formats.QTensor(data.view(torch.float8_e4m3fn).to(DEVICE), scale.view(torch.float8_e8m0fnu).to(DEVICE),
                        "fp8_w", (80, 128))
    _same_floats(*run_both("dequantize", q, torch.float32))


@pytest.mark.parametrize("fmt", FMTS)
def test_empty(fmt):
    got, want = run_both("quantize", torch.zeros(0, 3, 64, device=DEVICE), fmt)
    _same_q(got, want)
    _same_floats(*run_both("dequantize", got, torch.bfloat16))


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_store(fmt, slot_dtype, rng):
    s = formats.spec(fmt)
    n, d, pages, page = 11, 64, 4, 8
    x = rand_input((n, d), torch.bfloat16, rng, spread=10).to(DEVICE)
    data_len = d // 2 if s.packed else d
    cache_data = torch.randint(0, 256, (pages, page, data_len), generator=rng, dtype=torch.uint8).to(DEVICE)
    cache_scale = torch.randint(0, 256, (pages, page, d // s.block), generator=rng, dtype=torch.uint8).to(DEVICE)
    cache_data, cache_scale = cache_data.view(s.data_dtype), cache_scale.view(s.scale_dtype)
    slots = torch.randperm(pages * page, generator=rng)[:n]
    slots[[2, 7]] = -1
    want_data, want_scale = _u8(cache_data).view(-1, data_len).clone(), _u8(cache_scale).view(-1, d // s.block).clone()
    q = formats.quantize(x.cpu(), fmt)
    keep = slots >= 0
    want_data[slots[keep]] = _u8(q.data)[keep]
    want_scale[slots[keep]] = _u8(q.scale)[keep]
    quant.quantize_store(x, fmt, cache_data, cache_scale, slots.to(slot_dtype).to(DEVICE))
    assert torch.equal(_u8(cache_data).view(-1, data_len), want_data)
    assert torch.equal(_u8(cache_scale).view(-1, d // s.block), want_scale)


def test_quantize_store_rejects_bad_arguments():
    x = torch.randn(4, 64, device=DEVICE)
    data = torch.zeros(16, 64, dtype=torch.uint8, device=DEVICE)
    scale = torch.zeros(16, 2, dtype=torch.uint8, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="fmt"):
        quant.quantize_store(x, "fp8_w", data, scale, slots)
    with pytest.raises(ValueError, match="cache_data"):
        quant.quantize_store(x, "fp4_b32", data, scale, slots)  # fp4 rows are D/2 bytes
    with pytest.raises(ValueError, match="slot_mapping"):
        quant.quantize_store(x, "fp8", data, scale, slots[:3])


def test_supports_declines_weight_formats_but_dequantizes_fp8_weights():
    x = torch.randn(32, 64, device=DEVICE)
    serves = lambda op, *args: quant.FAMILY.serves(op, *args) is None
    assert serves("quantize", x, "fp8") and not serves("quantize", x, "fp8_w")
    assert not serves("quantize", x, "fp4_w")
    assert not serves("dequantize", formats.quantize(x.cpu(), "fp4_w"), torch.float32)
    assert serves("dequantize", formats.quantize(x.cpu(), "fp8_w"), torch.float32)
    with flashrt.use_backend("cuda"), pytest.raises(flashrt.BackendError):
        ops.quantize(x, "fp8_w")


def test_cuda_backend_runs_the_kernels(monkeypatch):
    calls = []
    monkeypatch.setattr(quant, "_quantize_kernel", CountingKernel(quant._quantize_kernel, calls))
    monkeypatch.setattr(quant, "_dequantize_kernel", CountingKernel(quant._dequantize_kernel, calls))
    assert dispatch.backends()["cuda"].ops["quantize"] is quant.quantize
    with flashrt.use_backend("cuda"):
        ops.dequantize(ops.quantize(torch.randn(2, 64, device=DEVICE), "fp4_b16"))
    assert len(calls) == 2


# ------------------------------------------------------------------------------ realistic, GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(1, 512), (64, 512), (16384, 512), (8, 32, 128), (4096, 7168)])
def test_gpu_quantize_realistic(fmt, shape, rng):
    x = rand_input(shape, torch.bfloat16, rng, spread=20).to(DEVICE)
    got, want = run_both("quantize", x, fmt)
    _same_q(got, want)
    _same_floats(*run_both("dequantize", got, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_quantize_store_realistic(fmt, rng):
    s = formats.spec(fmt)
    slots_total, n, d = 65536, 4096, 512
    x = rand_input((n, d), torch.bfloat16, rng, spread=10).to(DEVICE)
    cache_data = torch.zeros(slots_total // 64, 64, d // 2 if s.packed else d, dtype=torch.uint8, device=DEVICE)
    cache_scale = torch.zeros(slots_total // 64, 64, d // s.block, dtype=torch.uint8, device=DEVICE)
    slots = torch.randperm(slots_total, generator=rng)[:n]
    slots[::17] = -1
    quant.quantize_store(x, fmt, cache_data, cache_scale, slots.to(DEVICE))
    q = formats.quantize(x, fmt)
    keep = (slots >= 0).to(DEVICE)
    rows = slots.to(DEVICE)[keep]
    assert torch.equal(cache_data.view(-1, cache_data.shape[-1])[rows], q.data.view(torch.uint8)[keep])
    assert torch.equal(cache_scale.view(-1, cache_scale.shape[-1])[rows], q.scale.view(torch.uint8)[keep])
