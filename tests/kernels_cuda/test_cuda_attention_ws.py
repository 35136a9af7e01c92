"""``tiles.attention.ws``: the warp-specialized Gluon kernel of ``sparse_attention`` (:mod:`.attention_ws`).

Without a GPU: the launcher takes it only where it fits (bf16 q, D 512, heads a multiple of 64, fp8 /
fp4_b16 segments, an sm_90 target, the knob on), its plan splits K as the plain kernel's does, and
the kernel compiles for sm_90 with this machine's Triton (a subprocess without the interpreter):
within the shared-memory limit, its K loop on warpgroup MMAs (the score MMA once, 512 / 16 steps,
and the value MMA), the gathers as asynchronous copies. On an sm_90 GPU: its outputs against the
reference backend and against the plain kernel, on random rows, indices and splits."""
from __future__ import annotations

import json

import pytest
import torch

import flashrt
from flashrt import formats, jit_targets, ops
from flashrt.jit_targets import ARCHS
from kernel_check import DEVICE, GPU, needs_ptxas, pinned_tiles, rel_err, requires_kernels, sm90_compile

pytestmark = requires_kernels
attention = pytest.importorskip("flashrt.kernels_cuda.attention")
ws = pytest.importorskip("flashrt.kernels_cuda.attention_ws")
SM90 = GPU and torch.cuda.get_device_capability() == (9, 0)
WS = dict(attention=dict(ws=dict(enabled=True, min_queries=1)))  # every launch, whatever the profile
# two producer warps a scheduler (16 warps: the value MMA in halves fits the launch's 128 registers)
EIGHT = {"producer_warps": 8, "maxnreg": 128, "producer_regs": 80, "pv_parts": 2, "RAW_STAGES": 2}
FP8, FP4 = attention.FMT_CODES["fp8"], attention.FMT_CODES["fp4_b16"]


def _fits(q, codes, monkeypatch, arch="sm_90"):
    monkeypatch.setattr(attention, "interpreted", lambda: False)
    with jit_targets.targeting(ARCHS[arch]):
        return attention._ws_fits(q, codes)


@pytest.mark.skipif(not ws.AVAILABLE, reason="a Triton without Gluon")
def test_the_launcher_takes_it_only_where_it_fits(monkeypatch):
    q = torch.zeros(2, 1, 128, 512, dtype=torch.bfloat16)
    with pinned_tiles():
        assert not _fits(q, (FP8, FP4), monkeypatch)  # off by default
    with pinned_tiles(**WS):
        assert _fits(q, (FP8, FP8, FP4), monkeypatch)
        assert not _fits(q, (FP8, FP4), monkeypatch, "sm_89")  # warpgroup MMA: sm_90 only
        assert not _fits(q.float(), (FP8, FP4), monkeypatch)
        assert not _fits(q[..., :256], (FP8, FP4), monkeypatch)
        assert not _fits(q[:, :, :48], (FP8, FP4), monkeypatch)
        assert not _fits(q, (0, FP4), monkeypatch)  # a plain segment
        assert not _fits(q, (FP8, attention.FMT_CODES["fp4_b32"]), monkeypatch)
        monkeypatch.setattr(attention, "interpreted", lambda: False)
        with jit_targets.targeting(ARCHS["sm_90"]):
            assert not attention._ws_fits(q, (FP8, FP4), aligned=False)
            # the kernel bench names the kernel a launch gets, with its splits
            kernel, splits = attention.planned_splits(q, 640, (FP8, FP4))
            assert kernel == "ws" and splits == attention._ws_launch_plan(q, 640, (FP8, FP4), False)["splits"]
            assert attention.planned_splits(q.float(), 640, (FP8, FP4))[0] == "plain"
    with pinned_tiles(attention=dict(ws=dict(enabled=True, min_queries=3))):  # B * S = 2 queries: the plain kernel
        assert not _fits(q, (FP8, FP4), monkeypatch) and _fits(torch.cat([q, q[:1]]), (FP8, FP4), monkeypatch)


def test_rows_off_16_bytes_are_not_aligned():
    """The kernel copies rows 16 bytes at a time: a segment starting or striding off 16 bytes keeps the
    plain kernel."""
    kv = formats.quantize(torch.randn(1, 9, 512), "fp4_b16")
    assert attention._aligned16(attention._segments((kv,)))
    shifted = formats.QTensor(torch.zeros(1, 9, 257, dtype=torch.uint8)[..., 1:], kv.scale, "fp4_b16", (1, 9, 512))
    assert not attention._aligned16(attention._segments((shifted,)))


