"""The ``qgmma`` knob of a linear rule (kernels_cuda/linear_qgmma.py): fp8_w ``linear`` over many rows on the fp8
warpgroup MMA, both operands streamed from shared memory, written in Gluon.

Without a GPU: the launcher takes it only where the knob is on, the target is a compiled sm_90 one and the
shape is whole trips and programs (else the rule's MMA tile), over the bf16 GEMM tile; it compiles for
sm_90 on ``QGMMA`` without spills, one K loop of four MMAs, the scales applied in fp32 (the weight
tile's scale shared by a thread's rows). On an sm_90 GPU: against the reference and the rule's MMA tile
on fresh random inputs: rows that fill no tile or several (a partial last one), 4 and 8 warps, 32-128
rows a program, rings of 2-4 trips, bf16 and fp32 x, scales row or K major, one or two MMAs in flight (with a
register cap); and at a decode step's few rows with K split over programs (``qgmma_per_sm``), the
splits summed by each output tile's last program, the warpgroups over the rows or side by side over the
tokens (``qgmma_token_groups``)."""
from __future__ import annotations

import json

import pytest
import torch

from flashrt import formats, jit_targets
from flashrt.jit_targets import ARCHS
from kernel_check import (DEVICE, GPU, linear_three_ways, pinned_tiles, qgmma_knobs, rel_err, requires_kernels,
                          sm90_compile)

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
lq = pytest.importorskip("flashrt.kernels_cuda.linear_qgmma")
QG_GPU = GPU and torch.cuda.get_device_capability() >= (9, 0) and lq.AVAILABLE


def _tiles(tokens=64, warps=8, stages=3, on=True, inflight=2, maxnreg=None, **linear_tiles):
    big = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3,
               **qgmma_knobs(on, tokens, warps, stages, inflight, maxnreg))
    return {"linear": [[16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)], [None, big]],
            **linear_tiles}


def _decode_tiles(warps=4, per_sm=2, stages=3, tokens=64, on=True, min_weights=None, groups=1):
    """Rules with every launch of up to 64 rows (of weights from ``min_weights`` elements) on the streamed
    launches, K split to ``per_sm`` programs an SM, the warpgroups in ``groups`` over the tokens."""
    rule = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, qgmma_per_sm=per_sm,
                qgmma_min_weights=min_weights, **qgmma_knobs(on, tokens, warps, stages, qgmma_token_groups=groups))
    return {"linear": [[64, rule], [None, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)]]}


def _plan(monkeypatch, m=4096, n=5120, k=8192, arch="sm_90", tiles=None, **knobs):
    monkeypatch.setattr(lin, "INTERPRETED", False)
    with pinned_tiles(linear=tiles or _tiles(**knobs)), jit_targets.targeting(ARCHS[arch]):
        return lin._linear_plan(m, n, k, torch.bfloat16, "fp8_w")


