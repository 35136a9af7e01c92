"""MoE routing tables (kernels_cuda/moe_tables.py): the one-program kernel equals the torch
formulation on random routings, and both equal tables built by hand."""
import pytest
import torch

from kernel_check import DEVICE, requires_kernels

pytestmark = requires_kernels
mt = pytest.importorskip("flashrt.kernels_cuda.moe_tables")


def _by_hand(indices, weights, E, bm):
    """Stable sort by expert, then tiles of <= bm rows inside each expert, from plain Python lists."""
    flat = indices.reshape(-1).tolist()
    w = weights.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=lambda p: (flat[p], p))
    k = indices.shape[1]
    tiles, row = [], 0
    for e in range(E):
        n = flat.count(e)
        for t0 in range(0, n, bm):
            tiles.append((e, row + t0, row + n))
        row += n
    T = mt.n_tiles(len(flat), E, bm)
    assert len(tiles) <= T
    pos = [0] * len(flat)
    for j, p in enumerate(order):
        pos[p] = j
    return dict(tok=[p // k for p in order], rw=[w[p] for p in order], pos=pos, tiles=tiles, T=T)


@pytest.mark.parametrize("n,k,E,bm", [(3, 2, 4, 2), (1, 6, 384, 16), (8, 4, 32, 16), (64, 6, 384, 16),
                                      (5, 1, 1, 16), (37, 3, 7, 4), (600, 6, 384, 16)])
def test_kernel_matches_torch_and_the_hand_built_tables(rng, n, k, E, bm):
    scores = torch.rand(n, E, generator=rng)
    if n == 37:  # skewed: two thirds of the tokens pick expert 2 first
        scores[: n * 2 // 3, 2] = -1.0
    indices = scores.argsort(dim=1)[:, :k].to(torch.int32)  # k distinct experts per token
    weights = torch.rand(n, k, generator=rng)
    got = mt.route_tables(indices.to(DEVICE), weights.to(DEVICE), E, bm)
    ref = mt.route_tables_torch(indices.to(DEVICE), weights.to(DEVICE), E, bm)
    assert n * k <= mt.ROUTE["max_pairs"]  # the kernel served every case here
    for key in ref:
        assert got[key].dtype == ref[key].dtype and torch.equal(got[key].cpu(), ref[key].cpu()), key
    want = _by_hand(indices, weights, E, bm)
    assert got["tok"].tolist() == want["tok"] and got["pos"].tolist() == want["pos"]
    assert torch.equal(got["rw"].cpu(), torch.tensor(want["rw"], dtype=torch.float32))
    used = len(want["tiles"])
    assert got["tile_e"].shape[0] == want["T"]
    triples = list(zip(got["tile_e"].tolist(), got["tile_row"].tolist(), got["row_end"].tolist()))
    assert triples[:used] == want["tiles"]
    assert all(e == E for e in got["tile_e"].tolist()[used:])  # unused tiles


def test_past_the_limit_the_torch_tables_serve(rng, monkeypatch):
    indices = torch.randint(0, 4, (9, 2), generator=rng, dtype=torch.int32).to(DEVICE)
    weights = torch.rand(9, 2, generator=rng).to(DEVICE)
    calls = []
    real = mt.route_tables_torch
    monkeypatch.setattr(mt, "route_tables_torch", lambda *a: calls.append(1) or real(*a))
    small = dict(mt.ROUTE, max_pairs=16)
    mt.route_tables(indices, weights, 4, 2, small)
    assert calls == [1]
    got = mt.route_tables(indices[:8], weights[:8], 4, 2, small)  # 16 pairs: the kernel
    assert calls == [1] and torch.equal(got["tok"].cpu(), real(indices[:8], weights[:8], 4, 2)["tok"].cpu())
