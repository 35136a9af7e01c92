"""The ``qgmma`` knob of an experts rule with ``qgmma_tokens`` of 32 or 64 (kernels_cuda/moe_qgmma_stream.py):
a prefill chunk's routed fp4_w experts on the fp8 warpgroup MMA, the whole K a program, the activations
streamed through the ring beside the weights.

Without a GPU: the MMA order of a block's codes is the one the weights' decode fills (the emulated PTX's
positions), ``fp8_codes`` stores x's codes in it under the interpreter, the launcher takes the streamed
plan for row tiles of 32 or 64 (no K split, no shared tiles) and refuses a ring under two trips; with
this Triton the kernels compile for sm_90 on ``QGMMA`` without spills (in their K loop under a register
cap). On an sm_90 GPU: against the reference and the rule's MMA tile without the knob on fresh random
inputs: row tiles of 32 and 64 rows (partly filled, experts over several tiles), 4 and 8 warps, rings of
2-4 trips, scales row and K major, one or two MMAs in flight (with a register cap), the combine in the
down launch and in its own, the shared expert beside it and ``add``.

The rule's ``qgmma_bf16`` (kernels_cuda/experts_bf16_stream.py) runs the same launches on the bf16 MMA: its
operand order is a permutation of a trip's 128 K that the round trip's ``stream_order`` store follows
under the interpreter; its plan; its sm_90 compile (``HGMMA`` only, no local memory, two programs of 8
warps an SM by their registers); on an sm_90 GPU every case above on it too, and its weights' scales
unfolded (no largest scale byte recorded)."""
from __future__ import annotations

import json

import pytest
import torch

import flashrt
from flashrt import formats, jit_targets, ops
from flashrt.jit_targets import ARCHS
from kernel_check import (DEVICE, GPU, assert_counters_zero, assert_moe_path_matches, moe_case, pinned_tiles,
                          qgmma_knobs, rel_err, requires_kernels, run_moe, sm90_compile)

pytestmark = requires_kernels
moe = pytest.importorskip("flashrt.kernels_cuda.moe")
st = pytest.importorskip("flashrt.kernels_cuda.moe_qgmma_stream")
es = pytest.importorskip("flashrt.kernels_cuda.experts_qgmma_stream")
eb = pytest.importorskip("flashrt.kernels_cuda.experts_bf16_stream")
import triton  # noqa: E402  (after the skips: the kernels need Triton)
import triton.language as tl  # noqa: E402

from flashrt.kernels_cuda.round_trip import stream_position  # noqa: E402
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
QG_GPU = GPU and torch.cuda.get_device_capability() >= (9, 0) and st.AVAILABLE


def _tiles(tokens=64, warps=8, stages=3, on=True, inflight=2, maxnreg=None, bf16=False, tokens2=0, **moe_tiles):
    """A decode rule on the 16-row tile, then the prefill rule with the streamed knob (``bf16``: on the bf16
    MMA's loop; ``tokens2``: its row tiles' second part)."""
    prefill = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3,
                   **qgmma_knobs(on, tokens, warps, stages, inflight, maxnreg, qgmma_bf16=bf16, qgmma_tokens2=tokens2))
    return {"experts": [[16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)], [None, prefill]],
            "act_dequantized": True, **moe_tiles}


def _plan(monkeypatch, n=4096, k=6, E=384, D=5120, I=2304, shared=False, **tiles):
    monkeypatch.setattr(lin, "INTERPRETED", False)
    with pinned_tiles(moe=_tiles(**tiles)), jit_targets.targeting(ARCHS["sm_90"]):
        return moe._plan(n, k, E, D, I, shared)


def test_the_mma_order_is_the_decodes():
    """Position ``16h + 4t + j`` of a block holds K ``8t + 2j + h``: the order the weights' decode fills
    (``test_cuda_experts_qgmma``'s emulated PTX); a permutation of the 32."""
    where = [es.mma_position(c) for c in range(32)]
    assert sorted(where) == list(range(32))
    for t in range(4):
        for j in range(4):
            for h in range(2):
                assert where[8 * t + 2 * j + h] == 16 * h + 4 * t + j


