"""``flashrt.ops.sparse_attention`` against an independent float64 loop over rows and slots.

The expected values are computed here, one (batch, position, head) row at a time, straight from
the formula of docs/ops.md; the reference backend is never called directly. Quantized ``kv`` is
compared against the same loop over ``flashrt.formats.dequantize(kv)``.
"""
from __future__ import annotations

import math

import pytest
import torch

import flashrt
from flashrt import formats, ops
from flashrt.formats import QTensor
from kernel_check import assert_error

# ---------------------------------------------------------------------------------------------
# helpers


def expected_attention(q, kv, indices, sink, scale) -> torch.Tensor:
    """float64 [B, S, H, D]: the docs/ops.md formula, one row and one slot at a time."""
    segments = kv if isinstance(kv, tuple) else (kv,)  # a tuple stands for its concatenation along T
    kvd = torch.cat([(formats.dequantize(x) if isinstance(x, QTensor) else x).to(torch.float64) for x in segments], 1)
    qd = q.to(torch.float64)
    B, S, H, D = q.shape
    out = torch.zeros(B, S, H, D, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            slots = [j for j in indices[b, s].tolist() if j != -1]
            for h in range(H):
                logits = [scale * float(torch.dot(qd[b, s, h], kvd[b, j])) for j in slots]
                sk = None if sink is None else float(sink[h])
                cands = logits + ([sk] if sk is not None else [])
                if not cands:
                    continue  # no valid slot, no sink: zeros
                m = max(cands)
                w = [math.exp(l - m) for l in logits]
                denom = sum(w) + (math.exp(sk - m) if sk is not None else 0.0)
                acc = torch.zeros(D, dtype=torch.float64)
                for wj, j in zip(w, slots):
                    acc += wj * kvd[b, j]
                out[b, s, h] = acc / denom
    return out


def random_indices(B, S, K, T, g, p_empty=0.25, p_all_empty_row=0.0) -> torch.Tensor:
    """int32 [B, S, K] in [-1, T), duplicates allowed, some -1 slots, maybe whole -1 rows."""
    idx = torch.randint(0, T, (B, S, K), generator=g)
    idx[torch.rand(B, S, K, generator=g) < p_empty] = -1
    if p_all_empty_row:
        idx[torch.rand(B, S, generator=g) < p_all_empty_row] = -1
    return idx.to(torch.int32)


def plain_inputs(B, S, H, D, T, K, g, **idx_kw):
    """fp32 randn q [B, S, H, D] and kv [B, T, D], then random_indices(B, S, K, T, g, **idx_kw)."""
    q = torch.randn(B, S, H, D, generator=g)
    kv = torch.randn(B, T, D, generator=g)
    return q, kv, random_indices(B, S, K, T, g, **idx_kw)


def check_close(out, want, dtype):
    assert out.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), want.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
    elif dtype == torch.float16:
        torch.testing.assert_close(out.double(), want.to(torch.float16).double(), rtol=2e-3, atol=2e-3)
    else:  # fp32 math, fp32 / fp64 output
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# plain kv

SHAPES = [  # B, S, H, D, T, K
    (1, 1, 1, 16, 1, 1),
    (1, 3, 2, 32, 37, 8),
    (2, 5, 5, 64, 37, 7),
    (3, 2, 3, 96, 19, 5),
    (2, 4, 1, 16, 5, 12),  # K > T: duplicates for sure
    (3, 1, 4, 32, 64, 33),
]


@pytest.mark.parametrize("B,S,H,D,T,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sink", [False, True])
def test_plain_kv_matches_loop(B, S, H, D, T, K, dtype, with_sink, rng):
    g = rng
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    kv = torch.randn(B, T, D, generator=g).to(dtype)
    idx = random_indices(B, S, K, T, g, p_all_empty_row=0.2)
    sink = torch.randn(H, generator=g) if with_sink else None
    scale = D**-0.5
    out = ops.sparse_attention(q, kv, idx, sink, scale)
    assert out.shape == (B, S, H, D) and out.device == q.device
    check_close(out, expected_attention(q, kv, idx, sink, scale), dtype)


