"""The ``gemv_mma`` knob of an experts rule (kernels_cuda/moe_mma.py): routed fp4_w experts in E2M1 words on
``mma.sync`` with the weight rows as the MMA's M, written in Gluon.

Without a GPU: the launcher takes it only where the knob is on, the activations are dequantized, the
target compiles Gluon on sm_80+ with a Triton that takes 8 consecutive K elements a thread, and the
weights are fp4_w words whose scales fold; its plan splits K in whole ring slots; with Triton 3.6 the
kernels compile for sm_90 on ``HMMA`` fed by 16-byte copies. On a GPU: against the reference and the
16-row tile's path on fresh random inputs: one token (a row tile a pair), routing tables (a token's slots
may repeat), ragged I and K, a K split met in the kernel or not, the shared expert and ``add``, every
E2M1 code and scale bytes up to the fold's limit."""
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
mm = pytest.importorskip("flashrt.kernels_cuda.moe_mma")
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
MMA_GPU = GPU and torch.cuda.get_device_capability() >= (8, 0) and mm.usable()


def _tiles(per_sm=4, warps=4, tokens=8, sub=4, on=True, **moe_tiles):
    rule = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=warps, num_stages=3, gemv_mma=on, gemv_mma_per_sm=per_sm,
                gemv_mma_tokens=tokens, gemv_mma_sub=sub)
    return {"experts": [[16, rule], [None, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)]],
            "act_dequantized": True, **moe_tiles}


def _plan(monkeypatch, n=1, k=6, E=8, D=5120, I=2304, shared=False, **tiles):
    monkeypatch.setattr(mm, "usable", lambda: True)
    monkeypatch.setattr(lin, "INTERPRETED", False)
    with pinned_tiles(moe=_tiles(**tiles)), jit_targets.targeting(ARCHS["sm_90"]):
        return moe._plan(n, k, E, D, I, shared)


def test_the_launcher_takes_it_where_it_can_run(monkeypatch):
    p = _plan(monkeypatch)["mma"]
    assert p["pairs"] and p["row_tiles"] == 6 and p["up"]["constexprs"]["TOKENS"] == 8
    t = _plan(monkeypatch, n=8)["mma"]  # past pair_tiles: the routing tables' tiles of TOKENS rows
    assert not t["pairs"] and t["block_m"] == 8 and t["row_tiles"] == min(48, 6 + 8)
    assert _plan(monkeypatch, on=False)["mma"] is None
    assert _plan(monkeypatch, act_dequantized=False)["mma"] is None
    assert _plan(monkeypatch, k=1, E=1)["mma"] is None  # the direct path (the shared expert alone)
    monkeypatch.setattr(mm, "usable", lambda: False)  # a Triton refusing 8 K elements a thread
    with pinned_tiles(moe=_tiles()), jit_targets.targeting(ARCHS["sm_90"]):
        assert moe._plan(1, 6, 8, 5120, 2304)["mma"] is None
    monkeypatch.setattr(mm, "usable", lambda: True)
    monkeypatch.setattr(lin, "INTERPRETED", True)  # the interpreter does not run Gluon
    with pinned_tiles(moe=_tiles()), jit_targets.targeting(ARCHS["sm_90"]):
        assert moe._plan(1, 6, 8, 5120, 2304)["mma"] is None


@pytest.mark.parametrize("n,E,D,I,per_sm,sub", [(1, 8, 5120, 2304, 4, 4), (8, 64, 1024, 512, 4, 2),
                                                (1, 8, 160, 96, 64, 1), (1, 8, 288, 96, 64, 1),
                                                (64, 384, 4096, 2048, 1, 4)])
