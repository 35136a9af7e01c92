"""HKCP cold fetch: the zero-copy gather kernel (``kernels_cuda.kv_gather``) against an independent
per-pick loop, the kernel path against the host copy path, and the model through the kernel path.

In CI the kernel runs in the Triton interpreter on CPU tensors; on a CUDA machine it reads real
pinned host memory (``pytest -m gpu``).
"""
import pytest
import torch

pytest.importorskip("triton")

from kernel_check import GPU  # noqa: E402

from flashrt.kv import pages as kvpages  # noqa: E402
from flashrt.formats import QTensor, dequantize, dequantize_rows  # noqa: E402
from flashrt.kernels_cuda import kv_gather  # noqa: E402
from flashrt.kv.state import KVState, entry_bytes, fixed_bytes_for  # noqa: E402
from flashrt.engine import generate

DEV = torch.device("cuda" if GPU else "cpu")


def host_pool(pages, P, D, g, pin=False):
    data = torch.randint(0, 256, (pages, P, D // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 120, (pages, P, D // 16), generator=g, dtype=torch.uint8)
    if pin:
        data, scale = data.pin_memory(), scale.pin_memory()
    return QTensor(data, scale.view(torch.float8_e4m3fn), "fp4_b16", (pages, P, D))


def check_gather(B, N, W, P, D, g, pin=False):
    host = host_pool(7, P, D, g, pin)
    ids = torch.randint(-1, 7, (B, W), generator=g)  # -1: a page not on the host
    picks = torch.randint(-1, W * P, (B, N), generator=g, dtype=torch.int32)
    index = torch.randint(-1, 50, (B, N), generator=g, dtype=torch.int32)
    before = index.clone()
    got_index = index.to(DEV)
    staging = kv_gather.cold_gather(host, ids.to(DEV), picks.to(DEV), got_index, 1000)
    assert staging.shape == (1, B * N, D) and staging.device.type == DEV.type
    got_index, data, scale = got_index.cpu(), staging.data.cpu()[0], staging.scale.view(torch.uint8).cpu()[0]
    hd, hs = host.data.reshape(-1, D // 2), host.scale.view(torch.uint8).reshape(-1, D // 16)
    cold = 0
    for b in range(B):
        for j in range(N):
            e, i = int(picks[b, j]), b * N + j
            hp = int(ids[b, e // P]) if e >= 0 else -1
            if hp < 0:
                assert got_index[b, j] == before[b, j]
                continue
            cold += 1
            assert got_index[b, j] == 1000 + i
            assert torch.equal(data[i], hd[hp * P + e % P]) and torch.equal(scale[i], hs[hp * P + e % P])
    assert cold > 0


@pytest.mark.parametrize("B,N,W,P,D", [(2, 37, 5, 4, 64), (1, 70, 3, 8, 512), (3, 5, 2, 16, 16)])
def test_gather_matches_a_loop(B, N, W, P, D, rng):
    check_gather(B, N, W, P, D, rng)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_gather_reads_pinned_host_memory(rng):
    assert kv_gather.zero_copy_ok(DEV)
    check_gather(4, 512, 64, 64, 512, rng, pin=True)


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


def test_kernel_and_copy_paths_resolve_the_same_rows(model, rng, monkeypatch):
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 120), generator=rng)
    budget = fixed_bytes_for(cfg, 2, 130, 4) + 6 * 4 * entry_bytes(cfg.head_dim, "fp4_b16")
    state = model.new_state(2, 130, pool=KVState.pool_for(cfg, 2, 130, "cpu", budget, 4))
    for s in range(0, 120, 8):
        model.forward(ids[:, s:s + 8], state=state)
    main = state.compressed[4].main
    assert sum(t.cold for t in main.tables) > 10
    topk = torch.randint(-1, 120, (2, 3, 9), generator=rng, dtype=torch.int32)
    calls = []
    real = kv_gather.cold_gather
    monkeypatch.setattr(kv_gather, "cold_gather", lambda *a: calls.append(1) or real(*a))
    kernel = main.resolve(topk)
    monkeypatch.setattr(kvpages, "STAGING_MAX_ROWS", 0)
    copy = main.resolve(topk)
    assert calls == [1] and len(kernel[0]) == len(copy[0]) == 2
    a, b = rows_of(*kernel), rows_of(*copy)
    assert len(a) == len(b) == topk.numel()
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))
    stored = [main.read_row(b, 120) for b in range(2)]  # both tiers, read back on the host
    stored = [dequantize(QTensor(r.data, r.scale, r.fmt, r.shape)) for r in stored]
    want = [None if e < 0 else stored[b][e] for b in range(2) for e in topk[b].reshape(-1).tolist()]
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, want))


def test_budget_of_ten_percent_goes_through_the_kernel(model, rng, monkeypatch):
    calls = []
    real = kv_gather.cold_gather
    monkeypatch.setattr(kv_gather, "cold_gather", lambda *a: calls.append(a[2].numel()) or real(*a))
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 200), generator=rng).tolist()
    full = generate(model, ids, 3, prefill_chunk=16, kv_page_entries=8)
    main = sum(-(-205 // cfg.ratio(l)) for l in cfg.kv_source_layers) * entry_bytes(cfg.head_dim, "fp4_b16") * 2
    small = generate(model, ids, 3, prefill_chunk=16, kv_page_entries=8,
                           kv_budget=fixed_bytes_for(cfg, 2, 205, 8) + main // 10)
    assert calls and small.state.tier_stats()["cold_pages"] > 0
    assert torch.equal(full.first_logits, small.first_logits) and full.tokens == small.tokens