@pytest.mark.parametrize("q_dtype,kv_dtype", [
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16), (torch.float64, torch.float64),
])
def test_mixed_and_other_float_dtypes(q_dtype, kv_dtype, rng):
    g = rng
    B, S, H, D, T, K = 2, 3, 4, 32, 37, 9
    q = torch.randn(B, S, H, D, generator=g).to(q_dtype)
    kv = torch.randn(B, T, D, generator=g).to(kv_dtype)
    idx = random_indices(B, S, K, T, g)
    sink = torch.randn(H, generator=g)
    out = ops.sparse_attention(q, kv, idx, sink, 0.2)
    check_close(out, expected_attention(q, kv, idx, sink, 0.2), q_dtype)


@pytest.mark.parametrize("scale", [0.0, 1.0, 8.0, -0.5])
def test_scales_incl_large_logits(scale, rng):
    """Large logits must not overflow (max subtraction); scale 0 is a plain average."""
    g = rng
    B, S, H, D, T, K = 2, 3, 3, 64, 37, 10
    q, kv, idx = plain_inputs(B, S, H, D, T, K, g)
    q = q * 3
    sink = torch.randn(H, generator=g)
    out = ops.sparse_attention(q, kv, idx, sink, scale)
    assert torch.isfinite(out).all()
    # logits up to ~ 8 * 3 * 64 = O(1e3): the fp32 logit error grows with them
    rtol = 1e-5 if abs(scale) <= 1 else 1e-3
    torch.testing.assert_close(out.double(), expected_attention(q, kv, idx, sink, scale), rtol=rtol, atol=rtol)