@pytest.mark.parametrize("rows,k", [(5, 96), (17, 256)])
def test_fp8_codes_in_the_mma_order(rng, rows, k):
    """``fp8_codes(mma_order=True)``: each block's bytes of the plain codes moved to their MMA positions, the
    scales the same (the kernel's ``round_trip.mma_position``, which the up kernel's h store shares)."""
    from flashrt.kernels_cuda.round_trip import fp8_codes

    x = (torch.randn(rows, k, generator=rng) * 3.0).to(DEVICE, torch.bfloat16)
    tile = dict(BLOCK_R=4, BLOCK_C=64, num_warps=4)
    plain, s = fp8_codes(x, tile, 64.0)
    ordered, s2 = fp8_codes(x, tile, 64.0, mma_order=True)
    pos = torch.tensor([es.mma_position(c) for c in range(32)])
    want = torch.empty_like(plain.view(torch.uint8)).view(rows, k // 32, 32)
    want[:, :, pos] = plain.view(torch.uint8).view(rows, k // 32, 32)
    assert torch.equal(ordered.view(torch.uint8).view(rows, k // 32, 32), want) and torch.equal(s, s2)


def test_the_bf16_order_is_the_a_fragments():
    """K ``32t + 8a + 4c + 2g + h`` of a trip sits at ``32a + 16c + 8g + 2t + h``: quad lane ``t`` holds K
    block ``t`` (one scale a row), each register a pair of neighbouring K; a permutation of the 128."""
    where = [eb.position(k) for k in range(128)]
    assert sorted(where) == list(range(128))
    for k in range(0, 128, 2):
        t = k // 32
        assert where[k + 1] == where[k] + 1  # a register's two halves: K 2i, 2i + 1
        assert (where[k] // 2) % 4 == t  # the lane of the quad that holds it (A fragment: column 2t + h)


@pytest.mark.parametrize("rows,k,block_c", [(3, 128, 128), (9, 384, 256), (5, 256, 64)])
def test_fp8_round_trip_in_the_stream_order(rng, rows, k, block_c):
    """``fp8_round_trip(stream_order=True)``: each trip's values of the plain round trip at their positions
    (moved in registers; programs of whole trips whatever the tile's columns); D not whole trips refused by
    name."""
    from flashrt.kernels_cuda.round_trip import fp8_round_trip

    x = (torch.randn(rows, k, generator=rng) * 3.0).to(DEVICE, torch.bfloat16)
    tile = dict(BLOCK_R=4, BLOCK_C=block_c, num_warps=4)
    plain, ordered = fp8_round_trip(x, tile), fp8_round_trip(x, tile, stream_order=True)
    pos = torch.tensor([eb.position(c) for c in range(128)])
    want = torch.empty_like(plain).view(rows, k // 128, 128)
    want[:, :, pos] = plain.view(rows, k // 128, 128)
    assert torch.equal(ordered.view(rows, k // 128, 128), want) and not torch.equal(ordered, plain)
    with pytest.raises(ValueError, match="stream_order.*multiple of 128.*96"):
        fp8_round_trip(x[:, :96], tile, stream_order=True)


@triton.jit
def _positions(out_ptr, N: tl.constexpr):
    c = tl.arange(0, N)
    tl.store(out_ptr + c, stream_position(c))


def test_the_h_store_uses_the_same_order():
    """``round_trip.stream_position`` (the up kernel's h store) against the loop's ``position`` over four
    trips: each column stays in its trip."""
    out = torch.empty(512, dtype=torch.int32, device=DEVICE)
    _positions[(1,)](out, 512)
    want = torch.tensor([128 * (c // 128) + eb.position(c % 128) for c in range(512)], dtype=torch.int32)
    assert torch.equal(out.cpu(), want)


@pytest.mark.skipif(not st.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("tokens,warps", [(32, 8), (64, 4)])
def test_the_launcher_streams_row_tiles_of_32_or_more(monkeypatch, tokens, warps):
    p = _plan(monkeypatch, tokens=tokens, warps=warps)
    q = p["qgmma"]
    assert q["stream"] and not q["pairs"] and q["block_m"] == tokens
    assert q["row_tiles"] == min(4096 * 6, -(-4096 * 6 // tokens) + 384)
    rows = 16 * warps
    assert q["up"]["grid_cols"] == 2304 // (rows // 2) and q["down"]["grid_cols"] == 5120 // rows
    assert q["up"]["split"] == q["down"]["split"] == 1 and q["up"]["constexprs"]["num_warps"] == warps
    assert q["up"]["constexprs"]["INFLIGHT"] == 2 and "maxnreg" not in q["up"]["constexprs"]
    capped = _plan(monkeypatch, tokens=tokens, warps=warps, inflight=1, maxnreg=128)["qgmma"]
    assert capped["down"]["constexprs"]["INFLIGHT"] == 1 and capped["down"]["constexprs"]["maxnreg"] == 128
    # no shared tiles in the streamed launches: the shared expert runs beside them
    assert _plan(monkeypatch, tokens=tokens, warps=warps, shared=True)["qgmma_shared"] is None
    assert _plan(monkeypatch, tokens=tokens, stages=0)["qgmma"] is None  # the ring is the stream: two trips at least
    assert _plan(monkeypatch, tokens=tokens, D=5120 + 64)["qgmma"] is None  # D not whole trips of 128
    assert _plan(monkeypatch, tokens=tokens, on=False)["qgmma"] is None
    # 128-row tiles: their accumulators spill; not a tile the launches take
    assert st.plan(4096, 6, 384, 5120, 2304, False, dict(TOKENS=128, STAGES=3, num_warps=warps)) is None
    assert not q["bf16"] and not q["up"]["constexprs"]["BF16"]
    # the bf16 loop: the same launches and grids, one variant whatever the blocks in flight
    b = _plan(monkeypatch, tokens=tokens, warps=warps, bf16=True)["qgmma"]
    assert b["bf16"] and b["up"]["constexprs"]["BF16"] and b["down"]["constexprs"]["INFLIGHT"] == 1
    assert {key: b[key] for key in ("row_tiles", "block_m")} == {key: q[key] for key in ("row_tiles", "block_m")}
    assert b["up"]["grid_cols"] == q["up"]["grid_cols"] and b["down"]["grid_cols"] == q["down"]["grid_cols"]


@pytest.mark.skipif(not st.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("tokens,tokens2", [(64, 32), (32, 16), (64, 16)])
def test_the_bf16_loop_takes_a_second_part_of_the_row_tile(monkeypatch, tokens, tokens2):
    """``qgmma_tokens2``: the routing tables' tiles of both parts' rows, the launches' grids as without it;
    only on the bf16 loop (the fp8 loop's plan and a pair's one-row tiles keep one part), only of 16 or 32
    rows."""
    n, k, E = 4096, 6, 384
    b = _plan(monkeypatch, tokens=tokens, bf16=True, tokens2=tokens2)["qgmma"]
    assert b["block_m"] == tokens + tokens2 and b["row_tiles"] == min(n * k, -(-n * k // (tokens + tokens2)) + E)
    assert b["up"]["constexprs"]["TOKENS2"] == b["down"]["constexprs"]["TOKENS2"] == tokens2
    assert b["up"]["constexprs"]["TOKENS"] == tokens
    one = _plan(monkeypatch, tokens=tokens, bf16=True)["qgmma"]
    assert one["up"]["constexprs"]["TOKENS2"] == 0 and one["block_m"] == tokens
    assert (b["up"]["grid_cols"], b["down"]["grid_cols"]) == (one["up"]["grid_cols"], one["down"]["grid_cols"])
    fp8 = _plan(monkeypatch, tokens=tokens, tokens2=tokens2)["qgmma"]
    assert fp8["block_m"] == tokens and fp8["up"]["constexprs"]["TOKENS2"] == 0
    tile = dict(TOKENS=tokens, STAGES=3, num_warps=8, maxnreg=None, BF16=True, TOKENS2=tokens2)
    assert st.plan(n, k, E, 5120, 2304, True, tile)["up"]["constexprs"]["TOKENS2"] == 0
    assert st.plan(n, k, E, 5120, 2304, False, dict(tile, TOKENS2=8)) is None
    assert moe.qgmma_rows(dict(qgmma=True, qgmma_tokens=tokens, qgmma_tokens2=tokens2, qgmma_bf16=True)) == b["block_m"]


@pytest.mark.skipif(not st.AVAILABLE, reason="needs Gluon")
def test_a_short_k_keeps_the_rules_mma_tile(monkeypatch):
    """``qgmma_min_k``: the streamed launches where both D and I reach it; under it the plan is the rule's
    MMA tile's (no qgmma plan), whichever GEMM's K is the short one."""
    def rule(min_k):
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, qgmma_min_k=min_k,
                    **qgmma_knobs(True, 64, 8, 3, qgmma_bf16=True))

    def plan(min_k, D, I):
        monkeypatch.setattr(lin, "INTERPRETED", False)
        tiles = {"experts": [[16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)],
                             [None, rule(min_k)]], "act_dequantized": True}
        with pinned_tiles(moe=tiles), jit_targets.targeting(ARCHS["sm_90"]):
            return moe._plan(512, 4, 32, D, I)

    assert plan(1024, 1024, 1024)["qgmma"] is not None and plan(0, 1024, 512)["qgmma"] is not None
    for D, I in ((1024, 512), (512, 1024)):
        p = plan(1024, D, I)
        assert p["qgmma"] is None and p["block_m"] == 64 and p["up"][0]["BLOCK_M"] == 64


@pytest.mark.skipif(not st.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("tokens,warps,k_major,capped", [(64, 8, True, False), (32, 8, False, False),
                                                        (64, 8, False, True)])
def test_it_compiles_for_sm90_on_the_fp8_warpgroup_mma(tokens, warps, k_major, capped):
    """Capped: one MMA in flight and 128 registers a thread (two programs of 8 warps an SM), the K loop
    without local memory."""
    knobs = dict(inflight=1, maxnreg=128) if capped else {}
    tiles = {"experts": _tiles(tokens, warps, **knobs)["experts"], "act_dequantized": True, "grouped_min_rows": None}
    reports = sm90_compile("moe", "--B", "4096", "--moe-dims", "released", "--tiles", json.dumps(tiles),
                           "--profile-set", "expert_fp4=nibbles", *(["--cold"] if k_major else []))
    for name in ("_up_kernel", "_down_kernel"):
        r = next(r for r in reports if r["kernel"] == name and r["sass"]["QGMMA"])
        assert r["sass"]["HMMA"] == 0 and (r["registers"] <= 128 if capped else r["stack_bytes"] == 0)
        loop = r["mma_loop"]
        assert "LDL" not in loop["opcodes"] and "STL" not in loop["opcodes"]
        assert [lp["count"] for lp in loop["loops"]] == [4]  # one K loop: four wgmma a trip
        # each block's product scaled in fp32: a multiply and an add per accumulator element (a thread's
        # tokens / 2) a block, then the decode, the ring's copies and barriers
        per_block = tokens // 2
        assert loop["opcodes"]["FMUL"] == 4 * per_block and loop["opcodes"]["FFMA"] == 4 * per_block
        assert loop["instructions"] < 8 * per_block + 240


@pytest.mark.skipif(not st.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("tokens,k_major", [(64, True), (32, False)])
def test_the_bf16_loop_compiles_for_sm90_on_the_bf16_warpgroup_mma(tokens, k_major):
    """A trip: eight ``HGMMA`` (two MMAs of 64 K), the decode's 32 bf16x2 multiplies (one a register of two
    codes, the scales folded), no fp32 scaling after the MMA, no local memory, and at most 128 registers
    a thread: two programs of 8 warps an SM."""
    tiles = {"experts": _tiles(tokens, 8, bf16=True)["experts"], "act_dequantized": True, "grouped_min_rows": None}
    reports = sm90_compile("moe", "--B", "4096", "--moe-dims", "released", "--tiles", json.dumps(tiles),
                           "--profile-set", "expert_fp4=nibbles", *(["--cold"] if k_major else []))
    for name in ("_up_kernel", "_down_kernel"):
        r = next(r for r in reports if r["kernel"] == name)
        assert r["sass"]["QGMMA"] == 0 and r["sass"]["HMMA"] == 0 and r["stack_bytes"] == 0 and r["registers"] <= 128
        loop = r["mma_loop"]
        assert [lp["count"] for lp in loop["loops"]] == [8]
        ops_ = loop["opcodes"]
        assert "LDL" not in ops_ and "STL" not in ops_ and "FFMA" not in ops_ and "FMUL" not in ops_
        assert ops_["HMUL2"] == 32 and loop["instructions"] < 260


@pytest.mark.skipif(not st.AVAILABLE, reason="needs Gluon")
@pytest.mark.parametrize("tokens2,stages", [(32, 3), (16, 4)])
def test_the_second_part_compiles_beside_the_first(tokens2, stages):
    """Row tiles of 64 + ``tokens2`` rows: the loop compiled twice (with the second part's MMA and without),
    the one with it at sixteen ``HGMMA`` a trip over the same 32 bf16x2 multiplies of the decode (the
    weights decoded once for both parts) and no local memory, at most 128 registers a thread, and shared
    memory for two programs an SM (228 KB, 1 KB of it each program's; the 4-stage ring of 64 + 16 rows,
    112 KB, fits so only where the compiler lays the epilogue's staging over the ring, as the H200 image's
    Triton 3.6 does)."""
    tiles = {"experts": _tiles(64, 8, stages, maxnreg=128, bf16=True, tokens2=tokens2)["experts"],
             "act_dequantized": True, "grouped_min_rows": None}
    reports = sm90_compile("moe", "--B", "4096", "--moe-dims", "released", "--tiles", json.dumps(tiles),
                           "--profile-set", "expert_fp4=nibbles")
    for name in ("_up_kernel", "_down_kernel"):
        r = next(r for r in reports if r["kernel"] == name)
        ring = stages * (128 * 64 + 2 * 128 * (64 + tokens2))
        two_an_sm = stages == 3 or triton.__version__.startswith("3.6.")
        assert r["sass"]["QGMMA"] == 0 and r["registers"] <= 128 and r["shared_bytes"] >= ring
        assert 2 * (r["shared_bytes"] + 1024) <= 228 * 1024 or not two_an_sm
        loop = r["mma_loop"]
        ops_ = loop["opcodes"]
        # the K loop with the second part (sixteen) and without it (eight)
        assert sorted((lp["count"], lp["instructions"] < 300) for lp in loop["loops"]) == [(8, True), (16, True)]
        assert "LDL" not in ops_ and "STL" not in ops_ and ops_["HMUL2"] == 32 and loop["count"] == 16


def _stack(rng, E, rows, K, k_major=False):
    w = formats.quantize(torch.randn(E, rows, K, generator=rng) * 0.25, "fp4_w")
    return formats.as_expert_stack(w, k_major, False)


def _case(rng, n, D, I, E, k, k_major=False):
    return moe_case(rng, n, D, I, E, k, lambda e, rows, K: _stack(rng, e, rows, K, k_major))


# (tokens, D, I, experts, slots, rows a tile, warps, ring stages, K major, MMAs in flight and register cap)
CASES = [(96, 256, 128, 8, 6, 64, 8, 3, False, (2, None)), (40, 384, 256, 4, 2, 32, 8, 2, True, (2, None)),
         (200, 512, 256, 16, 6, 32, 4, 4, False, (2, None)), (64, 1024, 512, 3, 4, 64, 4, 3, True, (2, None)),
         (130, 256, 384, 12, 6, 64, 8, 4, False, (2, None)), (150, 512, 256, 8, 6, 64, 8, 3, True, (1, 128))]


@pytest.mark.gpu
@pytest.mark.skipif(not QG_GPU, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp8", "bf16"])
@pytest.mark.parametrize("n,D,I,E,k,tokens,warps,stages,k_major,flight", CASES)
def test_against_the_reference_and_the_mma_tile(rng, n, D, I, E, k, tokens, warps, stages, k_major, flight, bf16):
    args = _case(rng, n, D, I, E, k, k_major)
    tiles = _tiles(tokens, warps, stages, inflight=flight[0], maxnreg=flight[1], bf16=bf16)
    with pinned_tiles(moe=tiles):
        p = moe._plan(n, k, E, D, I)
    assert p["qgmma"] is not None and p["qgmma"]["stream"] and p["qgmma"]["bf16"] == bf16
    assert_moe_path_matches(args, tiles, _tiles(on=False))


@pytest.mark.gpu
@pytest.mark.skipif(not QG_GPU, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("n,E,k,tokens,tokens2,stages,k_major", [
    (200, 16, 6, 64, 32, 3, False),  # about 75 rows an expert: most tiles use their second part
    (300, 16, 6, 64, 16, 4, True),  # about 112: a full tile and a second one past it
    (60, 8, 3, 64, 16, 3, False),  # about 22: no second part runs
    (150, 6, 3, 32, 32, 2, True)])  # about 75 over 32 + 32: two or three tiles an expert
def test_the_second_part_against_the_reference_and_the_mma_tile(rng, n, E, k, tokens, tokens2, stages, k_major):
    """Row tiles of ``tokens + tokens2`` rows, the second part's MMA run only where the tile holds rows past
    the first: the experts' output against the reference and the rule's MMA tile, and against the same
    launches without the second part."""
    args = _case(rng, n, 256, 384, E, k, k_major)
    tiles = _tiles(tokens, 8, stages, maxnreg=128, bf16=True, tokens2=tokens2)
    with pinned_tiles(moe=tiles):
        p = moe._plan(n, k, E, 256, 384)
    assert p["qgmma"]["block_m"] == tokens + tokens2 and p["qgmma"]["up"]["constexprs"]["TOKENS2"] == tokens2
    assert_moe_path_matches(args, tiles, _tiles(on=False))
    got, one = run_moe(args, tiles), run_moe(args, _tiles(tokens, 8, stages, maxnreg=128, bf16=True))
    assert rel_err(got, one) < 1e-4  # the same products summed in the same order, whichever part a row is in


@pytest.mark.gpu
@pytest.mark.skipif(not QG_GPU, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("k_major", [False, True])
def test_the_bf16_loop_with_its_scales_unfolded(rng, k_major):
    """No largest scale byte recorded: the decode multiplies by 2**126 itself (the FOLD variant off); the
    weights' scales spread over a wide range of powers of two."""
    import dataclasses

    def stack(E, rows, K):
        spread = 2.0 ** torch.randint(-12, 6, (E, rows, K // 32, 1), generator=rng).float()
        w = (torch.randn(E, rows, K // 32, 32, generator=rng) * spread).reshape(E, rows, K)
        q = formats.as_expert_stack(formats.quantize(w, "fp4_w"), k_major, False)
        return dataclasses.replace(q, scale_max=None)

    args = moe_case(rng, 70, 256, 256, 6, 4, stack)
    assert all(w.scale_max is None for w in args[3:6])
    assert_moe_path_matches(args, _tiles(64, 8, 3, bf16=True), _tiles(on=False))


@pytest.mark.gpu
@pytest.mark.skipif(not QG_GPU, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("n,in_kernel,bf16", [(80, True, False), (80, False, False), (80, True, True)],
                         ids=["fp8-in-kernel", "fp8-apart", "bf16-in-kernel"])
def test_with_the_shared_expert_and_add(rng, n, in_kernel, bf16):
    """The shared expert (fp8_w) on the direct path beside the streamed launches; its row and ``add``
    summed after the routed rows, by the down launch's combine or the combine launch; bf16 out."""
    D, I, E, k = 256, 128, 8, 6
    args = _case(rng, n, D, I, E, k)
    shared = tuple(formats.as_expert_stack(formats.quantize(torch.randn(1, *s, generator=rng) * 0.25, "fp8_w"),
                                           False).to(DEVICE) for s in ((I, D), (I, D), (D, I)))
    add = torch.randn(n, D, generator=rng).to(DEVICE)
    tiles = _tiles(32, 8, 3, bf16=bf16, combine=dict(BLOCK_D=1024, num_warps=4, in_kernel=in_kernel))
    got = run_moe(args, tiles, add=add, out_dtype=torch.bfloat16, shared=shared)
    assert_counters_zero(got)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, add=add, out_dtype=torch.bfloat16, shared=shared)
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want.float()) < 1e-2
