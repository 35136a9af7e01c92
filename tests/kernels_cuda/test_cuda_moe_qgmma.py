"""The ``qgmma`` knob of an experts rule (kernels_cuda/moe_qgmma.py): routed fp4_w experts on the fp8 warpgroup
MMA with the weights as its register operand, written in Gluon.

Without a GPU: the launcher takes it only where the knob is on, the activations are dequantized and the
target is a compiled sm_90 one; the weights must be fp4_w in the standard nibbles with K a multiple of 128;
its plan splits K in multiples of 128 within the counters; with this Triton the kernels compile for sm_90
on ``QGMMA`` without spills. On an sm_90 GPU: against the reference and the 16-row tile's path on fresh
random inputs: one token (a row tile a pair), routing tables (a token's slots may repeat), a K split met in
the kernel or not, scales row or K major, the shared expert and ``add``, 8 and 16 rows a tile."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import flashrt
from flashrt import formats, jit_targets, ops
from flashrt.jit_targets import ARCHS
from kernel_check import (DEVICE, GPU, assert_counters_zero, assert_moe_path_matches, moe_case, pinned_tiles, rel_err,
                          requires_kernels, run_moe, sm90_compile)

pytestmark = requires_kernels
moe = pytest.importorskip("flashrt.kernels_cuda.moe")
mq = pytest.importorskip("flashrt.kernels_cuda.moe_qgmma")
mm = pytest.importorskip("flashrt.kernels_cuda.moe_mma")
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
QG_GPU = GPU and torch.cuda.get_device_capability() >= (9, 0) and mq.AVAILABLE


def _tiles(per_sm=4, tokens=8, stages=4, on=True, max_k=2048, **moe_tiles):
    rule = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, qgmma=on, qgmma_per_sm=per_sm,
                qgmma_tokens=tokens, qgmma_stages=stages, qgmma_max_k=max_k)
    return {"experts": [[16, rule], [None, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)]],
            "act_dequantized": True, **moe_tiles}


def _plan(monkeypatch, n=1, k=6, E=8, D=5120, I=2304, arch="sm_90", **tiles):
    monkeypatch.setattr(lin, "INTERPRETED", False)
    with pinned_tiles(moe=_tiles(**tiles)), jit_targets.targeting(ARCHS[arch]):
        return moe._plan(n, k, E, D, I, False)


@pytest.mark.skipif(not mq.AVAILABLE, reason="needs Gluon")
def test_the_launcher_takes_it_where_it_can_run(monkeypatch):
    p = _plan(monkeypatch)["qgmma"]
    assert p["pairs"] and p["row_tiles"] == 6 and p["up"]["constexprs"]["TOKENS"] == 8
    t = _plan(monkeypatch, n=8, tokens=16)["qgmma"]  # past pair_tiles: the routing tables' tiles of TOKENS rows
    assert not t["pairs"] and t["block_m"] == 16 and t["row_tiles"] == min(48, 3 + 8)
    assert _plan(monkeypatch, on=False)["qgmma"] is None
    assert _plan(monkeypatch, act_dequantized=False)["qgmma"] is None
    assert _plan(monkeypatch, k=1, E=1)["qgmma"] is None  # the direct path (the shared expert alone)
    assert _plan(monkeypatch, arch="sm_80")["qgmma"] is None and _plan(monkeypatch, arch="sm_89")["qgmma"] is None
    monkeypatch.setattr(lin, "INTERPRETED", True)  # the interpreter does not run Gluon
    with pinned_tiles(moe=_tiles()), jit_targets.targeting(ARCHS["sm_90"]):
        assert moe._plan(1, 6, 8, 5120, 2304)["qgmma"] is None


@pytest.mark.skipif(not mq.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("n,E,D,I,per_sm,max_k", [(1, 8, 5120, 2304, 4, 2048), (8, 64, 1024, 512, 4, 1024),
                                                  (1, 8, 384, 256, 64, 2048), (64, 384, 4096, 2048, 1, 2048),
                                                  (3, 16, 7168, 2048, 8, 1024), (8, 384, 5120, 2304, 16, 1024),
                                                  (8, 64, 4096, 2048, 4, 512)])
def test_the_plan_splits_k_in_multiples_of_128(monkeypatch, n, E, D, I, per_sm, max_k):
    p = _plan(monkeypatch, n=n, E=E, D=D, I=I, per_sm=per_sm, max_k=max_k)["qgmma"]
    with jit_targets.targeting(ARCHS["sm_90"]):
        sms = lin.num_sms()
    for launch, K, cols in (("up", D, I), ("down", I, D)):
        g = p[launch]
        assert g["k_split"] % 128 == 0 and g["k_split"] <= max_k
        assert (g["split"] - 1) * g["k_split"] < K <= g["split"] * g["k_split"]
        assert g["split"] * g["k_split"] - K < 128 * g["split"]  # the last split short by under 128 a split
        assert g["constexprs"]["SPLIT"] == (g["split"] > 1) and g["constexprs"]["K_SPLIT"] == g["k_split"]
        assert g["grid_cols"] == cols // 64
        # no more splits than bring the programs to per_sm an SM, unless a program's K reached its limit
        programs = g["grid_cols"] * p["row_tiles"]
        assert g["split"] <= max(1, per_sm * sms // programs, -(-K // max_k))


@pytest.mark.skipif(not mq.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("n,tokens", [(1, 8), (6, 8), (20, 16)])
def test_the_shared_experts_tiles_follow_the_routed_ones(monkeypatch, n, tokens):
    """With the shared expert, the launches' row tiles are the routed ones and then one a ``TOKENS`` tokens,
    and the K split and the combine's counters count them; the routed-only plan is kept beside it (the
    weights decide per call)."""
    monkeypatch.setattr(lin, "INTERPRETED", False)
    with pinned_tiles(moe=_tiles(tokens=tokens)), jit_targets.targeting(ARCHS["sm_90"]):
        both = moe._plan(n, 6, 8, 5120, 2304, True)
        sms = lin.num_sms()
    alone, p = both["qgmma"], both["qgmma_shared"]
    assert not alone["shared"] and alone["grid_rows"] == alone["row_tiles"]
    assert _plan(monkeypatch, n=n, tokens=tokens)["qgmma_shared"] is None
    assert p["shared"] and p["row_tiles"] == alone["row_tiles"] and p["grid_rows"] == p["row_tiles"] + -(-n // tokens)
    for launch in ("up", "down"):  # the K split aims at per_sm (4) programs an SM over every row tile
        programs = p[launch]["grid_cols"] * p["grid_rows"]
        assert p[launch]["split"] <= max(1, 4 * sms // programs, -(-5120 // 2048))


def _stack(rng, E, rows, K, words=False, k_major=False, scale=0.25):
    w = formats.quantize(torch.randn(E, rows, K, generator=rng) * scale, "fp4_w")
    return formats.as_expert_stack(w, k_major, words)


def test_it_takes_fp4_nibbles_whose_k_is_a_multiple_of_128(rng):
    ws = [_stack(rng, 2, 128, 256), _stack(rng, 2, 128, 256), _stack(rng, 2, 256, 128)]
    assert mq.supports(*ws, 256, 128)
    k_major = [_stack(rng, 2, 128, 256, k_major=True), _stack(rng, 2, 128, 256, k_major=True),
               _stack(rng, 2, 256, 128, k_major=True)]
    assert mq.supports(*k_major, 256, 128)
    assert not mq.supports(_stack(rng, 2, 128, 256, words=True), *ws[1:], 256, 128)  # the word layout
    assert not mq.supports(k_major[0], *ws[1:], 256, 128)  # w1 and w3 laid out apart
    odd = [_stack(rng, 2, 128, 224), _stack(rng, 2, 128, 224), _stack(rng, 2, 224, 128)]
    assert not mq.supports(*odd, 224, 128)  # K of 224: not four blocks a trip
    strided = dataclasses.replace(ws[0], scale=ws[0].scale.repeat(1, 1, 2)[:, :, ::2])  # rows of every other byte
    assert not mq.supports(strided, strided, ws[2], 256, 128)
    fp8 = formats.as_expert_stack(formats.quantize(torch.randn(2, 128, 256, generator=rng), "fp8_w"), False)
    assert not mq.supports(fp8, *ws[1:], 256, 128)


@pytest.mark.skipif(not mq.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("k_major,shared", [(False, False), (True, False), (False, True)])
def test_it_compiles_for_sm90_on_the_fp8_warpgroup_mma(k_major, shared):
    tiles = {"experts": _tiles()["experts"], "act_dequantized": True}
    args = ["moe", "--B", "1", "--moe-dims", "released", "--tiles", json.dumps(tiles), "--profile-set",
            "expert_fp4=nibbles"]
    reports = sm90_compile(*args, *(["--cold"] if k_major else []), *(["--moe-shared"] if shared else []))
    names = [r["kernel"] for r in reports]
    assert "_fp8_codes_kernel" in names
    for name, weights in (("_up_kernel", 2), ("_down_kernel", 1)):
        r = next(r for r in reports if r["kernel"] == name and r["sass"]["QGMMA"])
        assert r["stack_bytes"] == 0 and r["registers"] <= 128 and r["sass"]["HMMA"] == 0
        # a trip of four K blocks a weight: four wgmma, 8 words a thread decoded in 7 instructions each, the
        # blocks' scales applied in fp32 and the ring's copies and barriers
        assert max(lp["instructions"] for lp in r["mma_loop"]["loops"] if lp["count"] == 4) < 200
        # with the shared expert, its fp8 loops: one wgmma a K block, the bytes as they are (no decode)
        fp8 = [lp["instructions"] for lp in r["mma_loop"]["loops"] if lp["count"] == 1]
        assert len(fp8) == (weights if shared else 0) and all(i < 48 for i in fp8)


def _case(rng, n, D, I, E, k, xdt=torch.bfloat16, k_major=False):
    return moe_case(rng, n, D, I, E, k, lambda e, rows, K: _stack(rng, e, rows, K, k_major=k_major), xdt)


# (tokens, D, I, experts, slots, K split aiming at that many programs an SM, tokens a tile, ring stages, K major)
CASES = [(1, 256, 128, 8, 6, 4, 8, 4, False), (1, 384, 256, 4, 2, 64, 8, 0, False),
         (8, 512, 256, 16, 6, 4, 8, 4, True), (5, 384, 128, 3, 4, 1, 16, 2, False),
         (3, 1024, 2304, 12, 6, 16, 8, 4, True), (16, 256, 128, 4, 3, 4, 16, 3, False),
         (2, 5120, 256, 8, 6, 4, 8, 4, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not QG_GPU, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("n,D,I,E,k,per_sm,tokens,stages,k_major", CASES)
def test_against_the_reference_and_the_16_row_tile(rng, n, D, I, E, k, per_sm, tokens, stages, k_major):
    """Pairs and tables, split and not (a split's last part short: K 384 in 256s), the weights through the
    ring or loaded where used, scales row and K major, 8 and 16 rows a tile."""
    args = _case(rng, n, D, I, E, k, k_major=k_major)
    tiles = _tiles(per_sm=per_sm, tokens=tokens, stages=stages)
    with pinned_tiles(moe=tiles):
        assert moe._plan(n, k, E, D, I)["qgmma"] is not None
    assert_moe_path_matches(args, tiles, _tiles(on=False))


@pytest.mark.gpu
@pytest.mark.skipif(not QG_GPU, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("n,in_kernel,k_major,fold", [(1, True, False, True), (6, True, True, True),
                                                      (6, False, False, True), (20, True, False, True),
                                                      (6, True, False, False)])
def test_with_the_shared_expert_and_add(rng, n, in_kernel, k_major, fold):
    """The shared expert (fp8_w): its rows in the routed launches (its E4M3 bytes the MMA's operand as they
    are; pairs and tables, the combine in the down kernel or its own launch, scales row or K major), or
    where :func:`.moe_mma.shared_operands` refuses it (scale bytes past 134) on the direct path over x's round
    trip; its row and ``add`` summed after the routed rows; bf16 out."""
    D, I, E, k = 256, 128, 8, 6
    args = _case(rng, n, D, I, E, k, k_major=k_major)
    shared = tuple(formats.as_expert_stack(
        formats.quantize(torch.randn(1, *s, generator=rng) * (0.25 if fold else 2.0 ** 16), "fp8_w"), k_major
    ).to(DEVICE) for s in ((I, D), (I, D), (D, I)))
    add = torch.randn(n, D, generator=rng).to(DEVICE)
    tiles = _tiles(combine=dict(BLOCK_D=1024, num_warps=4, in_kernel=in_kernel))
    with pinned_tiles(moe=tiles):
        p = moe._plan(n, k, E, D, I, True)
    assert p["qgmma"] is not None and p["qgmma_shared"] is not None and p["qgmma_shared"]["shared"]
    assert (mm.shared_operands(shared, I, D) is not None) == fold
    got = run_moe(args, tiles, add=add, out_dtype=torch.bfloat16, shared=shared)
    assert_counters_zero(got)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, add=add, out_dtype=torch.bfloat16, shared=shared)
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want.float()) < 1e-2