@pytest.mark.parametrize("B,S,H,K,sms", [(1, 1, 64, 640, 132), (64, 1, 64, 640, 132), (3, 2, 128, 100, 16),
                                         (200, 1, 64, 640, 132)])
def test_the_plan_splits_k_to_fill_the_sms(B, S, H, K, sms, monkeypatch):
    monkeypatch.setattr(attention, "sm_count", lambda device: sms)
    q = torch.zeros(B, S, H, 512, dtype=torch.bfloat16)
    with pinned_tiles(**WS):
        plan = attention._ws_launch_plan(q, K, (FP8, FP4), True)
    kb = attention._tiles()["ws"]["K_BLOCK"]
    blocks, programs = -(-K // kb), B * S * H // 64
    assert plan["grid"] == (B * S, H // 64, plan["splits"]) and plan["ws"] and not plan["finish"]
    assert plan["splits"] * plan["per_split"] >= blocks > (plan["splits"] - 1) * plan["per_split"]  # every block once
    assert plan["splits"] * programs <= max(sms, programs)  # at most a wave, unless the queries alone pass one
    # and not fewer than half of what fills it (the blocks a split takes are rounded up), the K blocks or 32
    assert 2 * plan["splits"] > min(sms // programs, blocks, attention._tiles()["split"]["max_splits"])
    assert plan["constexprs"]["SPLIT"] == (plan["splits"] > 1) and plan["constexprs"]["PACKED"] is False
    with pinned_tiles(attention=dict(WS["attention"], dequant=dict(packed_fp4_b16=True))):
        assert attention._ws_launch_plan(q, K, (FP8, FP4), True)["constexprs"]["PACKED"] is True


@pytest.mark.skipif(not ws.AVAILABLE, reason="a Triton without Gluon")
@needs_ptxas
@pytest.mark.parametrize("ws_tiles", [{}, {"overlap": True, "STAGES": 3, "RAW_STAGES": 2}, EIGHT,
                                      {"q_in_consumers": True}, {"split_scores": True, "q_in_consumers": True},
                                      {"rows_by_warp": True, "q_in_consumers": True}, dict(EIGHT, rows_by_warp=True),
                                      {"staged_stores": True, "split_scores": True, "q_in_consumers": True},
                                      {"staged_stores": True, "pv_parts": 2}, {"decode_ahead": True, "RAW_STAGES": 2}])
def test_it_compiles_for_sm90_on_warpgroup_mmas_and_async_copies(ws_tiles):
    tiles = {"ws": dict(WS["attention"]["ws"], **ws_tiles)}
    report = {r["kernel"]: r for r in sm90_compile("attention", "--B", "4", "--S", "1", "--tiles", json.dumps(tiles))}
    r = report["_ws_attention_kernel"]
    assert r["shared_bytes"] <= ARCHS["sm_90"].smem_limit
    # the innermost loop of warpgroup MMAs (the consumers' K loop): one score MMA (K = 512 in steps of
    # 16) and the value MMA (K_BLOCK 32 in steps of 16) a trip; no mma.sync anywhere
    # (the value MMA in two halves: twice its steps; the scores over half of D a warpgroup: half theirs)
    inner = min(r["mma_loop"]["loops"], key=lambda loop: loop["instructions"])
    parts, halves = ws_tiles.get("pv_parts", 1), 2 if ws_tiles.get("split_scores") else 1
    assert inner["count"] == 512 // 16 // halves + parts * 32 // 16 and r["sass"]["HGMMA"] >= inner["count"]
    assert r["sass"]["HMMA"] == 0 and r["sass"]["LDGSTS"] > 0 and r["sass"]["BAR"] > 0
    # 8 producer warps: 16 warps under the 128 registers a thread their launch allows
    assert r["num_warps"] == 8 + ws_tiles.get("producer_warps", 4) and r["registers"] <= 65536 // (32 * r["num_warps"])


def _case(g, B, S, H, W, T, K, cold: bool, hole: bool = False):
    """Random rows and indices; ``hole``: the picks' entries 16..47 empty (-1), a whole K block of 32
    on no path where the window's length is 48 (its block before holds window and pick rows)."""
    D = 512
    q8 = lambda n, b=B: formats.quantize(torch.randn(b, n, D, generator=g), "fp8").to(DEVICE)
    q4 = lambda n, b=B: formats.quantize(torch.randn(b, n, D, generator=g), "fp4_b16").to(DEVICE)
    kv = (q8(W), q8(S), q4(T, 1)) + ((q4(B * K, 1),) if cold else ())
    total = W + S + T + (B * K if cold else 0)
    win = torch.randint(0, W + S, (B, S, W), generator=g, dtype=torch.int32)
    picks = torch.randint(W + S, total, (B, S, K - W), generator=g, dtype=torch.int32)
    for part in (win, picks):
        part[torch.rand(part.shape, generator=g) < 0.15] = -1
    if hole:
        picks[..., 16:48] = -1
    q = (torch.randn(B, S, H, D, generator=g) * 2).to(DEVICE, torch.bfloat16)
    return q, kv, (win.to(DEVICE), picks.to(DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not (SM90 and ws.AVAILABLE), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("B,S,H,W,T,K,cold,sink,programs,hole", [
    (1, 1, 64, 128, 4096, 640, False, True, 0, False),  # the released decode, K split over the SMs
    (64, 1, 64, 128, 2048, 640, False, True, 0, False),
    (3, 2, 128, 32, 700, 100, True, False, 0, False),  # two head blocks, a cold fourth segment, K past the blocks
    (2, 1, 64, 128, 1000, 640, False, True, 1, False),  # one program a head block: no split
    (2, 1, 64, 48, 1000, 200, False, True, 0, True),  # a block on two paths, a block on none
])
@pytest.mark.parametrize("packed", [False, True], ids=["codes", "packed"])
@pytest.mark.parametrize("ws_tiles", [{}, {"overlap": True, "STAGES": 3, "RAW_STAGES": 2}, {"overlap": True},
                                      {"RAW_STAGES": 2}, {"RAW_STAGES": 2, "STAGES": 3}, EIGHT,
                                      dict(EIGHT, overlap=True), {"pv_parts": 2}, {"q_in_consumers": True},
                                      dict(EIGHT, q_in_consumers=True, overlap=True),
                                      {"split_scores": True, "q_in_consumers": True},
                                      {"split_scores": True, "q_in_consumers": False, "STAGES": 1},
                                      {"rows_by_warp": True, "q_in_consumers": True, "RAW_STAGES": 2},
                                      dict(EIGHT, rows_by_warp=True, q_in_consumers=True),
                                      {"staged_stores": True, "q_in_consumers": True, "RAW_STAGES": 2},
                                      {"staged_stores": True, "pv_parts": 2, "overlap": True},
                                      {"staged_stores": True, "split_scores": True, "q_in_consumers": True,
                                       "rows_by_warp": True},
                                      {"decode_ahead": True, "q_in_consumers": True, "RAW_STAGES": 2},
                                      {"decode_ahead": True, "rows_by_warp": True, "staged_stores": True,
                                       "q_in_consumers": True, "RAW_STAGES": 2}],
                         ids=["default", "overlap-3-slots", "overlap", "copies-1-ahead", "copies-1-ahead-3-slots",
                              "8-producer-warps", "8-producer-warps-overlap", "value-mma-halves", "q-in-consumers",
                              "8-producer-warps-q-in-consumers", "split-scores", "split-scores-q-before-1-slot",
                              "rows-by-warp", "rows-by-warp-8-producer-warps", "staged-stores",
                              "staged-stores-value-mma-halves", "staged-stores-split-scores-rows-by-warp",
                              "decode-ahead", "decode-ahead-rows-by-warp-staged-stores"])
def test_outputs_match_the_reference_and_the_plain_kernel(rng, B, S, H, W, T, K, cold, sink, programs, hole,
                                                          packed, ws_tiles):
    q, kv, idx = _case(rng, B, S, H, W, T, K, cold, hole)
    s = torch.randn(H, generator=rng).to(DEVICE) if sink else None
    split = dict(split=dict(programs=programs)) if programs else {}
    split["dequant"] = dict(packed_fp4_b16=packed)  # both kernels decode the fp4_b16 rows the same way
    with flashrt.use_backend("reference"):
        want = ops.sparse_attention(q, kv, idx, s, 512 ** -0.5).float().cpu()
    out = {}
    for name, tiles in (("plain", {}), ("ws", {"ws": dict(WS["attention"]["ws"], **ws_tiles)})):
        with flashrt.use_backend("cuda"), pinned_tiles(attention={**tiles, **split}):
            assert attention._ws_fits(q, (FP8,) * 2 + (FP4,) * (2 if cold else 1)) == (name == "ws")
            out[name] = ops.sparse_attention(q, kv, idx, s, 512 ** -0.5).float().cpu()
    assert torch.isfinite(out["ws"]).all()
    assert rel_err(out["ws"], want) < 2e-2
    assert rel_err(out["ws"], out["plain"]) < 1e-2
