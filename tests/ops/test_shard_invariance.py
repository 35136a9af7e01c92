"""The reference's ops give a tensor-parallel rank's share the bits of one process's whole.

A rank holds ``n_heads / tp`` query heads and the matching input columns of ``wo_b``: its attention
must give each of its heads the bits the whole call gives that head, and the ranks' fp64 partial
sums of ``wo_b`` (``linear`` of an fp64 input keeps the wide accumulation), added up and rounded
once, must give the bits of one process's ``linear``. fp32 partials rounded apart would not: their
sum differs from the whole in the last fp32 bit now and then, and so, rarely, in bf16.
"""
import pytest
import torch

from flashrt import formats, refmath


def attention_inputs(rng, heads: int, B: int = 2, S: int = 29, T: int = 90, K: int = 24, D: int = 64):
    """bf16 queries, an fp8 cache, K distinct slots per position (some empty), fp32 sinks."""
    q = torch.randn(B, S, heads, D, generator=rng).to(torch.bfloat16)
    kv = formats.quantize(torch.randn(B, T, D, generator=rng), "fp8")
    idx = torch.stack([torch.randperm(T, generator=rng)[:K] for _ in range(B * S)]).view(B, S, K)
    idx = torch.where(torch.rand(B, S, K, generator=rng) < 0.1, -1, idx).to(torch.int32)
    return q, kv, idx, torch.randn(heads, generator=rng)


def test_sparse_attention_heads_are_independent(rng):
    q, kv, idx, sink = attention_inputs(rng, heads=8)
    whole = refmath.sparse_attention(q, kv, idx, sink, 0.125)
    for n in (1, 2, 4):  # the heads of one rank at tp = 8, 4, 2
        for a in range(0, 8, n):
            got = refmath.sparse_attention(q[:, :, a:a + n], kv, idx, sink[a:a + n], 0.125)
            assert torch.equal(got, whole[:, :, a:a + n]), f"heads [{a}, {a + n}) differ from the whole call"


def test_fp64_input_keeps_the_wide_accumulation(rng):
    x = torch.randn(5, 96, generator=rng).to(torch.bfloat16)
    w = formats.quantize(torch.randn(40, 96, generator=rng) * 0.05, "fp8_w")
    xq = formats.dequantize(formats.quantize(x, "fp8")).double()
    got = refmath.linear(x.double(), w)
    assert got.dtype == torch.float64
    assert torch.equal(got, xq @ refmath.dequantized_weight(w).double().T)
    assert torch.equal(got.float().to(x.dtype), refmath.linear(x, w))


@pytest.mark.parametrize("tp", [2, 4])
def test_column_shards_sum_to_the_whole(rng, tp):
    """``wo_b`` of a bf16 input cut into ``tp`` column shards of whole 32-wide blocks: the fp64
    partials' sum, rounded to fp32 then bf16, is one process's result (4k rows, 128 outputs)."""
    K = 256
    x = torch.randn(4096, K, generator=rng).to(torch.bfloat16)
    dense = torch.randn(128, K, generator=rng) * 0.05
    whole = refmath.linear(x, formats.quantize(dense, "fp8_w"))
    cols = K // tp
    shards = [formats.quantize(dense[:, r * cols:(r + 1) * cols].contiguous(), "fp8_w") for r in range(tp)]
    for r, shard in enumerate(shards):  # each shard holds the whole weight's values
        assert torch.equal(refmath.dequantized_weight(shard),
                           refmath.dequantized_weight(formats.quantize(dense, "fp8_w"))[:, r * cols:(r + 1) * cols])
    total = sum(refmath.linear(x[:, r * cols:(r + 1) * cols].double(), shards[r]) for r in range(tp))
    assert torch.equal(total.float().to(x.dtype), whole)