def test_sink_dominates_and_is_negligible(rng):
    g = rng
    B, S, H, D, T, K = 1, 2, 3, 16, 9, 4
    q, kv, idx = plain_inputs(B, S, H, D, T, K, g, p_empty=0.0)
    sink = torch.tensor([200.0, -200.0, 0.0])
    out = ops.sparse_attention(q, kv, idx, sink, 0.25)
    want = expected_attention(q, kv, idx, sink, 0.25)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    assert out[..., 0, :].abs().max() < 1e-30  # the huge sink takes all the mass
    no_sink = ops.sparse_attention(q, kv, idx, None, 0.25)
    torch.testing.assert_close(out[..., 1, :], no_sink[..., 1, :], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# quantized kv


@pytest.mark.parametrize("fmt,D", [
    ("fp8", 32), ("fp8", 96), ("fp4_b16", 16), ("fp4_b16", 64), ("fp4_b16", 96), ("fp4_b32", 32), ("fp4_b32", 64),
])
@pytest.mark.parametrize("with_sink", [False, True])
def test_quantized_kv_matches_loop_over_dequantized(fmt, D, with_sink, rng):
    g = rng
    B, S, H, T, K = 2, 3, 5, 37, 11
    q = torch.randn(B, S, H, D, generator=g).to(torch.bfloat16)
    kv = ops.quantize(torch.randn(B, T, D, generator=g) * 2, fmt)
    assert isinstance(kv, QTensor) and kv.fmt == fmt
    idx = random_indices(B, S, K, T, g, p_all_empty_row=0.2)
    sink = torch.randn(H, generator=g) if with_sink else None
    out = ops.sparse_attention(q, kv, idx, sink, D**-0.5)
    check_close(out, expected_attention(q, kv, idx, sink, D**-0.5), torch.bfloat16)
    # same as attending over the dequantized cache as a plain fp32 tensor
    plain = ops.sparse_attention(q, formats.dequantize(kv), idx, sink, D**-0.5)
    torch.testing.assert_close(out.double(), plain.double(), rtol=1e-2, atol=1e-2)


def test_quantized_kv_fp32_output_is_tight(rng):
    g = rng
    B, S, H, D, T, K = 3, 2, 2, 64, 37, 6
    q = torch.randn(B, S, H, D, generator=g)
    kv = ops.quantize(torch.randn(B, T, D, generator=g), "fp4_b16")
    idx = random_indices(B, S, K, T, g)
    sink = torch.randn(H, generator=g)
    out = ops.sparse_attention(q, kv, idx, sink, 0.125)
    check_close(out, expected_attention(q, kv, idx, sink, 0.125), torch.float32)


# ---------------------------------------------------------------------------------------------
# kv as a tuple of segments (window ring, chunk, compressed cache), standing for their concatenation


@pytest.mark.parametrize("layout", [
    (("plain", 5), ("fp8", 11), ("fp4_b16", 21)),
    (("fp8", 0), ("plain", 3), ("fp4_b16", 0), ("fp8", 34)),  # empty segments
    (("bf16", 37),),  # a single segment
    (("fp4_b16", 1), ("fp4_b16", 1), ("plain", 1)),
])
@pytest.mark.parametrize("with_sink", [False, True])
def test_segmented_kv_matches_loop_over_concatenation(layout, with_sink, rng):
    g = rng
    B, S, H, D, K = 2, 3, 4, 32, 9
    segs = []
    for kind, n in layout:
        x = torch.randn(B, n, D, generator=g)
        segs.append(x if kind == "plain" else x.to(torch.bfloat16) if kind == "bf16" else ops.quantize(x, kind))
    segs = tuple(segs)
    T = sum(n for _, n in layout)
    q = torch.randn(B, S, H, D, generator=g)
    idx = random_indices(B, S, K, T, g, p_all_empty_row=0.2)
    sink = torch.randn(H, generator=g) if with_sink else None
    out = ops.sparse_attention(q, segs, idx, sink, 0.2)
    want = expected_attention(q, segs, idx, sink, 0.2)
    check_close(out, want, torch.float32)
    # a list works as well as a tuple, and gives what the concatenated plain cache gives
    assert torch.equal(ops.sparse_attention(q, list(segs), idx, sink, 0.2), out)
    whole = torch.cat([formats.dequantize(x) if isinstance(x, QTensor) else x.float() for x in segs], 1)
    torch.testing.assert_close(ops.sparse_attention(q, whole, idx, sink, 0.2), out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("split", [0, 4, 9])
def test_indices_in_parts_match_loop_over_concatenation(split, rng):
    """``indices`` as a tuple of ``[B, S, K_i]`` parts (the window's, the picks) stands for their
    concatenation along K: the float64 loop over the concatenated indices, and the same bits as
    passing the concatenation (a part may be empty)."""
    g = rng
    B, S, H, D, K, T = 2, 3, 4, 32, 9, 30
    segs = (torch.randn(B, 10, D, generator=g), ops.quantize(torch.randn(B, T - 10, D, generator=g), "fp8"))
    q, sink = torch.randn(B, S, H, D, generator=g), torch.randn(H, generator=g)
    idx = random_indices(B, S, K, T, g, p_all_empty_row=0.2)
    parts = (idx[..., :split].contiguous(), idx[..., split:].contiguous())
    out = ops.sparse_attention(q, segs, parts, sink, 0.2)
    check_close(out, expected_attention(q, segs, idx, sink, 0.2), torch.float32)
    assert torch.equal(out, ops.sparse_attention(q, segs, idx, sink, 0.2))
    three = (idx[..., :2], idx[..., 2:5], idx[..., 5:])
    assert torch.equal(ops.sparse_attention(q, segs, list(three), sink, 0.2), out)


def test_bad_index_parts():
    q, kv, idx, sink = _good()
    assert_error(lambda: ops.sparse_attention(q, kv, (), sink, 0.1), "indices", "at least one")
    assert_error(lambda: ops.sparse_attention(q, kv, (idx, idx[:, :2]), sink, 0.1), "indices[1]", "S=3")
    assert_error(lambda: ops.sparse_attention(q, kv, (idx, idx.long()), sink, 0.1), "indices[1]", "torch.int64")
    high = idx.clone()
    high[1, 2, 3] = 37  # == T
    assert_error(lambda: ops.sparse_attention(q, kv, (idx, high), sink, 0.1), "indices[1]", "[-1, 37)")


def test_segmented_kv_empty_and_bad():
    q = torch.randn(2, 3, 4, 32)
    a, b = torch.randn(2, 5, 32), ops.quantize(torch.randn(2, 7, 32), "fp8")
    idx = torch.randint(-1, 12, (2, 3, 5), dtype=torch.int32)
    ops.sparse_attention(q, (a, b), idx, None, 0.1)
    # all segments empty: zeros
    empty = (torch.randn(2, 0, 32), ops.quantize(torch.randn(2, 0, 32), "fp4_b16"))
    out = ops.sparse_attention(q, empty, torch.full((2, 3, 4), -1, dtype=torch.int32), torch.randn(4), 0.1)
    assert (out == 0).all()
    with pytest.raises(ValueError, match=r"^kv\b.*segment"):
        ops.sparse_attention(q, (), idx, None, 0.1)
    assert_error(lambda: ops.sparse_attention(q, (a, torch.randn(2, 7, 16)), idx, None, 0.1), "kv[1]", "D=32", "(2, 7, 16)")
    assert_error(lambda: ops.sparse_attention(q, (a[:1].expand(3, 5, 32), b), idx, None, 0.1), "kv[0]", "B=2",
                 "(3, 5, 32)")
    # a segment with batch 1 is shared by every row: the same as repeating it
    shared = ops.sparse_attention(q, (a[:1], b), idx, None, 0.1)
    assert torch.equal(shared, ops.sparse_attention(q, (a[:1].expand(2, 5, 32), b), idx, None, 0.1))
    assert_error(lambda: ops.sparse_attention(q, (a, ops.quantize(torch.randn(2, 7, 32), "fp8_w")), idx, None, 0.1),
                 "kv[1]", "fp8_w")
    for bad in ([[1.0]], torch.tensor(1.0)):  # not a tensor, a 0-dim tensor: a ValueError naming the segment
        with pytest.raises(ValueError, match=r"^kv\[1\]"):
            ops.sparse_attention(q, (a, bad), idx, None, 0.1)
    high = idx.clone()
    high[0, 0, 0] = 12  # == T_0 + T_1
    assert_error(lambda: ops.sparse_attention(q, (a, b), high, None, 0.1), "indices", "[-1, 12)", "12]")


# ---------------------------------------------------------------------------------------------
# slot semantics


@pytest.mark.parametrize("kv_kind", ["fp32", "fp8"])
def test_all_empty_rows_give_zeros_with_and_without_sink(kv_kind, rng):
    g = rng
    B, S, H, D, T, K = 2, 3, 4, 32, 7, 5
    q = torch.randn(B, S, H, D, generator=g)
    kvf = torch.randn(B, T, D, generator=g)
    kv = kvf if kv_kind == "fp32" else ops.quantize(kvf, "fp8")
    idx = torch.full((B, S, K), -1, dtype=torch.int32)
    idx[0, 1, 2] = 3  # one row with one valid slot among empty ones
    for sink in (None, torch.randn(H, generator=g), torch.full((H,), 50.0)):
        out = ops.sparse_attention(q, kv, idx, sink, 0.3)
        assert torch.isfinite(out).all()
        empty = torch.ones(B, S, dtype=torch.bool)
        empty[0, 1] = False
        assert (out[empty] == 0).all()
        torch.testing.assert_close(out.double(), expected_attention(q, kv, idx, sink, 0.3), rtol=1e-5, atol=1e-6)
    # a single valid slot and no sink returns that row exactly (softmax of one logit is 1)
    out = ops.sparse_attention(q, kv, idx, None, 0.3)
    row = (kvf if kv_kind == "fp32" else formats.dequantize(kv))[0, 3]
    torch.testing.assert_close(out[0, 1], row.expand(H, D), rtol=1e-6, atol=1e-7)


def test_zero_slots_give_zeros():
    """K == 0: no valid slot at all; zeros without a sink and (numerator 0) with one."""
    q = torch.randn(2, 3, 2, 16)
    kv = torch.randn(2, 5, 16)
    idx = torch.zeros(2, 3, 0, dtype=torch.int32)
    for sink in (None, torch.randn(2)):
        out = ops.sparse_attention(q, kv, idx, sink, 0.25)
        assert out.shape == (2, 3, 2, 16) and (out == 0).all()


@pytest.mark.parametrize("fmt", [None, "fp8", "fp4_b16"])
def test_empty_cache_gives_zeros(fmt):
    """T == 0 (e.g. a compressed cache before its first entry): every slot is -1."""
    q = torch.randn(2, 3, 2, 32).to(torch.bfloat16)
    kv = torch.randn(2, 0, 32)
    if fmt is not None:
        kv = ops.quantize(kv, fmt)
    for K in (0, 4):
        idx = torch.full((2, 3, K), -1, dtype=torch.int32)
        for sink in (None, torch.randn(2)):
            out = ops.sparse_attention(q, kv, idx, sink, 0.2)
            assert out.shape == q.shape and out.dtype == q.dtype and (out == 0).all()
    assert_error(lambda: ops.sparse_attention(q, kv, torch.zeros(2, 3, 1, dtype=torch.int32), None, 0.2),
                 "indices", "[-1, 0)")


@pytest.mark.parametrize("with_sink", [False, True])
def test_order_irrelevant(with_sink, rng):
    g = rng
    B, S, H, D, T, K = 3, 4, 3, 32, 37, 13
    q, kv, idx = plain_inputs(B, S, H, D, T, K, g)
    sink = torch.randn(H, generator=g) if with_sink else None
    out = ops.sparse_attention(q, kv, idx, sink, 0.2)
    for _ in range(3):
        perm = torch.argsort(torch.rand(B, S, K, generator=g), dim=-1)
        shuffled = idx.gather(-1, perm)
        assert not torch.equal(shuffled, idx) or K == 1
        torch.testing.assert_close(ops.sparse_attention(q, kv, shuffled, sink, 0.2), out, rtol=1e-6, atol=1e-6)
    # -1 slots moved to the front / back change nothing either
    ordered = torch.sort(idx, dim=-1).values
    torch.testing.assert_close(ops.sparse_attention(q, kv, ordered, sink, 0.2), out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_sink", [False, True])
def test_duplicate_indices_each_count(with_sink, rng):
    g = rng
    B, S, H, D, T = 1, 1, 2, 16, 4
    q = torch.randn(B, S, H, D, generator=g)
    kv = torch.randn(B, T, D, generator=g)
    sink = torch.randn(H, generator=g) if with_sink else None
    once = torch.tensor([[[0, 2, -1]]], dtype=torch.int32)
    twice = torch.tensor([[[0, 2, 2]]], dtype=torch.int32)
    out1 = ops.sparse_attention(q, kv, once, sink, 0.5)
    out2 = ops.sparse_attention(q, kv, twice, sink, 0.5)
    torch.testing.assert_close(out2.double(), expected_attention(q, kv, twice, sink, 0.5), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out1, out2)  # the second copy of slot 2 doubles its weight
    # by hand: weights e^{l0} and 2 e^{l2}
    l0 = 0.5 * (q[0, 0].double() @ kv[0, 0].double())
    l2 = 0.5 * (q[0, 0].double() @ kv[0, 2].double())
    den = l0.exp() + 2 * l2.exp() + (sink.double().exp() if with_sink else 0)
    want = (l0.exp()[:, None] * kv[0, 0].double() + 2 * l2.exp()[:, None] * kv[0, 2].double()) / den[:, None]
    torch.testing.assert_close(out2[0, 0].double(), want, rtol=1e-5, atol=1e-6)
    # all slots the same row, no sink: exactly that row
    same = torch.full((1, 1, 5), 3, dtype=torch.int32)
    torch.testing.assert_close(ops.sparse_attention(q, kv, same, None, 0.5)[0, 0], kv[0, 3].expand(H, D),
                               rtol=1e-6, atol=1e-7)


def test_batches_are_independent(rng):
    """Each batch reads only its own kv rows."""
    g = rng
    B, S, H, D, T, K = 3, 2, 2, 16, 6, 4
    q, kv, idx = plain_inputs(B, S, H, D, T, K, g, p_empty=0.0)
    out = ops.sparse_attention(q, kv, idx, None, 0.3)
    for b in range(B):
        one = ops.sparse_attention(q[b : b + 1], kv[b : b + 1], idx[b : b + 1], None, 0.3)
        torch.testing.assert_close(out[b : b + 1], one, rtol=1e-6, atol=1e-7)


def test_noncontiguous_inputs_and_no_mutation(rng):
    g = rng
    B, S, H, D, T, K = 2, 3, 4, 32, 11, 5
    q = torch.randn(B, H, S, D, generator=g).transpose(1, 2)  # [B, S, H, D] view
    kv = torch.randn(B, D, T, generator=g).transpose(1, 2)  # [B, T, D] view
    idx = random_indices(B, S, 2 * K, T, g)[..., ::2]
    sink = torch.randn(H, generator=g)
    before = [t.clone() for t in (q, kv, idx, sink)]
    out = ops.sparse_attention(q, kv, idx, sink, 0.2)
    for t, b in zip((q, kv, idx, sink), before):
        assert torch.equal(t, b)
    check_close(out, expected_attention(q, kv, idx, sink, 0.2), torch.float32)


# ---------------------------------------------------------------------------------------------
# bad inputs


def _good():
    q = torch.randn(2, 3, 4, 32)
    kv = torch.randn(2, 37, 32)
    idx = torch.randint(-1, 37, (2, 3, 5), dtype=torch.int32)
    sink = torch.randn(4)
    return q, kv, idx, sink


def test_good_inputs_pass():
    out = ops.sparse_attention(*_good(), 0.1)
    assert out.shape == (2, 3, 4, 32) and out.dtype == torch.float32


def test_bad_q():
    q, kv, idx, sink = _good()
    assert_error(lambda: ops.sparse_attention(q[0], kv, idx, sink, 0.1), "q", "4 dims", "(3, 4, 32)")
    assert_error(lambda: ops.sparse_attention(q[None], kv, idx, sink, 0.1), "q", "4 dims")
    assert_error(lambda: ops.sparse_attention(q.to(torch.int32), kv, idx, sink, 0.1), "q", "torch.int32")
    assert_error(lambda: ops.sparse_attention(q.numpy(), kv, idx, sink, 0.1), "q", "ndarray")


def test_bad_kv():
    q, kv, idx, sink = _good()
    assert_error(lambda: ops.sparse_attention(q, kv[..., :16], idx, sink, 0.1), "kv", "D=32", "(2, 37, 16)")
    assert_error(lambda: ops.sparse_attention(q, kv[:1], idx, sink, 0.1), "kv", "B=2", "(1, 37, 32)")
    assert_error(lambda: ops.sparse_attention(q, kv[0], idx, sink, 0.1), "kv", "3 dims", "(37, 32)")
    assert_error(lambda: ops.sparse_attention(q, kv.to(torch.int8), idx, sink, 0.1), "kv", "torch.int8")
    # quantized with the wrong D, or in a weight format
    assert_error(lambda: ops.sparse_attention(q, ops.quantize(torch.randn(2, 37, 64), "fp8"), idx, sink, 0.1),
                 "kv", "D=32", "(2, 37, 64)")
    assert_error(lambda: ops.sparse_attention(q, ops.quantize(kv, "fp4_w"), idx, sink, 0.1), "kv", "fp4_w")
    # a QTensor whose data does not match its logical shape
    good = ops.quantize(kv, "fp8")
    broken = QTensor(good.data[:, :10], good.scale, "fp8", good.shape)
    assert_error(lambda: ops.sparse_attention(q, broken, idx, sink, 0.1), "kv.data", "(2, 37, 32)", "(2, 10, 32)")


def test_bad_indices():
    q, kv, idx, sink = _good()
    assert_error(lambda: ops.sparse_attention(q, kv, idx.long(), sink, 0.1), "indices", "torch.int32", "torch.int64")
    assert_error(lambda: ops.sparse_attention(q, kv, idx.float(), sink, 0.1), "indices", "torch.float32")
    assert_error(lambda: ops.sparse_attention(q, kv, idx[:, :2], sink, 0.1), "indices", "S=3", "(2, 2, 5)")
    assert_error(lambda: ops.sparse_attention(q, kv, idx[:1], sink, 0.1), "indices", "B=2")
    assert_error(lambda: ops.sparse_attention(q, kv, idx[..., 0], sink, 0.1), "indices", "3 dims")
    high = idx.clone()
    high[1, 2, 3] = 37  # == T
    assert_error(lambda: ops.sparse_attention(q, kv, high, sink, 0.1), "indices", "[-1, 37)", "37]")
    low = idx.clone()
    low[0, 0, 0] = -2
    assert_error(lambda: ops.sparse_attention(q, kv, low, sink, 0.1), "indices", "[-1, 37)", "[-2,")
    # the same holds for a quantized kv (T from its logical shape)
    assert_error(lambda: ops.sparse_attention(q, ops.quantize(kv, "fp4_b16"), high, sink, 0.1), "indices", "37")
    # and value checks can be switched off for hot loops (no error raised by the contract)
    with flashrt.value_checks(False):
        ops.sparse_attention(q, kv, idx, sink, 0.1)


def test_bad_sink_and_scale():
    q, kv, idx, sink = _good()
    assert_error(lambda: ops.sparse_attention(q, kv, idx, torch.randn(5), 0.1), "sink", "H=4", "(5,)")
    assert_error(lambda: ops.sparse_attention(q, kv, idx, torch.randn(1, 4), 0.1), "sink", "1 dims", "(1, 4)")
    assert_error(lambda: ops.sparse_attention(q, kv, idx, sink.to(torch.bfloat16), 0.1), "sink", "torch.bfloat16")
    assert_error(lambda: ops.sparse_attention(q, kv, idx, [0.0] * 4, 0.1), "sink", "list")
    assert_error(lambda: ops.sparse_attention(q, kv, idx, sink, "0.1"), "scale", "str")
    assert_error(lambda: ops.sparse_attention(q, kv, idx, sink, None), "scale", "NoneType")