def test_the_plan_splits_k_in_whole_ring_slots(monkeypatch, n, E, D, I, per_sm, sub):
    p = _plan(monkeypatch, n=n, E=E, D=D, I=I, per_sm=per_sm, sub=sub)["mma"]
    with jit_targets.targeting(ARCHS["sm_90"]):
        sms = lin.num_sms()
    for launch, K, cols in (("up", D, I), ("down", I, D)):
        g = p[launch]
        assert g["k_split"] % (32 * sub) == 0 and (g["split"] - 1) * g["k_split"] < K <= g["split"] * g["k_split"]
        assert g["constexprs"]["SPLIT"] == (g["split"] > 1)
        assert g["constexprs"]["EVEN"] == (cols % 64 == 0) and g["constexprs"]["EVEN_K"] == (K % (32 * sub) == 0)
        # no more splits than bring the programs to per_sm an SM, none shorter than MIN_SLICES slices
        programs = g["grid_cols"] * p["row_tiles"]
        assert g["split"] <= max(1, per_sm * sms // programs)
        assert g["split"] == 1 or g["k_split"] >= 32 * mm.MIN_SLICES


@pytest.mark.parametrize("n,tokens,sub", [(1, 8, 4), (6, 8, 2), (20, 16, 4), (3, 8, 1)])
def test_the_shared_experts_tiles_follow_the_routed_ones(monkeypatch, n, tokens, sub):
    """With the shared expert, the launches' row tiles are the routed ones and then one a ``TOKENS`` tokens
    (a slot of its fp8 ring must hold whole K slices: not at ``SUB`` 1), and the K split and the combine's
    counters count them; the routed-only plan is kept beside it (the weights decide per call)."""
    both = _plan(monkeypatch, n=n, tokens=tokens, sub=sub, shared=True)
    alone, p = both["mma"], both["mma_shared"]
    assert not alone["shared"] and alone["grid_rows"] == alone["row_tiles"]
    assert _plan(monkeypatch, n=n, tokens=tokens, sub=sub)["mma_shared"] is None
    if sub == 1:
        assert p is None
        return
    assert p["shared"] and p["row_tiles"] == alone["row_tiles"]
    assert p["grid_rows"] == p["row_tiles"] + -(-n // tokens)
    with jit_targets.targeting(ARCHS["sm_90"]):
        sms = lin.num_sms()
    for launch in ("up", "down"):  # the K split aims at per_sm (4) programs an SM over every row tile
        programs = p[launch]["grid_cols"] * p["grid_rows"]
        assert p[launch]["split"] <= max(1, 4 * sms // programs)
    split_tiles = p["down"]["grid_cols"] * p["grid_rows"] if p["down"]["split"] > 1 else 0
    assert mm.combines(p, n) == splitk_fits(n * p["down"]["grid_cols"] + split_tiles)


def splitk_fits(counters: int) -> bool:
    from flashrt.kernels_cuda import splitk

    return splitk.fits(counters)


def _shared(rng, I, D, k_major=False, scale=0.25):
    """A shared expert's w1, w3 [1, I, D] and w2 [1, D, I] in fp8_w as the model stacks them."""
    return tuple(formats.as_expert_stack(formats.quantize(torch.randn(1, *s, generator=rng) * scale, "fp8_w"),
                                         k_major) for s in ((I, D), (I, D), (D, I)))


def test_it_takes_an_fp8_shared_expert_whose_scales_fold(rng):
    """Its rows go in the routed launches where all three weights are fp8_w of the routed dims, w1 and w3
    laid out alike, rows of whole 16-byte copies and scale bytes recorded at most the fp8 fold's 134; else
    the launcher runs it on its own (the direct path)."""
    I, D = 64, 96
    shared = _shared(rng, I, D)
    ops = mm.shared_operands(shared, I, D)
    assert ops is not None
    for (data, scale, row, tile_row, k_slice), w in zip(ops, shared):
        assert data.dtype == scale.dtype == torch.uint8 and data.shape == w.shape[1:]
        assert row == w.shape[-1] and (tile_row, k_slice) == scale.stride()
    k_major = mm.shared_operands(_shared(rng, I, D, k_major=True), I, D)
    assert k_major is not None and k_major[0][4] != 1  # the K-major scales' strides pass through
    assert mm.shared_operands(shared, I, D + 32) is None and mm.shared_operands(shared, 2 * I, D) is None
    big = _shared(rng, I, D, scale=2.0 ** 16)
    assert big[0].scale_max > 134 and mm.shared_operands((big[0], *shared[1:]), I, D) is None
    unknown = dataclasses.replace(shared[2], scale_max=None)
    assert mm.shared_operands((*shared[:2], unknown), I, D) is None
    fp4 = tuple(_stack(rng, 1, *s) for s in ((I, D), (I, D), (D, I)))
    assert mm.shared_operands(fp4, I, D) is None
    odd = _shared(rng, 64, 40)  # rows of 40 bytes: not whole 16-byte copies
    assert mm.shared_operands(odd, 64, 40) is None


def _stack(rng, E, rows, K, words=True, k_major=True, scale=0.25):
    w = formats.quantize(torch.randn(E, rows, K, generator=rng) * scale, "fp4_w")
    return formats.as_expert_stack(w, k_major, words)


def test_it_takes_fp4_words_whose_scales_fold(rng):
    ws = [_stack(rng, 2, 64, 64) for _ in range(3)]
    assert moe._mma_weights(*ws)
    assert not moe._mma_weights(_stack(rng, 2, 64, 64, words=False), *ws[1:])
    big = _stack(rng, 2, 64, 64, scale=2.0 ** 10)  # scale bytes past the fold's 128
    assert big.scale_max > lin.FOLD_MAX_SCALE and not moe._mma_weights(big, *ws[1:])


@pytest.mark.skipif(not (mm.AVAILABLE and mm.operand_kw(mm.KW) == mm.KW),
                    reason="this Triton refuses 8 consecutive K elements a thread (Triton 3.7 on)")
@pytest.mark.parametrize("sub", [4, 1])
def test_it_compiles_for_sm90_on_mma_sync_fed_by_asynchronous_copies(sub):
    tiles = {"experts": _tiles(sub=sub)["experts"], "act_dequantized": True}
    reports = sm90_compile("moe", "--B", "1", "--cold", "--moe-dims", "released", "--tiles", json.dumps(tiles),
                           "--profile-set", "expert_fp4=words")
    for name, weights in (("_up_kernel", 2), ("_down_kernel", 1)):
        r = next(r for r in reports if r["kernel"] == name)
        assert r["stack_bytes"] == 0 and r["registers"] <= 128
        loop = r["mma_loop"]
        # each K slice of 32: two m16n8k16 MMAs a weight; no warpgroup MMA
        assert loop["count"] == 2 * weights * sub and r["sass"]["HGMMA"] == 0
        assert r["global_loads"].get("LDGSTS.E.BYPASS.128", 0) > 0  # the copies: 16 bytes each
        # a slice: two words of codes a thread decoded per weight and the activations' permutes
        assert loop["instructions"] < 64 * weights * sub + 60


@pytest.mark.skipif(not (mm.AVAILABLE and mm.operand_kw(mm.KW) == mm.KW),
                    reason="this Triton refuses 8 consecutive K elements a thread (Triton 3.7 on)")
def test_the_shared_experts_loop_compiles_beside_the_routed_one():
    """With the shared expert's tiles each kernel holds two K loops: the routed words' and the fp8 one (two
    m16n8k16 MMAs a K slice a weight, ``SUB // 2`` slices a trip), in the same shared memory as without
    them, no stack; the fp8 loop's decode is four instructions a register of two values."""
    tiles = {"experts": _tiles(sub=4)["experts"], "act_dequantized": True}
    args = ("moe", "--B", "1", "--cold", "--moe-dims", "released", "--tiles", json.dumps(tiles),
            "--profile-set", "expert_fp4=words")
    alone, both = sm90_compile(*args), sm90_compile(*args, "--moe-shared")
    for name, weights in (("_up_kernel", 2), ("_down_kernel", 1)):
        r = next(r for r in both if r["kernel"] == name)
        before = next(r for r in alone if r["kernel"] == name)
        assert r["stack_bytes"] == 0 and r["registers"] <= 128 and r["shared_bytes"] == before["shared_bytes"]
        loops = sorted((lp["count"], lp["instructions"]) for lp in r["mma_loop"]["loops"])
        assert [c for c, _ in loops] == [2 * weights * 2, 2 * weights * 4]
        # a trip: 32 bytes a thread a weight (8 registers of two values, 4 instructions each), the weight's
        # shared loads and scales, and the trip's copies and barriers
        assert loops[0][1] < weights * (2 * 8 * 4 + 30) + 70


def _case(rng, n, D, I, E, k, xdt=torch.bfloat16, k_major=True):
    return moe_case(rng, n, D, I, E, k, lambda e, rows, K: _stack(rng, e, rows, K, k_major=k_major), xdt)


# (tokens, D, I, experts, slots, K split aiming at that many programs an SM, slices a slot, scales K major)
CASES = [(1, 256, 128, 8, 6, 4, 4, True), (1, 160, 96, 4, 2, 64, 1, True), (8, 512, 192, 16, 6, 4, 4, True),
         (5, 352, 96, 3, 4, 1, 2, True), (3, 1024, 2304, 12, 6, 16, 4, True), (16, 256, 64, 4, 3, 4, 4, True),
         (1, 352, 96, 4, 2, 64, 4, False), (6, 512, 192, 16, 6, 4, 2, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not MMA_GPU, reason="needs an sm_80+ GPU, Gluon and a Triton taking 8 K elements a thread")
@pytest.mark.parametrize("n,D,I,E,k,per_sm,sub,k_major", CASES)
def test_against_the_reference_and_the_16_row_tile(rng, n, D, I, E, k, per_sm, sub, k_major):
    """Ragged I (96, 192) and K (160, 352: a split's last slot short), pairs and tables, split and not, the
    scales K major (through the ring) and row major (loaded where used)."""
    args = _case(rng, n, D, I, E, k, k_major=k_major)
    tiles = _tiles(per_sm=per_sm, sub=sub)
    with pinned_tiles(moe=tiles):
        assert moe._plan(n, k, E, D, I)["mma"] is not None
    assert_moe_path_matches(args, tiles, _tiles(on=False))


@pytest.mark.gpu
@pytest.mark.skipif(not MMA_GPU, reason="needs an sm_80+ GPU, Gluon and a Triton taking 8 K elements a thread")
def test_row_tiles_of_16_pair_rows(rng):
    """``gemv_mma_tokens`` 16: the routing tables' tiles of up to 16 rows an expert, the MMA's N 16."""
    args = _case(rng, 12, 256, 128, 4, 4)
    tiles = _tiles(tokens=16)
    with pinned_tiles(moe=tiles):
        assert moe._plan(12, 4, 4, 256, 128)["mma"]["block_m"] == 16
    got = run_moe(args, tiles, out_dtype=torch.float32)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, out_dtype=torch.float32)
    assert rel_err(got, want) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not MMA_GPU, reason="needs an sm_80+ GPU, Gluon and a Triton taking 8 K elements a thread")
@pytest.mark.parametrize("n,per_sm,sub,in_kernel,k_major,fold", [
    (1, 4, 4, True, False, True), (6, 4, 2, True, True, True), (1, 64, 2, True, False, True),
    (6, 64, 4, False, False, True), (20, 4, 4, True, False, True), (1, 4, 4, True, False, False),
    (6, 4, 1, True, False, True)])
def test_with_the_shared_expert_and_add(rng, n, per_sm, sub, in_kernel, k_major, fold):
    """The shared expert (fp8_w): its rows in the routed launches (fp8 loop, pairs and tables, a K split
    or not, the combine in the down kernel or its own launch, scales row or K major), or where its scales
    do not fold or the ring's slots hold half slices (``SUB`` 1) on the direct path over the same
    dequantized activations; its row and ``add`` summed after the routed rows; bf16 out."""
    D, I, E, k = 256, 128, 8, 6
    args = _case(rng, n, D, I, E, k)
    shared = tuple(w.to(DEVICE) for w in _shared(rng, I, D, k_major, 0.25 if fold else 2.0 ** 16))
    add = torch.randn(n, D, generator=rng).to(DEVICE)
    tiles = _tiles(per_sm=per_sm, sub=sub, combine=dict(BLOCK_D=1024, num_warps=4, in_kernel=in_kernel))
    with pinned_tiles(moe=tiles):
        folded = moe._plan(n, k, E, D, I, True)["mma_shared"] is not None and mm.shared_operands(shared, I, D)
    assert bool(folded) == (fold and sub > 1)
    got = run_moe(args, tiles, add=add, out_dtype=torch.bfloat16, shared=shared)
    assert_counters_zero(got)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, add=add, out_dtype=torch.bfloat16, shared=shared)
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want.float()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not MMA_GPU, reason="needs an sm_80+ GPU, Gluon and a Triton taking 8 K elements a thread")
def test_every_code_and_scale_byte(rng):
    """Each of the 16 E2M1 codes at every position of a word, scale bytes from 2**-127 up to the fold's
    limit, against the reference."""
    E, I, D = 2, 64, 512

    def stack(rows, K):  # every byte value in each row of 256 bytes or more; shifted from row to row
        data = ((torch.arange(K // 2) + 7 * torch.arange(rows)[:, None]) % 256).to(torch.uint8).expand(E, rows, K // 2)
        scale = torch.randint(100, lin.FOLD_MAX_SCALE + 1, (E, rows, K // 32), generator=rng, dtype=torch.uint8)
        scale[0, 0, 0], scale[-1, -1, -1] = 0, lin.FOLD_MAX_SCALE
        w = formats.QTensor(data, scale.view(torch.float8_e8m0fnu), "fp4_w", (E, rows, K))
        return formats.as_expert_stack(w, True, True).to(DEVICE)

    w1, w3, w2 = stack(I, D), stack(I, D), stack(D, I)
    x = torch.randn(1, D, generator=rng).to(DEVICE, torch.bfloat16)
    args = (x, torch.rand(1, 2, generator=rng).to(DEVICE), torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE),
            w1, w3, w2, 0.0)
    got = run_moe(args, _tiles(), out_dtype=torch.float32)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, out_dtype=torch.float32)
    assert rel_err(got, want) < 5e-3
