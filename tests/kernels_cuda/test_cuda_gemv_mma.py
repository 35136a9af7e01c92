"""The ``gemv_mma`` knob of a ``linear`` rule (kernels_cuda/gemv_mma.py): fp8_w launches of up to 16 rows
on ``mma.sync`` with the weight rows as the MMA's M, written in Gluon.

Without a GPU: the launcher takes it only for fp8_w at up to 16 rows on a compiled sm_80+ target (not
the interpreter, not fp4_w), its plan (tokens, K split in whole loop trips, masks only where N or K
are ragged), and the kernel compiles for sm_90 with this machine's Triton: its K loop on ``HMMA`` fed by
16-byte asynchronous copies, no spill. On a GPU: against the reference and the profile's GEMV on fresh
random inputs, at 1-16 rows, ragged N and K, a K split summed in the kernel or not, fp32 and bf16
activations, and every E4M3 code and weight scale byte; with ``gemv_mma_dq`` (the activations' round trip
by a launch before, bf16 operands) up to 64 rows, the weight's scale bytes folded into the decode or not."""
from __future__ import annotations

import json

import pytest
import torch

import flashrt
from flashrt import formats, jit_targets, ops
from flashrt.jit_targets import ARCHS
from kernel_check import DEVICE, GPU, linear_three_ways, pinned_tiles, rel_err, requires_kernels, sm90_compile

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
gm = pytest.importorskip("flashrt.kernels_cuda.gemv_mma")
needs_gluon = pytest.mark.skipif(not gm.AVAILABLE, reason="a Triton without Gluon")
MMA_GPU = GPU and torch.cuda.get_device_capability() >= (8, 0)


def _rule(rows=16, warps=4, **knobs):
    return [rows, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=warps, num_stages=3, gemv_mma=True, **knobs)]


def _mma_rule(rows=None):
    return [rows, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)]


def _plan(m, n, k, fmt="fp8_w", arch="sm_90", monkeypatch=None, **tiles):
    monkeypatch.setattr(lin, "INTERPRETED", False)
    with pinned_tiles(linear=dict(linear=[_rule(**tiles), _mma_rule()])), jit_targets.targeting(ARCHS[arch]):
        return lin._linear_plan(m, n, k, torch.bfloat16, fmt)


@needs_gluon
def test_the_launcher_takes_it_for_fp8_w_at_up_to_16_rows(monkeypatch):
    p = _plan(3, 1792, 5120, monkeypatch=monkeypatch)
    assert p.get("gemv_mma") and p["constexprs"]["TOKENS"] == 8 and p["constexprs"]["EVEN"]
    assert _plan(9, 1792, 5120, monkeypatch=monkeypatch)["constexprs"]["TOKENS"] == 16
    assert not _plan(17, 1792, 5120, monkeypatch=monkeypatch).get("gemv_mma")  # past 16 rows: the MMA rule
    assert not _plan(3, 1792, 5120, fmt="fp4_w", monkeypatch=monkeypatch).get("gemv_mma")
    # from gemv_mma_min_weights weight elements only: a smaller weight takes the rule's other knobs
    assert _plan(3, 1792, 5120, monkeypatch=monkeypatch, gemv_mma_min_weights=1792 * 5120).get("gemv_mma")
    assert not _plan(3, 1792, 5120, monkeypatch=monkeypatch, gemv_mma_min_weights=1792 * 5120 + 1).get("gemv_mma")
    monkeypatch.setattr(lin, "INTERPRETED", True)  # the interpreter does not run Gluon
    with pinned_tiles(linear=dict(linear=[_rule(), _mma_rule()])), jit_targets.targeting(ARCHS["sm_90"]):
        assert not lin._linear_plan(3, 1792, 5120, torch.bfloat16, "fp8_w").get("gemv_mma")


@needs_gluon
def test_with_the_round_trip_first_it_takes_up_to_64_rows(monkeypatch):
    """``gemv_mma_dq``: the plan is dq and the MMA's N the least of 8, 16, 32, 64 that holds the rows; past
    64 rows the rule's other path; without the knob 16 rows stay the limit."""
    for m, tokens in ((1, 8), (9, 16), (17, 32), (33, 64), (64, 64)):
        p = _plan(m, 1792, 5120, monkeypatch=monkeypatch, rows=64, gemv_mma_dq=True)
        assert p.get("gemv_mma") and p["dq"] and p["constexprs"]["TOKENS"] == tokens
    assert not _plan(65, 1792, 5120, monkeypatch=monkeypatch, rows=None, gemv_mma_dq=True).get("gemv_mma")
    assert not _plan(17, 1792, 5120, monkeypatch=monkeypatch, rows=64).get("gemv_mma")
    assert not _plan(3, 1792, 5120, monkeypatch=monkeypatch)["dq"]
    with pytest.raises(AssertionError):
        gm.plan(17, 64, 64, torch.bfloat16, {}, 132)  # past 16 rows only over the round trip's values


