"""Trace backend: shape-only calls on meta tensors, recorded with hand-computed FLOPs and bytes."""
import pytest
import torch

from flashrt import dispatch, ops
from flashrt.backends import trace
from flashrt.formats import QTensor


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_sequence_of_calls_hand_counted():
    x = meta(2, 3, 64)
    with trace.record() as graph:
        h = ops.rms_norm(x, meta(64), 1e-6)
        y = ops.linear(h, meta(128, 64))
        q = ops.quantize(y, "fp8")
        kv = QTensor(meta(1, 10, 32, dtype=torch.uint8), meta(1, 10, 4, dtype=torch.float8_e4m3fn),
                     "fp4_b16", (1, 10, 64))
        o = ops.sparse_attention(meta(1, 2, 4, 64), kv, meta(1, 2, 3, dtype=torch.int32),
                                 meta(4, dtype=torch.float32), 0.125)
        w, idx = ops.moe_route(meta(5, 16, dtype=torch.float32), meta(8, 16, dtype=torch.float32),
                               meta(8, dtype=torch.float32), 2, "sqrtsoftplus", True, 1.5)
        ops.rms_norm(x, meta(64), 1e-6)

    assert [c.op for c in graph.calls] == ["rms_norm", "linear", "quantize", "sparse_attention", "moe_route", "rms_norm"]
    assert h.device.type == "meta" and h.shape == (2, 3, 64) and h.dtype == torch.bfloat16
    assert y.shape == (2, 3, 128)
    assert q.data.shape == (2, 3, 128) and q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (2, 3, 4)
    assert o.shape == (1, 2, 4, 64) and w.shape == idx.shape == (5, 2) and idx.dtype == torch.int32

    # (flops, bytes read, bytes written), counted by hand:
    expected = [
        (4 * 384, 768 + 128, 768),                      # rms_norm: 384 bf16 elements + 64 weights
        (2 * 6 * 64 * 128, 768 + 128 * 64 * 2, 1536),   # linear: M=6, in 64, out 128
        (3 * 768, 1536, 768 + 24),                      # quantize: fp8 data + 24 UE8M0 scales
        (4 * 2 * 4 * 3 * 64, 1024 + 24 + 16 + 6 * 36, 1024),  # 6 gathered rows of 32 + 4 bytes
        (2 * 5 * 16 * 8 + 3 * 5 * 8, 320 + 512 + 32, 40 + 40),
        (4 * 384, 768 + 128, 768),
    ]
    got = [(c.flops, c.bytes_read, c.bytes_written) for c in graph.calls]
    assert got == expected

    totals = graph.totals()
    assert totals["rms_norm"].calls == 2 and totals["rms_norm"].flops == 2 * 1536
    total = graph.total()
    assert total.flops == sum(e[0] for e in expected)
    assert total.bytes_read == sum(e[1] for e in expected)
    assert total.bytes_written == sum(e[2] for e in expected)
    assert graph.calls[3].inputs[1].dtype == "fp4_b16" and graph.calls[3].inputs[1].nbytes == 360


def test_meta_goes_to_trace_and_nothing_recorded_outside():
    assert dispatch.chain("linear", "meta")[0] == "trace"
    with trace.record() as graph:
        pass
    out = ops.linear(meta(4, 32), meta(16, 32))
    assert out.shape == (4, 16) and len(graph) == 0


def test_trace_validates_like_every_backend():
    with pytest.raises(ValueError, match="weight"):
        ops.linear(meta(4, 32), meta(16, 31))


@pytest.mark.parametrize("op,args,shapes", [
    ("index_scores", (meta(2, 3, 4, 16), meta(2, 9, 16), meta(2, 3, 4, dtype=torch.float32),
                      meta(2, 3, dtype=torch.int32)), [(2, 3, 9)]),
    ("topk_positions", (meta(2, 3, 9, dtype=torch.float32), 20), [(2, 3, 9)]),
    ("hc_coefficients", (meta(1, 2, 4, 8), meta(24, 32, dtype=torch.float32), meta(3, dtype=torch.float32),
                         meta(24, dtype=torch.float32), 20, 1e-6, 1e-6), [(1, 2, 4), (1, 2, 4), (1, 2, 4, 4)]),
    ("engram_lookup", (QTensor(meta(50, 64, dtype=torch.float8_e4m3fn), meta(50, 2, dtype=torch.float8_e8m0fnu),
                               "fp8", (50, 64)), meta(1, 3, 24, dtype=torch.int64)), [(1, 3, 24, 64)]),
    ("moe_experts", (meta(5, 32), meta(5, 2, dtype=torch.float32), meta(5, 2, dtype=torch.int32),
                     meta(4, 16, 32), meta(4, 16, 32), meta(4, 32, 16), 10.0), [(5, 32)]),
    ("sample", (meta(3, 100, dtype=torch.float32), 0.7), [(3,)]),
])
def test_output_shapes(op, args, shapes):
    with trace.record() as graph:
        out = getattr(ops, op)(*args)
    outs = out if isinstance(out, tuple) else (out,)
    assert [tuple(o.shape) for o in outs] == shapes
    assert len(graph) == 1 and graph.calls[0].op == op


def test_moe_experts_reads_only_used_experts():
    w1 = meta(64, 16, 32)
    with trace.record() as graph:
        ops.moe_experts(meta(1, 32), meta(1, 2, dtype=torch.float32), meta(1, 2, dtype=torch.int32),
                        w1, w1, meta(64, 32, 16), 0.0)
    per_expert = 3 * 16 * 32 * 2
    assert graph.calls[0].bytes_read == 64 + 8 + 8 + 2 * per_expert
    assert graph.calls[0].flops == 2 * (6 * 32 * 16 + 4 * 16)
