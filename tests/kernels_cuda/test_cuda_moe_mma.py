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

import json

import pytest
import torch

import flashrt
from flashrt import formats, jit_targets, ops
from flashrt.jit_targets import ARCHS
from kernel_check import DEVICE, GPU, assert_counters_zero, pinned_tiles, rel_err, requires_kernels, sm90_compile

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


def _plan(monkeypatch, n=1, k=6, E=8, D=5120, I=2304, **tiles):
    monkeypatch.setattr(mm, "usable", lambda: True)
    monkeypatch.setattr(lin, "INTERPRETED", False)
    with pinned_tiles(moe=_tiles(**tiles)), jit_targets.targeting(ARCHS["sm_90"]):
        return moe._plan(n, k, E, D, I)


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


def _case(rng, n, D, I, E, k, xdt=torch.bfloat16, k_major=True):
    x = (torch.randn(n, D, generator=rng) * 3.0).to(DEVICE, xdt)
    idx = torch.randint(0, E, (n, k), generator=rng, dtype=torch.int32).to(DEVICE)  # a token's slots may repeat
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    w = [_stack(rng, E, *s, k_major=k_major).to(DEVICE) for s in ((I, D), (I, D), (D, I))]
    return (x, rw, idx, *w, 10.0)


def _run(args, tiles, **kw):
    with pinned_tiles(moe=tiles), flashrt.use_backend("cuda"):
        return ops.moe_experts(*args, **kw)


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
    got = _run(args, tiles, out_dtype=torch.float32)
    assert_counters_zero(got)
    tile = _run(args, _tiles(on=False), out_dtype=torch.float32)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, out_dtype=torch.float32)
    assert got.shape == (n, D) and rel_err(got, want) < 5e-3 and rel_err(got, tile) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not MMA_GPU, reason="needs an sm_80+ GPU, Gluon and a Triton taking 8 K elements a thread")
def test_row_tiles_of_16_pair_rows(rng):
    """``gemv_mma_tokens`` 16: the routing tables' tiles of up to 16 rows an expert, the MMA's N 16."""
    args = _case(rng, 12, 256, 128, 4, 4)
    tiles = _tiles(tokens=16)
    with pinned_tiles(moe=tiles):
        assert moe._plan(12, 4, 4, 256, 128)["mma"]["block_m"] == 16
    got = _run(args, tiles, out_dtype=torch.float32)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, out_dtype=torch.float32)
    assert rel_err(got, want) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not MMA_GPU, reason="needs an sm_80+ GPU, Gluon and a Triton taking 8 K elements a thread")
@pytest.mark.parametrize("n", [1, 6])
def test_with_the_shared_expert_and_add(rng, n):
    """The shared expert (fp8_w) on the direct path over the same dequantized activations, its rows and
    ``add`` summed after the routed rows; bf16 out."""
    args = _case(rng, n, 256, 128, 8, 6)
    shared = tuple(formats.quantize(torch.randn(1, *s, generator=rng) * 0.25, "fp8_w").to(DEVICE)
                   for s in ((128, 256), (128, 256), (256, 128)))
    add = torch.randn(n, 256, generator=rng).to(DEVICE)
    got = _run(args, _tiles(), add=add, out_dtype=torch.bfloat16, shared=shared)
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
    got = _run(args, _tiles(), out_dtype=torch.float32)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, out_dtype=torch.float32)
    assert rel_err(got, want) < 5e-3