@pytest.mark.parametrize("n,k,per_sm", [(1792, 5120, 8), (72, 352, 8), (1024, 512, 16), (64, 4096, 1),
                                         (32768, 1280, 8)])
def test_the_plan_splits_k_in_whole_slices(n, k, per_sm):
    """The splits cover K in runs of whole 32-wide slices, at least MIN_SLICES each where K has that
    many, and bring the programs near ``per_sm`` an SM (never fewer than one split a tile); EVEN only
    where N needs no mask."""
    p = gm.plan(1, n, k, torch.bfloat16, dict(num_warps=4, per_sm=per_sm), 132)
    tiles, split = p["grid"]
    assert tiles == -(-n // 64) and p["k_split"] % 32 == 0
    assert (split - 1) * p["k_split"] < k <= split * p["k_split"]
    assert p["k_split"] >= min(k, 32 * gm.MIN_SLICES)
    assert tiles * split <= max(132 * per_sm, tiles)
    if tiles * 2 * split <= 132 * per_sm:  # room left: only the slice minimum stopped the split
        assert p["k_split"] <= 32 * gm.MIN_SLICES
    assert p["constexprs"]["EVEN"] == (n % 64 == 0)
    assert p["reduce"] == (split > 1) and p["out_dtype"] == torch.bfloat16


def test_the_operands_take_kw_8_only_where_the_triton_accepts_it(monkeypatch):
    monkeypatch.setattr(gm.triton, "__version__", "3.6.0")
    assert gm.operand_kw(8) == 8 and gm.operand_kw(4) == 4
    monkeypatch.setattr(gm.triton, "__version__", "3.9.0")
    assert gm.operand_kw(8) == 4 and gm.operand_kw(4) == 4


@needs_gluon
@pytest.mark.parametrize("kw,sub", [(4, 4), (8, 4), (8, 1)])
def test_it_compiles_for_sm90_on_mma_sync_fed_by_asynchronous_copies(kw, sub):
    tiles = {"linear": [_rule(gemv_mma_kw=kw, gemv_mma_sub=sub), _mma_rule()]}
    reports = sm90_compile("linear", "--B", "4", "--S", "1", "--tiles", json.dumps(tiles))
    r = next(r for r in reports if r["kernel"] == "_mma_gemv_kernel")
    assert r["stack_bytes"] == 0 and r["registers"] <= 128
    loop = r["mma_loop"]
    # a ring slot of `sub` K slices a trip: two m16n8k16 MMAs a slice (K 32), no warpgroup MMA
    assert loop["count"] == 2 * sub and r["sass"]["HGMMA"] == 0 and r["sass"]["QGMMA"] == 0
    assert r["global_loads"].get("LDGSTS.E.BYPASS.128", 0) > 0  # the copies: 16 bytes each
    # each slice: the weights, the activations quantized, the MMAs; each trip: its copies and barriers
    assert loop["instructions"] < 110 * sub + 60
    # it waits for the kernel before it (programmatic dependent launch) before its first copy or load
    ptx = [line.split(";")[0] for line in open(r["dump"] + ".ptx").read().splitlines()]
    first = lambda word: next(i for i, line in enumerate(ptx) if word in line)  # noqa: E731
    assert first("griddepcontrol.wait") < min(first("cp.async"), first("ld.global"))


@needs_gluon
@pytest.mark.skipif(gm.operand_kw(8) != 8, reason="this Triton refuses 8 consecutive K elements a thread")
@pytest.mark.parametrize("rows", [4, 32, 64])
def test_over_the_round_trip_each_slice_is_the_decode_and_the_mmas(rows):
    """With ``gemv_mma_dq`` the K loop quantizes nothing: a slice is its 16 weight bytes a thread decoded (4
    instructions a register of two values: the weights' scale bytes recorded, so the re-bias folds), its
    scale, the activations' shared loads and 2 x TOKENS / 8 MMAs; no stack."""
    tiles = {"linear": [_rule(rows=64, gemv_mma_kw=8, gemv_mma_dq=True), _mma_rule()]}
    reports = sm90_compile("linear", "--B", str(rows), "--S", "1", "--tiles", json.dumps(tiles))
    r = next(r for r in reports if r["kernel"] == "_mma_gemv_kernel")
    assert r["stack_bytes"] == 0 and r["registers"] <= 168
    loop = r["mma_loop"]
    mmas = 2 * gm.tokens_for(rows) // 8
    assert loop["count"] == 4 * mmas and r["sass"]["HGMMA"] == 0
    assert loop["opcodes"].get("HMUL2", 0) == 4 * 8  # one multiply a register: the scale with the re-bias
    assert loop["instructions"] < 4 * (8 * 4 + mmas + 12 * gm.tokens_for(rows) // 8 + 12) + 60


def _inputs(g, m, n, k, dtype=torch.float32):
    x = (torch.randn(m, k, generator=g) * 2.0).to(DEVICE, dtype)
    w = formats.quantize(torch.randn(n, k, generator=g) * 0.25, "fp8_w").to(DEVICE)
    return x, w


@pytest.mark.gpu
@pytest.mark.skipif(not (MMA_GPU and gm.AVAILABLE), reason="needs an sm_80+ GPU and Gluon")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,per_sm", [(1, 128, 512, 8), (3, 72, 352, 8), (8, 192, 1024, 8), (9, 256, 640, 8),
                                          (16, 64, 4096, 8), (5, 1792, 5120, 8), (4, 8192, 256, 1)])
