"""HKCP cold fetch, the op ``gather_cold_rows``: the reference against an independent per-pick
loop, the CUDA zero-copy kernel (``kernels_cuda.kv_gather``) against the loop and the reference,
its validation, and the KV tiers calling the op (the copy path for long chunks agrees).

In CI the kernel runs in the Triton interpreter on CPU tensors; on a CUDA machine it reads real
pinned host memory (``pytest -m gpu``).
"""
import pytest
import torch

import flashrt
from kernel_check import GPU, assert_error, requires_kernels, run_both

from flashrt import dispatch, ops
from flashrt.kv import pages as kvpages
from flashrt.formats import QTensor, dequantize, dequantize_rows, quantize
from flashrt.kv.state import KVState, entry_bytes, fixed_bytes_for
from flashrt.engine import generate

DEV = torch.device("cuda" if GPU else "cpu")


def host_pool(pages, P, D, g, pin=False, fmt="fp4_b16"):
    if fmt != "fp4_b16":  # any KV format: real quantized rows
        q = quantize(torch.randn(pages, P, D, generator=g), fmt)
        return QTensor(q.data.pin_memory(), q.scale.pin_memory(), fmt, q.shape) if pin else q
    data = torch.randint(0, 256, (pages, P, D // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 120, (pages, P, D // 16), generator=g, dtype=torch.uint8)
    if pin:
        data, scale = data.pin_memory(), scale.pin_memory()
    return QTensor(data, scale.view(torch.float8_e4m3fn), "fp4_b16", (pages, P, D))


def draw(B, N, W, P, D, g, pin=False, fmt="fp4_b16"):
    host = host_pool(7, P, D, g, pin, fmt)
    ids = torch.randint(-1, 7, (B, W), generator=g)  # -1: a page not on the host
    picks = torch.randint(-1, W * P, (B, N), generator=g, dtype=torch.int32)
    ids[0, 0], picks[0, 0] = int(torch.randint(0, 7, (), generator=g)), 0  # at least one pick is cold
    index = torch.randint(-1, 50, (B, N), generator=g, dtype=torch.int32)
    return host, ids.to(DEV), picks.to(DEV), index.to(DEV)


def check_against_loop(host, ids, picks, index, staging, got_index):
    """Every pick by hand: cold ones staged byte for byte at their slot, the others zero and unchanged."""
    B, N = picks.shape
    P = host.shape[1]
    assert staging.shape == (1, B * N, host.shape[-1]) and staging.fmt == host.fmt
    assert staging.device.type == DEV.type and got_index.dtype == torch.int32
    got_index, picks, ids, index = got_index.cpu(), picks.cpu(), ids.cpu(), index.cpu()
    u8 = lambda t: t.reshape(-1, t.shape[-1]).view(torch.uint8)
    data, scale, hd, hs = u8(staging.data.cpu()), u8(staging.scale.cpu()), u8(host.data), u8(host.scale)
    cold = 0
    for b in range(B):
        for j in range(N):
            e, i = int(picks[b, j]), b * N + j
            hp = int(ids[b, e // P]) if e >= 0 else -1
            if hp < 0:
                assert got_index[b, j] == index[b, j] and not data[i].any() and not scale[i].any()
                continue
            cold += 1
            assert got_index[b, j] == 1000 + i
            assert torch.equal(data[i], hd[hp * P + e % P]) and torch.equal(scale[i], hs[hp * P + e % P])
    assert cold > 0


SHAPES = [(2, 37, 5, 4, 64), (1, 70, 3, 8, 512), (3, 5, 2, 16, 16)]


@pytest.mark.parametrize("B,N,W,P,D", SHAPES)
@pytest.mark.parametrize("fmt", ["fp4_b16", "fp8", "int8"])
def test_reference_matches_a_loop(B, N, W, P, D, fmt, rng):
    host, ids, picks, index = draw(B, N, W, P, D, rng, pin=GPU, fmt=fmt if D % 32 == 0 else "fp4_b16")
    before = index.clone()
    with flashrt.use_backend("reference"):
        staging, got = ops.gather_cold_rows(host, ids, picks, index, 1000)
    assert torch.equal(index, before)  # inputs are never mutated
    check_against_loop(host, ids, picks, index, staging, got)


@requires_kernels
@pytest.mark.parametrize("B,N,W,P,D", SHAPES)
def test_cuda_kernel_matches_the_loop_and_the_reference(B, N, W, P, D, rng):
    host, ids, picks, index = draw(B, N, W, P, D, rng, pin=GPU)
    before = index.clone()
    (staging, got), (want_staging, want) = run_both("gather_cold_rows", host, ids, picks.long(), index, 1000)
    assert torch.equal(index, before)
    check_against_loop(host, ids, picks, index, staging, got)
    assert torch.equal(got, want)
    assert torch.equal(staging.data.view(torch.uint8), want_staging.data.view(torch.uint8))
    assert torch.equal(staging.scale.view(torch.uint8), want_staging.scale.view(torch.uint8))


@requires_kernels
def test_zero_copy_is_asked_through_dispatch():
    assert dispatch.zero_copy("gather_cold_rows", "cpu")  # the reference reads CPU pages in place
    with flashrt.use_backend("trace"):
        assert not dispatch.zero_copy("gather_cold_rows", "meta")
    with flashrt.use_backend("cuda"):  # the kernel: under the interpreter on CPU, else after its self-check
        assert dispatch.zero_copy("gather_cold_rows", DEV)


def test_bad_inputs_name_the_argument(rng):
    host, ids, picks, index = draw(1, 6, 3, 4, 64, rng)
    call = lambda **kw: ops.gather_cold_rows(**{"host": host, "host_ids": ids, "picks": picks, "index": index,
                                                 "offset": 10, **kw})
    assert_error(lambda: call(host=host.data), "host", "QTensor")
    assert_error(lambda: call(host=quantize(torch.randn(4, 64), "fp8")), "host", "3 dims")
    assert_error(lambda: call(picks=picks.float()), "picks", "torch.int32 or torch.int64")
    assert_error(lambda: call(index=index[:, :3]), "index", "[B=1, N=6]")
    assert_error(lambda: call(host_ids=ids.int()), "host_ids", "torch.int64")
    assert_error(lambda: call(offset=-1), "offset", ">= 0")
    assert_error(lambda: call(picks=torch.full_like(picks, 3 * 4)), "picks", "[-1, 12)")
    assert_error(lambda: call(host_ids=torch.full_like(ids, 7)), "host_ids", "[-1, 7)")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_gather_reads_pinned_host_memory(rng):
    from flashrt.kernels_cuda import kv_gather

    assert kv_gather.zero_copy_ok(DEV)
    host, ids, picks, index = draw(4, 512, 64, 64, 512, rng, pin=True)
    with flashrt.use_backend("cuda"):
        staging, got = ops.gather_cold_rows(host, ids, picks, index, 1000)
    check_against_loop(host, ids, picks, index, staging, got)
    pageable = host_pool(7, 64, 512, rng)
    assert_error(lambda: ops.gather_cold_rows(pageable, ids, picks, index, 0), "host", "pinned")


def rows_of(segments, index):
    """Dequantized rows an attention would read for ``index`` [B, S, K] over the segments."""
    flat, out = index.reshape(index.shape[0], -1).long(), []
    bounds = [0]
    for seg in segments:
        bounds.append(bounds[-1] + seg.shape[1])
    for b in range(flat.shape[0]):
        for i in flat[b].tolist():
            if i < 0:
                out.append(None)
                continue
            s = next(k for k in range(len(segments)) if bounds[k] <= i < bounds[k + 1])
            out.append(dequantize_rows(segments[s], torch.tensor([[i - bounds[s]]]))[0, 0])
    return out


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_op_and_copy_paths_resolve_the_same_rows(model, rng, monkeypatch, backend):
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 120), generator=rng)
    budget = fixed_bytes_for(cfg, 2, 130, 4) + 6 * 4 * entry_bytes(cfg.head_dim, "fp4_b16")
    state = model.new_state(2, 130, pool=KVState.pool_for(cfg, 2, 130, "cpu", budget, 4))
    for s in range(0, 120, 8):
        model.forward(ids[:, s:s + 8], state=state)
    main = state.compressed[4].main
    assert sum(t.cold for t in main.tables) > 10
    topk = torch.randint(-1, 120, (2, 3, 9), generator=rng, dtype=torch.int32)
    if backend == "cuda" and not ("cuda" in dispatch.backends() and dispatch.availability("cuda")[0]):
        pytest.skip("cuda backend unavailable (no triton)")
    calls = []
    real = ops.gather_cold_rows
    monkeypatch.setattr(ops, "gather_cold_rows", lambda *a: calls.append(dispatch.chain("gather_cold_rows", "cpu"))
                        or real(*a))
    with flashrt.use_backend(backend):
        kernel = main.resolve(topk)
    monkeypatch.setattr(kvpages, "STAGING_MAX_ROWS", 0)
    copy = main.resolve(topk)
    assert calls == [[backend]] and len(kernel[0]) == len(copy[0]) == 2
    a, b = rows_of(*kernel), rows_of(*copy)
    assert len(a) == len(b) == topk.numel()
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))
    stored = [main.read_row(b, 120) for b in range(2)]  # both tiers, read back on the host
    stored = [dequantize(QTensor(r.data, r.scale, r.fmt, r.shape)) for r in stored]
    want = [None if e < 0 else stored[b][e] for b in range(2) for e in topk[b].reshape(-1).tolist()]
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, want))


def test_budget_of_ten_percent_goes_through_the_op(model, rng, monkeypatch):
    calls = []
    real = ops.gather_cold_rows
    monkeypatch.setattr(ops, "gather_cold_rows", lambda *a: calls.append(a[2].numel()) or real(*a))
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 200), generator=rng).tolist()
    full = generate(model, ids, 3, prefill_chunk=16, kv_page_entries=8)
    main = sum(-(-205 // cfg.ratio(l)) for l in cfg.kv_source_layers) * entry_bytes(cfg.head_dim, "fp4_b16") * 2
    small = generate(model, ids, 3, prefill_chunk=16, kv_page_entries=8,
                           kv_budget=fixed_bytes_for(cfg, 2, 205, 8) + main // 10)
    assert calls and small.state.tier_stats()["cold_pages"] > 0
    assert torch.equal(full.first_logits, small.first_logits) and full.tokens == small.tokens