@pytest.mark.skipif(not lq.AVAILABLE, reason="needs Gluon")
def test_the_launcher_takes_it_where_it_can_run(monkeypatch):
    p = _plan(monkeypatch)
    assert p.get("qgmma") and not p["bf16_gemm"] and p["grid"] == (4096 // 64 * (5120 // 128), 1)
    assert p["split"] == 1 and not p["reduce"] and p["k_split"] == 8192 and "REDUCE" not in p["constexprs"]
    assert p["constexprs"]["TOKENS"] == 64 and p["constexprs"]["num_warps"] == 8 and p["constexprs"]["INFLIGHT"] == 2
    assert "maxnreg" not in p["constexprs"]
    capped = _plan(monkeypatch, inflight=1, maxnreg=128)["constexprs"]
    assert capped["INFLIGHT"] == 1 and capped["maxnreg"] == 128
    assert _plan(monkeypatch, bf16_gemm_min_rows=1024).get("qgmma")  # over the bf16 GEMM tile
    assert _plan(monkeypatch, m=100, tokens=32, warps=4)["grid"] == (4 * (5120 // 64), 1)
    assert not _plan(monkeypatch, on=False).get("qgmma")
    assert not _plan(monkeypatch, k=8192 + 32).get("qgmma")  # K not whole trips of 128
    assert not _plan(monkeypatch, n=5120 + 64).get("qgmma")  # N not whole 128-row programs
    assert not _plan(monkeypatch, arch="sm_89").get("qgmma") and not _plan(monkeypatch, arch="sm_80").get("qgmma")
    monkeypatch.setattr(lin, "INTERPRETED", True)  # the interpreter does not run Gluon
    with pinned_tiles(linear=_tiles()), jit_targets.targeting(ARCHS["sm_90"]):
        assert not lin._linear_plan(4096, 5120, 8192, torch.bfloat16, "fp8_w").get("qgmma")
    monkeypatch.setattr(lin, "INTERPRETED", False)
    with pinned_tiles(linear=_tiles()), jit_targets.targeting(ARCHS["sm_90"]):  # fp4_w keeps the MMA tile
        assert not lin._linear_plan(4096, 5120, 8192, torch.bfloat16, "fp4_w").get("qgmma")


@pytest.mark.skipif(not lq.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("m", [2, 3, 8])
def test_a_rule_with_other_launches_tries_it_first(monkeypatch, m):
    """The h200 profile's 2-row and 3-8-row rules: the released projections (from 8M weight elements) take the
    streamed launch before the rule's GEMV / ``gemv_mma``; a weight it declines (N not whole programs) goes on to
    those, a smaller one too (2 rows) or to the MMA tile (3-8 rows, under ``gemv_mma_min_weights``)."""
    from flashrt import profiles

    monkeypatch.setattr(lin, "INTERPRETED", False)
    other = "gemv" if m == 2 else "gemv_mma"
    with profiles.using("h200"), jit_targets.targeting(ARCHS["sm_90"]):
        for n, k, path in ((32768, 1280, "qgmma"), (5120, 8192, "qgmma"), (1792, 5120, "qgmma"),
                           (5120 + 32, 8192, other), (1024, 4096, "gemv" if m == 2 else "tile")):
            plan = lin._linear_plan(m, n, k, torch.bfloat16, "fp8_w")
            assert lin._path(plan) == path, (m, n, k, lin._path(plan))
            if path == "qgmma":  # 4 warps; K split where the output tiles are few (28 or 80; wq_b's 512 are not)
                assert plan["constexprs"]["num_warps"] == 4 and (plan["split"] > 1) == (n < 32768), plan


@pytest.mark.skipif(not lq.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("m,n,k,warps,per_sm,groups", [(16, 5120, 8192, 4, 2, 1), (64, 1792, 5120, 8, 3, 1),
                                                       (3, 32768, 1536, 4, 2, 1), (40, 256, 640, 4, 4, 1),
                                                       (64, 5120, 8192, 8, 2, 2), (24, 1792, 5120, 8, 3, 2)])
def test_a_decode_launch_splits_k_to_its_programs_an_sm(monkeypatch, m, n, k, warps, per_sm, groups):
    """The rows a program are the least power of two from 16 holding the launch's; K goes in whole trips of
    128 to about ``per_sm`` programs an SM (132 SMs here), no split empty, summed in the kernel. Two token
    groups: 8 warps over 64 weight rows (4 warps cannot split)."""
    monkeypatch.setattr(lin, "num_sms", lambda: 132)
    p = _plan(monkeypatch, m, n, k, tiles=_decode_tiles(warps, per_sm, groups=groups))
    assert p.get("qgmma") and p["constexprs"].get("TOKEN_GROUPS", 1) == groups
    if groups == 2:
        assert not _plan(monkeypatch, m, n, k, tiles=_decode_tiles(4, per_sm, groups=2)).get("qgmma")
    tokens = p["constexprs"]["TOKENS"]
    assert tokens == max(16, 1 << (m - 1).bit_length())
    tiles = -(-m // tokens) * (n // (16 * warps // groups))
    trips = k // 128
    assert p["grid"] == (tiles, p["split"]) and p["k_split"] % 128 == 0
    assert (p["split"] - 1) * p["k_split"] < k <= p["split"] * p["k_split"]  # every split holds K, none empty
    assert p["split"] <= max(1, 132 * per_sm // tiles) and p["split"] <= trips
    if tiles * 2 <= 132 * per_sm:  # room for two splits a tile: K is split (a trip a split at least)
        assert p["split"] >= min(trips, 132 * per_sm // tiles) // 2
    assert p["reduce"] == (p["split"] > 1) == ("REDUCE" in p["constexprs"])
    assert not _plan(monkeypatch, m, n, k, tiles=_decode_tiles(warps, None, groups=groups))["reduce"]
    # from qgmma_min_weights weight elements only: a smaller weight takes the rule's MMA tile
    at_least = lambda w: _plan(monkeypatch, m, n, k, tiles=_decode_tiles(warps, per_sm, min_weights=w, groups=groups))
    assert at_least(n * k).get("qgmma") and not at_least(n * k + 1).get("qgmma")


@pytest.mark.skipif(not lq.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("tokens,warps,capped", [(64, 8, False), (32, 4, False), (64, 8, True)])
def test_it_compiles_for_sm90_on_the_fp8_warpgroup_mma(tokens, warps, capped):
    """Capped: one MMA in flight and 128 registers a thread (two programs of 8 warps an SM)."""
    knobs = dict(inflight=1, maxnreg=128) if capped else {}
    r = next(r for r in sm90_compile("linear", "--B", "4096", "--tiles", json.dumps(_tiles(tokens, warps, **knobs)))
             if r["kernel"] == "_kernel")
    assert r["sass"]["HMMA"] == 0 and r["sass"]["QGMMA"] == 4
    assert r["registers"] <= 128 if capped else r["stack_bytes"] == 0
    loop = r["mma_loop"]
    assert "LDL" not in loop["opcodes"] and "STL" not in loop["opcodes"]
    assert [lp["count"] for lp in loop["loops"]] == [4]
    # a block's product scaled: an add a thread's accumulator element (tokens / 2), a multiply a token
    # (its rows share the weight tile's scale)
    assert loop["opcodes"]["FFMA"] == 4 * tokens // 2 and loop["opcodes"]["FMUL"] == 4 * tokens // 4
    assert loop["instructions"] < 4 * tokens + 120


@pytest.mark.skipif(not lq.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("rows,groups", [(16, 1), (64, 1), (32, 2), (64, 2)])
def test_the_decode_launch_compiles_for_sm90(rows, groups):
    """K split, the splits' meeting in the kernel: the same K loop as the prefill launch (four fp8 MMAs a
    trip, no spill), its scaling by the rows a program; two token groups (8 warps over one 64-row weight
    tile) halve a thread's accumulator and its scaling, and its registers against one group's 4 warps."""
    compile_ = lambda g: next(r for r in sm90_compile("linear", "--B", str(rows), "--tiles",
                                                      json.dumps(_decode_tiles(4 * g, groups=g)))
                              if r["kernel"] == "_kernel")
    r = compile_(groups)
    assert r["sass"]["HMMA"] == 0 and r["sass"]["QGMMA"] == 4 and r["stack_bytes"] == 0
    loop = r["mma_loop"]
    assert "LDL" not in loop["opcodes"] and "STL" not in loop["opcodes"]
    assert [lp["count"] for lp in loop["loops"]] == [4]
    assert loop["opcodes"]["FFMA"] == 4 * rows // 2 // groups and loop["opcodes"]["FMUL"] == 4 * rows // 4 // groups
    assert loop["instructions"] < 4 * rows // groups + 130  # the scaling, the copies and the ring's book-keeping
    assert r["sass"]["ATOMG"] >= 1  # the splits' ticket
    if groups == 2:
        assert r["registers"] < compile_(1)["registers"]


def _case(rng, m, n, k, dtype=torch.bfloat16, k_major=False):
    x = (torch.randn(m, k, generator=rng) * 3.0).to(DEVICE, dtype)
    w = formats.quantize(torch.randn(n, k, generator=rng) * 0.05, "fp8_w").to(DEVICE)
    if k_major:
        w = formats.QTensor(w.data, w.scale.t().contiguous().t(), w.fmt, w.shape)
    return x, w


# (rows, out, in, rows a program, warps, ring stages, x dtype, scales K major, MMAs in flight and register cap)
CASES = [(100, 256, 512, 64, 8, 3, torch.bfloat16, False, (2, None)),
         (23, 128, 256, 32, 4, 2, torch.bfloat16, False, (2, None)),
         (300, 384, 1024, 128, 8, 4, torch.bfloat16, True, (2, None)),
         (64, 512, 384, 64, 4, 3, torch.float32, False, (2, None)),
         (200, 256, 640, 64, 8, 3, torch.bfloat16, False, (1, 128))]


@pytest.mark.gpu
@pytest.mark.skipif(not QG_GPU, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("m,n,k,tokens,warps,stages,dtype,k_major,flight", CASES)
def test_against_the_reference_and_the_mma_tile(rng, m, n, k, tokens, warps, stages, dtype, k_major, flight):
    x, w = _case(rng, m, n, k, dtype, k_major)
    tiles = _tiles(tokens, warps, stages, inflight=flight[0], maxnreg=flight[1])
    with pinned_tiles(linear=tiles):
        assert lin._linear_plan(m, n, k, dtype, "fp8_w").get("qgmma")
    got, other, want = linear_three_ways(x, w, tiles, _tiles(on=False))
    assert got.dtype == dtype and got.shape == (m, n)
    assert rel_err(got.float(), want.float()) < 5e-3 and rel_err(got.float(), other.float()) < 5e-3


# (rows, out, in, warps, programs an SM, ring stages): K split into 1-trip to many-trip runs, rows under and
# over a program's 16, a last split shorter than the others
# (and two token groups: 8 warps over 64 weight rows, at 17-64 rows and at a 16-row program's 8 a group)
DECODE_CASES = [(1, 256, 1024, 4, 4, 3, 1), (16, 512, 2048, 4, 2, 3, 1), (9, 384, 1280, 4, 8, 2, 1),
                (64, 256, 1536, 8, 2, 4, 1), (37, 1024, 640, 4, 3, 3, 1), (64, 512, 1536, 8, 2, 3, 2),
                (37, 320, 1024, 8, 3, 2, 2), (12, 256, 640, 8, 4, 3, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not QG_GPU, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("m,n,k,warps,per_sm,stages,groups", DECODE_CASES)
def test_decode_rows_with_k_split_against_the_reference_and_the_mma_tile(rng, m, n, k, warps, per_sm, stages,
                                                                          groups):
    x, w = _case(rng, m, n, k)
    tiles = _decode_tiles(warps, per_sm, stages, groups=groups)
    with pinned_tiles(linear=tiles):
        assert lin._linear_plan(m, n, k, torch.bfloat16, "fp8_w").get("qgmma")
    got, other, want = linear_three_ways(x, w, tiles, _decode_tiles(on=False))  # counters back at zero
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert rel_err(got.float(), want.float()) < 5e-3 and rel_err(got.float(), other.float()) < 5e-3
