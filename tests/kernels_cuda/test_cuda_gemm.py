"""CUDA gemm family (kernels_cuda/linear.py: linear; kernels_cuda/moe.py: moe_experts) vs the reference.

On CPU the kernels run in the Triton interpreter on tiny shapes; on a GPU the same tests run there,
plus the ``gpu``-marked realistic shapes (``pytest -m gpu``). Both MMA paths are checked: fp8 dot
with per-32 scale promotion (sm_89+) and dequantize-to-bf16 (sm_80), forced through ``TILES``.
"""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from flashrt.errors import BackendError
from kernel_check import (DEVICE, GPU, moe_reference_by_expert, pinned_tiles, record_launches, requires_kernels,
                          rel_err, run_both)

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")  # needs triton (not a GPU)
moe = pytest.importorskip("flashrt.kernels_cuda.moe")

MODES = {"fp8_mma": True, "dequant": False}


def _randn(rng, *shape, scale=1.0):
    return (torch.randn(*shape, generator=rng) * scale).to(DEVICE)


def _weight(rng, fmt, *shape, scale=0.25):
    return formats.quantize(_randn(rng, *shape, scale=scale), fmt)


def _tol(dtype):
    """bf16 / fp16 outputs: their rounding. fp32: the accumulation; on sm_90 a 64-row tile's fp8 MMA is
    a wgmma, whose accumulator keeps fewer bits than fp32 within each 32-wide K slice (the slices
    are then promoted into the fp32 accumulator), so a few 1e-5 there."""
    if dtype != torch.float32:
        return 1e-3
    return 1e-4 if GPU and torch.cuda.get_device_capability() >= (9, 0) else 1e-5


@pytest.fixture
def mode(request, monkeypatch):
    monkeypatch.setitem(lin.TILES, "fp8_mma", MODES[request.param])
    return request.param


# ------------------------------------------------------------------------------------ act quant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_is_the_fp8_format(rng, dtype):
    x = _randn(rng, 9, 320) * torch.logspace(-7, 3, 320, device=DEVICE)
    x[0, :32] = 448 * 2.0**-3  # amax / 448 exactly a power of two
    x[1, :32] = 0.0
    x[2, 32:64] = 1e-6  # below the 1e-4 amax floor
    x[3, 64:96] = torch.tensor([17.0, 19.0, 21.0, 23.0] * 8) * 2.0**-4  # E4M3 ties
    x = x.to(dtype)
    q, s = lin.act_quant(x)
    want = formats.quantize(x, "fp8")
    assert q.dtype == s.dtype == torch.uint8  # E4M3 and UE8M0 bytes, bit for bit the fp8 format
    assert torch.equal(q, want.data.view(torch.uint8)) and torch.equal(s, want.scale.view(torch.uint8))


# ------------------------------------------------------------------------------------ linear


