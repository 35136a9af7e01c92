"""The emulated torch_npu operators against their documentation, computed independently here.

The Ascend backend tests trust the emulation's math; these tests hold the operators the backend
maps onto (MoE dispatch / combine, clipped SwiGLU, sparse row gather) to the documented formulas,
written as plain loops, and check that documented constraint violations are rejected.
"""
import pytest
import torch
import torch.nn.functional as F

from ascend_helpers import npu_emulation  # noqa: F401


def test_init_routing_v2_sorts_pairs_by_expert_stably(npu_emulation, rng):
    N, K, E, H = 7, 3, 5, 8
    x = torch.randn(N, H, generator=rng)
    idx = torch.randint(0, E, (N, K), generator=rng, dtype=torch.int32)
    out, row_idx, counts, _ = npu_emulation.npu_moe_init_routing_v2(
        x, idx, active_num=N * K, expert_num=E, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[0, E])
    order = [(e, n * K + j) for e in range(E) for n in range(N) for j in range(K) if idx[n, j] == e]
    for dst, (_, src) in enumerate(order):  # expert ascending, then source pair n * K + j ascending
        assert row_idx[src] == dst and torch.equal(out[dst], x[src // K])
    assert counts.tolist() == [sum(1 for e, _ in order if e == i) for i in range(E)] and counts.dtype == torch.int64


def test_init_routing_v2_active_range_and_constraints(npu_emulation, rng):
    N, K, E = 6, 2, 4
    x, idx = torch.randn(N, 16, generator=rng), torch.randint(0, E, (N, K), generator=rng, dtype=torch.int32)
    kw = dict(expert_num=E, expert_tokens_num_type=1, expert_tokens_num_flag=True)
    out, row_idx, counts, _ = npu_emulation.npu_moe_init_routing_v2(x, idx, active_expert_range=[1, 3], **kw)
    inside = (idx >= 1) & (idx < 3)
    assert ((row_idx.view(N, K) >= 0) == inside).all() and counts.tolist() == [int((idx == 1).sum()), int((idx == 2).sum())]
    assert torch.isnan(out[int(inside.sum()):]).all()  # rows past the valid ones are undefined
    with pytest.raises(RuntimeError, match="expert ids"):
        npu_emulation.npu_moe_init_routing_v2(x, idx + E, **kw)
    with pytest.raises(RuntimeError, match="non-quantized"):
        npu_emulation.npu_moe_init_routing_v2(x, idx, quant_mode=1, **kw)


@pytest.mark.parametrize("drop_pad_mode", [0, 2])
@pytest.mark.parametrize("with_extras", [False, True])
def test_finalize_routing_sums_each_rows_k_results(npu_emulation, rng, drop_pad_mode, with_extras):
    N, K, H, E = 5, 3, 8, 4
    rows = torch.randn(N * K, H, generator=rng)
    src = torch.randperm(N * K, generator=rng).to(torch.int32)
    scales = torch.rand(N, K, generator=rng) if with_extras else None
    skip1, skip2 = (torch.randn(N, H, generator=rng), torch.randn(N, H, generator=rng)) if with_extras else (None, None)
    bias = torch.randn(E, H, generator=rng) if with_extras else None
    experts = torch.randint(0, E, (N, K), generator=rng, dtype=torch.int32) if with_extras else None
    got = npu_emulation.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src, experts,
                                                 drop_pad_mode=drop_pad_mode, k=K)
    for i in range(N):
        want = skip1[i] + skip2[i] if with_extras else torch.zeros(H)
        for j in range(K):
            r = rows[src[j * N + i] if drop_pad_mode == 0 else src[i * K + j]]
            want = want + (scales[i, j] * (r + bias[experts[i, j]]) if with_extras else r)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="skip1 and skip2"):
        npu_emulation.npu_moe_finalize_routing(rows, torch.zeros(N, H), None, None, None, src, None, k=K)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dim", [-1, 0])
def test_clipped_swiglu_follows_the_documented_steps(npu_emulation, rng, interleaved, dim):
    x = torch.randn(6, 10, generator=rng) * 4
    alpha, limit, bias = 1.3, 2.5, 0.7
    got = npu_emulation.npu_clipped_swiglu(x, dim=dim, alpha=alpha, limit=limit, bias=bias, interleaved=interleaved)
    flat = x.reshape(1, -1) if dim == 0 else x  # folded to [pre, cut * after] around dim
    half = flat.shape[1] // 2
    a = flat[:, ::2] if interleaved else flat[:, :half]
    b = flat[:, 1::2] if interleaved else flat[:, half:]
    a, b = torch.minimum(a, torch.tensor(limit)), torch.maximum(torch.minimum(b, torch.tensor(limit)), torch.tensor(-limit))
    want = a / (1 + torch.exp(-alpha * a)) * (b + bias)
    torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-6, atol=1e-6)
    assert got.shape == ((3, 10) if dim == 0 else (6, 5))
    silu = npu_emulation.npu_clipped_swiglu(x, alpha=1.0, limit=limit, bias=0.0, interleaved=False)
    torch.testing.assert_close(silu, F.silu(x[:, :5].clamp(max=limit)) * x[:, 5:].clamp(-limit, limit))


def test_clipped_swiglu_group_index_and_constraints(npu_emulation, rng):
    x = torch.randn(5, 4, generator=rng)
    got = npu_emulation.npu_clipped_swiglu(x, group_index=torch.tensor([1, 2]))
    assert torch.isfinite(got[:3]).all() and torch.isnan(got[3:]).all()
    with pytest.raises(RuntimeError, match="even"):
        npu_emulation.npu_clipped_swiglu(torch.randn(4, 5, generator=rng))


def test_gather_sparse_index(npu_emulation, rng):
    table = torch.randint(0, 256, (9, 3, 4), generator=rng, dtype=torch.uint8)
    index = torch.randint(0, 9, (2, 5), generator=rng)
    got = npu_emulation.npu_gather_sparse_index(table, index)
    assert got.shape == (2, 5, 3, 4) and torch.equal(got, torch.index_select(table, 0, index.reshape(-1)).view(2, 5, 3, 4))
    with pytest.raises(RuntimeError, match="no negative"):
        npu_emulation.npu_gather_sparse_index(table, index - 9)
    with pytest.raises(RuntimeError, match="not supported"):
        npu_emulation.npu_gather_sparse_index(table.view(torch.float8_e4m3fn), index)