def test_against_the_reference_and_the_mma_rule(rng, dtype, m, n, k, per_sm):
    """Ragged N (72) and K (352: a split's last slot short), 1-16 rows, K split summed in the kernel, and
    one split (8,192 rows at one program an SM)."""
    x, w = _inputs(rng, m, n, k, dtype)
    plan = _check_three_ways(x, w, _rule(gemv_mma_per_sm=per_sm))
    assert (plan["split"] == 1) == (per_sm == 1) and not plan["dq"]


def _check_three_ways(x, w, rule) -> dict:
    """The rule's launch of ``x`` and ``w`` (on the kernel: its plan returned) against the reference and the
    plain MMA rule: fp32 activations at 1e-5, bf16 at 1e-2."""
    m, k = x.shape
    with pinned_tiles(linear=dict(linear=[rule, _mma_rule()])):
        plan = lin._linear_plan(m, w.shape[0], k, x.dtype, "fp8_w")
    assert plan.get("gemv_mma")
    got, dot, want = linear_three_ways(x, w, dict(linear=[rule, _mma_rule()]), dict(linear=[_mma_rule()]))
    assert got.dtype == x.dtype and got.shape == (m, w.shape[0])
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    assert rel_err(got, want) < tol and rel_err(got, dot) < tol
    return plan


@pytest.mark.gpu
@pytest.mark.skipif(not (MMA_GPU and gm.AVAILABLE), reason="needs an sm_80+ GPU and Gluon")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,per_sm,fold", [(1, 128, 512, 8, True), (3, 72, 352, 8, False),
                                               (17, 192, 1024, 8, True), (33, 256, 640, 8, False),
                                               (64, 1792, 5120, 8, True), (40, 8192, 256, 1, True)])
def test_over_the_round_trip_against_the_reference(rng, dtype, m, n, k, per_sm, fold):
    """``gemv_mma_dq``: ragged N and K, 1-64 rows, a K split summed in the kernel or one split, the scales'
    re-bias folded (a scale_max recorded at most 134) or multiplied apart, fp32 and bf16 activations:
    the reference's values and the plain MMA rule's."""
    x, w = _inputs(rng, m, n, k, dtype)
    if fold:
        w = formats.with_scale_max(w)
        assert w.scale_max <= 134
    plan = _check_three_ways(x, w, _rule(rows=64, gemv_mma_per_sm=per_sm, gemv_mma_dq=True))
    assert plan["dq"] and (plan["split"] == 1) == (per_sm == 1)


@pytest.mark.gpu
@pytest.mark.skipif(not (MMA_GPU and gm.AVAILABLE), reason="needs an sm_80+ GPU and Gluon")
@pytest.mark.parametrize("dq", [False, True])
def test_every_code_and_weight_scale_byte(rng, dq):
    """Each of the 256 E4M3 codes but the two NaN ones (a load refuses them) and weight scale bytes from
    2**-127 up, against the reference's dequantized product."""
    n, k = 64, 256 * 4
    codes = torch.arange(256, dtype=torch.uint8).repeat(n, 4)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    scale = torch.randint(0, 140, (n // 32, k // 32), generator=rng, dtype=torch.uint8)
    scale[0, 0] = 0
    w = formats.QTensor(codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu), "fp8_w", (n, k)).to(DEVICE)
    x = torch.randn(2, k, generator=rng).to(DEVICE)
    with pinned_tiles(linear=dict(linear=[_rule(gemv_mma_dq=dq), _mma_rule()])), flashrt.use_backend("cuda"):
        got = ops.linear(x, w)
    with flashrt.use_backend("reference"):
        want = ops.linear(x, w)
    assert rel_err(got, want) < 1e-5