@pytest.mark.parametrize("mode", list(MODES), indirect=True)
@pytest.mark.parametrize("fmt", ["fp8_w", "fp4_w"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,out_f,in_f", [((1,), 40, 96), ((2, 3), 72, 64)])
def test_linear(rng, mode, fmt, dtype, lead, out_f, in_f):
    x = _randn(rng, *lead, in_f).to(dtype)
    w = _weight(rng, fmt, out_f, in_f)
    got, want = run_both("linear", x, w)
    assert got.dtype == dtype and got.shape == (*lead, out_f)
    assert rel_err(got, want) < _tol(dtype)


@pytest.mark.parametrize("mode", list(MODES), indirect=True)
def test_linear_every_e4m3_code(mode):
    """Identity activations read back each of the 254 finite E4M3 weight codes exactly (scale 1)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    data = codes.view(8, 32).view(torch.float8_e4m3fn)
    scale = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = formats.QTensor(data.to(DEVICE), scale.to(DEVICE), "fp8_w", (8, 32))
    got, want = run_both("linear", torch.eye(32, device=DEVICE), w)
    assert torch.equal(got, want) and torch.equal(got.T.cpu(), data.to(torch.float32))


@pytest.mark.parametrize("mode", list(MODES), indirect=True)
@pytest.mark.parametrize("fmt", ["fp8_w", "fp4_w"])
def test_linear_split_k_and_tile_order(rng, monkeypatch, mode, fmt):
    """Several row and column tiles (grouped order) and K split over 2 programs (fp32 partials)."""
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    monkeypatch.setitem(lin.TILES, "linear", ((None, tile),))
    monkeypatch.setitem(lin.TILES, "group_m", 2)
    monkeypatch.setitem(lin.TILES, "split_k", 2)
    x = _randn(rng, 40, 256).to(torch.bfloat16)
    w = _weight(rng, fmt, 72, 256)
    got, want = run_both("linear", x, w)
    assert rel_err(got, want) < 1e-3


@pytest.mark.parametrize("out_f,in_f", [(72, 256), (40, 96)])
def test_linear_bf16_gemm_path(rng, monkeypatch, out_f, in_f):
    """tiles.linear.bf16_gemm_min_rows (set by a profile, as h200.yaml does): bf16 x and fp8_w
    from that many rows go through exact bf16 operands and one bf16 GEMM (ragged 32 x 32 weight
    tiles at 40 x 96); fewer rows, fp32 x and fp4_w keep the kernel."""
    calls = []
    real = lin._bf16_gemm
    monkeypatch.setattr(lin, "_bf16_gemm", lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    w = _weight(rng, "fp8_w", out_f, in_f)
    with pinned_tiles(linear={"bf16_gemm_min_rows": 16}):
        for rows, dtype in ((20, torch.bfloat16), (8, torch.bfloat16), (20, torch.float32)):
            x = _randn(rng, rows, in_f).to(dtype)
            got, want = run_both("linear", x, w)
            assert got.dtype == dtype and rel_err(got, want) < _tol(dtype)
        run_both("linear", _randn(rng, 20, in_f).to(torch.bfloat16), _weight(rng, "fp4_w", out_f, in_f))
    assert calls == [(20, in_f)]


@pytest.mark.parametrize("rows,k,dtype", [(7, 96, torch.bfloat16), (40, 256, torch.float32), (3, 1024, torch.bfloat16)])
def test_the_bf16_paths_activations_are_act_quants_values_in_one_launch(rng, monkeypatch, rows, k, dtype):
    """``fp8_rows_bf16`` (the bf16 GEMM path's and the grouped experts' activations): bit for bit the values
    ``act_quant``'s bytes and scales stand for, a block of tiny values included, from one launch."""
    from flashrt.formats import QTensor
    from flashrt.kernels_cuda import quant

    x = (_randn(rng, rows, k) * 3.0).to(dtype)
    x[0, :32] *= 1e-30
    q, s = lin.act_quant(x)
    want = quant.dequantize(QTensor(q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), "fp8", (rows, k)),
                            torch.bfloat16)
    launches = record_launches(monkeypatch)
    got = lin.fp8_rows_bf16(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want) and launches == ["_fp8_round_trip_kernel"]


@pytest.mark.parametrize("rows,k,dtype", [(5, 96, torch.bfloat16), (33, 256, torch.float32)])
def test_fp8_codes_are_act_quants_bytes_and_scales_in_one_launch(rng, monkeypatch, rows, k, dtype):
    """``round_trip.fp8_codes`` (the fp8 MMA's activations): act_quant's E4M3 bytes bit for bit, its block
    scales times the asked factor, a block of tiny values included, from one launch."""
    from flashrt.kernels_cuda.round_trip import fp8_codes

    x = (_randn(rng, rows, k) * 3.0).to(dtype)
    x[-1, -32:] *= 1e-30
    q, s = lin.act_quant(x)
    launches = record_launches(monkeypatch)
    codes, scales = fp8_codes(x, dict(BLOCK_R=4, BLOCK_C=64, num_warps=4), 64.0)
    assert launches == ["_fp8_codes_kernel"] and codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(codes.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scales, s.view(torch.float8_e8m0fnu).float() * 64.0)
    with pytest.raises(ValueError, match="multiple of 32, got 40"):
        fp8_codes(x[:, :40], dict(BLOCK_R=4, BLOCK_C=64, num_warps=4))


def test_linear_large_tile_fp16(rng):
    x = _randn(rng, 70, 64).to(torch.float16)
    w = _weight(rng, "fp8_w", 33, 64)
    got, want = run_both("linear", x, w)
    assert got.dtype == torch.float16 and rel_err(got, want) < 1e-3


def test_sm80_path_uint8_operands(rng, monkeypatch):
    """Without fp8 MMA (sm_80) E4M3 data reaches the kernels as uint8 and runs the dequant path."""
    monkeypatch.setattr(lin, "supports_fp8_mma", lambda: False)
    x = _randn(rng, 3, 64).to(torch.bfloat16)
    assert lin.act_quant(x)[0].dtype == torch.uint8 and lin.mma_mode("fp8_w")[0] is False
    got, want = run_both("linear", x, _weight(rng, "fp8_w", 40, 64))
    assert rel_err(got, want) < 1e-3
    route = (torch.ones(3, 1, device=DEVICE), torch.zeros(3, 1, dtype=torch.int32, device=DEVICE))
    got, want = run_both("moe_experts", x, *route, *_experts(rng, "fp8_w", 1, 32, 64), 10.0)
    assert rel_err(got, want) < 1e-3


def test_linear_no_rows(rng):
    w = _weight(rng, "fp4_w", 40, 64)
    got, want = run_both("linear", torch.zeros(0, 64, device=DEVICE), w)
    assert got.shape == want.shape == (0, 40)


# ------------------------------------------------------------------------------------ moe_experts


def _one_code_flips(x, weights, indices, w1, w3, w2, limit, diff: torch.Tensor) -> list[bool]:
    """Per token: whether its output difference ``diff`` [N, D] (kernel - reference) is one code of
    the fp8-quantized intermediate (the input of W2) one step apart: ``+-step_i * W2[e, :, i]`` for
    one expert slot and one intermediate column ``i``. The kernel's fp32 sums run in another order
    than the reference's, so a value within an ulp of a rounding midpoint may round the other way."""
    from flashrt.refmath_linear import dequantized_weight
    from flashrt.refmath_moe import _project, swiglu

    x, weights, indices, diff = x.cpu(), weights.cpu(), indices.cpu().long(), diff.cpu()
    w1, w3, w2 = (formats.QTensor(w.data.cpu(), w.scale.cpu(), w.fmt, w.shape) for w in (w1, w3, w2))
    down = dequantized_weight(w2)  # [E, D, I]
    out = []
    for t in range(x.shape[0]):
        found = not diff[t].any()
        for k, e in enumerate([] if found else indices[t].tolist()):
            xe = x[t:t + 1]
            h = swiglu(_project(xe, w1, e), _project(xe, w3, e), weights[t, k:k + 1], limit)[0]
            q = formats.quantize(h.unsqueeze(0), "fp8")
            scale = q.scale.to(torch.float32).repeat_interleave(h.shape[0] // q.scale.shape[-1], dim=-1)[0]
            v = (h / scale).abs().clamp_min(2.0**-6)  # E4M3: 3 mantissa bits, normal from 2^-6
            step = scale * 2.0 ** (torch.floor(torch.log2(v)) - 3)
            cols = down[e]  # [D, I]
            alpha = (diff[t] @ cols) / (cols * cols).sum(dim=0)  # the best multiple of each column
            resid = (diff[t].unsqueeze(1) - alpha * cols).abs().amax(dim=0)
            ok = (resid <= 1e-4 * diff[t].abs().max()) & ((alpha.abs() - step).abs() <= 1e-3 * step)
            found = found or bool(ok.any())
        out.append(found)
    return out


def _experts(rng, fmt, E, I, D):
    return _weight(rng, fmt, E, I, D), _weight(rng, fmt, E, I, D), _weight(rng, fmt, E, D, I)


@pytest.mark.parametrize("mode", list(MODES), indirect=True)
@pytest.mark.parametrize("fmt,E,k", [("fp4_w", 4, 2), ("fp8_w", 1, 1), ("fp8_w", 3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [0.0, 1.0])
def test_moe_experts(rng, mode, fmt, E, k, dtype, limit):
    N, D, I = 5, 64, 32
    x = _randn(rng, N, D, scale=3.0).to(dtype)
    indices = torch.randint(0, E, (N, k), generator=rng, dtype=torch.int32).to(DEVICE)  # repeats allowed
    weights = torch.rand(N, k, generator=rng).to(DEVICE)
    experts = _experts(rng, fmt, E, I, D)
    got, want = run_both("moe_experts", x, weights, indices, *experts, limit)
    assert got.dtype == torch.float32 and got.shape == (N, D)
    if rel_err(got, want) >= _tol(dtype):  # only a near-tie of the fp8 intermediate rounded the other way
        diff = torch.where(((got - want).abs() > _tol(dtype) * want.abs().amax()).any(dim=1, keepdim=True),
                           got - want, 0.0)
        assert all(_one_code_flips(x, weights, indices, *experts, limit, diff)), (got - want).abs().amax(dim=1)


def test_moe_experts_multi_tile_and_unused_experts(rng):
    """Mean rows per expert > 16 (the 64-row tile), two experts never chosen, I = 64 > 32."""
    N, D, I, E, k = 40, 64, 64, 5, 2
    x = _randn(rng, N, D, scale=2.0).to(torch.bfloat16)
    indices = torch.tensor([1, 3, 4], dtype=torch.int32)[torch.randint(0, 3, (N, k), generator=rng)].to(DEVICE)
    weights = torch.rand(N, k, generator=rng).to(DEVICE)
    got, want = run_both("moe_experts", x, weights, indices, *_experts(rng, "fp4_w", E, I, D), 10.0)
    assert rel_err(got, want) < 1e-3


def test_moe_experts_no_tokens(rng):
    w = _experts(rng, "fp4_w", 2, 32, 64)
    empty = torch.zeros(0, 2, device=DEVICE)
    got, want = run_both("moe_experts", torch.zeros(0, 64, device=DEVICE), empty, empty.int(), *w, 0.0)
    assert got.shape == want.shape == (0, 64)


# ------------------------------------------------------------------------------------ dispatch


def test_supports_declines_plain_and_mixed_weights(rng):
    x = _randn(rng, 3, 64)
    serves = lambda fam, op, *args: fam.FAMILY.serves(op, *args) is None
    assert not serves(lin, "linear", x, _randn(rng, 8, 64))
    assert serves(lin, "linear", x, _weight(rng, "fp8_w", 8, 64))
    plain = (_randn(rng, 2, 32, 64), _randn(rng, 2, 32, 64), _randn(rng, 2, 64, 32))
    route = (torch.ones(3, 1, device=DEVICE), torch.zeros(3, 1, dtype=torch.int32, device=DEVICE))
    assert not serves(moe, "moe_experts", x, *route, *plain, 0.0)
    w1, w3, w2 = _experts(rng, "fp4_w", 2, 32, 64)
    w3_fp8 = _weight(rng, "fp8_w", 2, 32, 64)
    assert not serves(moe, "moe_experts", x, *route, w1, w3_fp8, w2, 0.0)
    assert serves(moe, "moe_experts", x, *route, w1, w3, w2, 0.0)
    with flashrt.use_backend("cuda"), pytest.raises(BackendError):
        ops.linear(x, _randn(rng, 8, 64))


def test_cuda_backend_runs_these_kernels(rng, monkeypatch):
    calls = []
    monkeypatch.setattr(lin, "act_quant", lambda x, f=lin.act_quant: calls.append("linear") or f(x))
    monkeypatch.setattr(moe, "act_quant", lambda x, f=moe.act_quant: calls.append("moe") or f(x))
    x = _randn(rng, 2, 64).to(torch.bfloat16)
    # separate activation quantization (prefill sizes), whatever the device's profile sets
    with pinned_tiles(linear={"fused_max_rows": 0}, moe={"fused_max_tokens": 0}), flashrt.use_backend("cuda"):
        ops.linear(x, _weight(rng, "fp4_w", 32, 64))
        route = (torch.ones(2, 1, device=DEVICE), torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
        ops.moe_experts(x, *route, *_experts(rng, "fp8_w", 1, 32, 64), 0.0)
    assert calls == ["linear", "moe"]


# ------------------------------------------------------------------------------------ GPU shapes

gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", list(MODES), indirect=True)
@pytest.mark.parametrize("m", [1, 8, 64, 4096])
@pytest.mark.parametrize("out_f,in_f", [(1280, 5120), (2304, 5120), (4096, 1280), (5120, 8192)])
def test_linear_fp8_gpu(rng, mode, m, out_f, in_f):
    x = _randn(rng, m, in_f).to(torch.bfloat16)
    got, want = run_both("linear", x, _weight(rng, "fp8_w", out_f, in_f, scale=0.05))
    assert rel_err(got, want) < 1e-3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("out_f,in_f", [(1280, 5120), (5120, 8192)])
def test_linear_bf16_gemm_gpu(rng, monkeypatch, out_f, in_f):
    monkeypatch.setitem(lin.TILES, "bf16_gemm_min_rows", 1)
    x = _randn(rng, 4096, in_f).to(torch.bfloat16)
    got, want = run_both("linear", x, _weight(rng, "fp8_w", out_f, in_f, scale=0.05))
    assert rel_err(got, want) < 1e-3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_linear_fp4_gpu(rng, m):
    x = _randn(rng, m, 5120).to(torch.bfloat16)
    got, want = run_both("linear", x, _weight(rng, "fp4_w", 2304, 5120, scale=0.05))
    assert rel_err(got, want) < 1e-3


def _random_fp4_experts(gen, E, out_f, in_f):
    data = torch.randint(0, 256, (E, out_f, in_f // 2), dtype=torch.uint8, device="cuda", generator=gen)
    scale = torch.randint(119, 123, (E, out_f, in_f // 32), dtype=torch.uint8, device="cuda", generator=gen)
    return formats.QTensor(data, scale.view(torch.float8_e8m0fnu), "fp4_w", (E, out_f, in_f))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [1, 8, 64, 4096])
def test_moe_experts_gpu(rng, n):
    """384 fp4 experts, top-6, D = 5120, I = 2304 (decode batches and a 4096-token prefill)."""
    E, D, I, k = 384, 5120, 2304, 6
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(2**31, (1,), generator=rng)))
    w1, w3, w2 = (_random_fp4_experts(gen, E, *s) for s in ((I, D), (I, D), (D, I)))
    x = torch.randn(n, D, device="cuda", generator=gen).to(torch.bfloat16)
    indices = torch.rand(n, E, device="cuda", generator=gen).topk(k).indices.to(torch.int32)
    weights = torch.rand(n, k, device="cuda", generator=gen)
    with flashrt.use_backend("cuda"):
        got = ops.moe_experts(x, weights, indices, w1, w3, w2, 10.0)
    assert rel_err(got, moe_reference_by_expert(x, weights, indices, w1, w3, w2, 10.0)) < 1e-3
    add = torch.randn(n, D, device="cuda", generator=gen)  # the shared expert's output, added in the combine
    with flashrt.use_backend("cuda"):
        assert torch.equal(ops.moe_experts(x, weights, indices, w1, w3, w2, 10.0, add, torch.bfloat16),
                           (got + add).to(torch.bfloat16))


@pytest.mark.gpu
@gpu
def test_moe_experts_cuda_graph(rng):
    """No host sync in the launcher: a captured decode step replays to the eager result."""
    E, D, I, k, n = 16, 256, 128, 6, 8
    ws = _experts(rng, "fp4_w", E, I, D)
    x = _randn(rng, n, D).to(torch.bfloat16)
    indices = torch.rand(n, E, generator=rng).topk(k).indices.to(torch.int32).to(DEVICE)
    weights = torch.rand(n, k, generator=rng).to(DEVICE)
    eager = moe.moe_experts(x, weights, indices, *ws, 10.0)  # also compiles the kernels
    assert rel_err(eager, moe_reference_by_expert(x, weights, indices, *ws, 10.0)) < 1e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_experts(x, weights, indices, *ws, 10.0)
    indices.copy_(indices.flip(0))
    x.copy_(x.flip(0))
    weights.copy_(weights.flip(0))
    graph.replay()
    assert rel_err(out, eager.flip(0)) < 1e-6  # rows are independent: same math, new order


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", list(MODES), indirect=True)
@pytest.mark.parametrize("n", [8, 4096])
def test_moe_shared_expert_fp8_gpu(rng, mode, n):
    D, I = 5120, 2304
    x = _randn(rng, n, D).to(torch.bfloat16)
    route = (torch.ones(n, 1, device=DEVICE), torch.zeros(n, 1, dtype=torch.int32, device=DEVICE))
    w = (_weight(rng, "fp8_w", 1, I, D, scale=0.05), _weight(rng, "fp8_w", 1, I, D, scale=0.05),
         _weight(rng, "fp8_w", 1, D, I, scale=0.05))
    got, want = run_both("moe_experts", x, *route, *w, 10.0)
    assert rel_err(got, want) < 5e-3  # bf16 W1/W3 outputs and fp8 re-quantization flip near ties
