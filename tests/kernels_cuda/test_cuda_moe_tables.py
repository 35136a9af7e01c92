"""MoE routing tables (kernels_cuda/moe_tables.py): the one-program kernel equals the torch
formulation on random routings, and both equal tables built by hand."""
import pytest
import torch

from kernel_check import DEVICE, launches, requires_kernels  # noqa: F401 (launches: a fixture)

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


def test_past_the_limit_the_large_switch_picks_sorted_kernels_or_torch(rng, monkeypatch, launches):
    indices = torch.randint(0, 4, (9, 2), generator=rng, dtype=torch.int32).to(DEVICE)
    weights = torch.rand(9, 2, generator=rng).to(DEVICE)
    calls = []
    real = mt.route_tables_torch
    monkeypatch.setattr(mt, "route_tables_torch", lambda *a: calls.append(1) or real(*a))
    off = dict(mt.ROUTE, max_pairs=16, large=False)
    mt.route_tables(indices, weights, 4, 2, off)  # 18 pairs, large off: torch
    assert calls == [1] and launches == []
    got = mt.route_tables(indices, weights, 4, 2, dict(off, large=True))
    assert calls == [1] and launches == ["_route_pairs_kernel", "_route_tiles_kernel"]
    assert torch.equal(got["tile_row"].cpu(), real(indices, weights, 4, 2)["tile_row"].cpu())
    launches.clear()
    got = mt.route_tables(indices[:8], weights[:8], 4, 2, off)  # 16 pairs: the one-program kernel
    assert calls == [1] and launches == ["_route_kernel"]
    assert torch.equal(got["tok"].cpu(), real(indices[:8], weights[:8], 4, 2)["tok"].cpu())


def _routing(rng, n, k, E, kind):
    """[n, k] experts: uniform, all on one expert, or on a few of the E (the rest unused)."""
    if kind == "one":
        return torch.full((n, k), int(torch.randint(0, E, (1,), generator=rng)), dtype=torch.int32)
    if kind == "few":
        used = torch.randperm(E, generator=rng)[: max(1, E // 8)]
        return used[torch.randint(0, len(used), (n, k), generator=rng)].to(torch.int32)
    return torch.randint(0, E, (n, k), generator=rng, dtype=torch.int32)


def _assert_tables_equal(got, ref):
    assert got.keys() == ref.keys()
    for key in ref:
        assert got[key].dtype == ref[key].dtype and torch.equal(got[key].cpu(), ref[key].cpu()), key


# pairs just above max_pairs, a few thousand, past TILE_BLOCK tiles (the tile loop's second step)
@pytest.mark.parametrize("n,k,E,bm,kind", [(4097, 1, 2, 16, "uniform"), (683, 6, 384, 16, "uniform"),
                                           (1200, 4, 32, 64, "few"), (5000, 1, 32, 16, "one"),
                                           (600, 8, 384, 64, "one"), (1400, 3, 384, 16, "few"),
                                           (2500, 8, 2, 16, "uniform"), (4100, 5, 384, 16, "uniform"),
                                           (2100, 2, 32, 64, "uniform"), (1100, 7, 384, 16, "few")])
def test_past_max_pairs_the_sorted_path_equals_torch(rng, launches, n, k, E, bm, kind):
    indices = _routing(rng, n, k, E, kind).to(DEVICE)
    weights = torch.rand(n, k, generator=rng).to(DEVICE)
    assert n * k > mt.ROUTE["max_pairs"]
    got = mt.route_tables(indices, weights, E, bm)
    assert launches == ["_route_pairs_kernel", "_route_tiles_kernel"]
    _assert_tables_equal(got, mt.route_tables_torch(indices, weights, E, bm))
    if n * k < 8000:  # the hand-built tables' expert runs (pure Python: the smaller cases)
        want = _by_hand(indices.cpu(), weights.cpu(), E, bm)
        triples = list(zip(got["tile_e"].tolist(), got["tile_row"].tolist(), got["row_end"].tolist()))
        assert triples[: len(want["tiles"])] == want["tiles"] and got["pos"].tolist() == want["pos"]


@pytest.mark.parametrize("seed", range(12))
def test_sorted_path_on_small_pinned_limits(seed):
    """Random sizes past a small max_pairs: every k in 1..8, E in {2, 32, 384}, both tile heights."""
    g = torch.Generator().manual_seed(seed)
    k, E, bm = seed % 8 + 1, (2, 32, 384)[seed % 3], (16, 64)[seed % 2]
    n = int(torch.randint(1, 300, (1,), generator=g))
    indices = _routing(g, n, k, E, ("uniform", "few", "one")[seed % 3]).to(DEVICE)
    weights = torch.rand(n, k, generator=g).to(DEVICE)
    limit = max(1, n * k - int(torch.randint(1, 40, (1,), generator=g)))
    got = mt.route_tables(indices, weights, E, bm, dict(mt.ROUTE, max_pairs=limit))
    _assert_tables_equal(got, mt.route_tables_torch(indices, weights, E, bm))


def test_sorted_path_launches_a_sort_and_two_kernels(rng, monkeypatch):
    """Counted as the step-glue test counts torch operations (at dispatch; views and allocations
    aside) plus the Triton launches; the interpreter's own copies inside a launch are not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    seen, inside = [], []
    for cls in (InterpretedFunction, JITFunction):
        def run(self, *a, _real=cls.run, **kw):
            seen.append(self.fn.__name__)
            inside.append(1)
            try:
                return _real(self, *a, **kw)
            finally:
                inside.pop()

        monkeypatch.setattr(cls, "run", run)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside and name not in ("view", "_unsafe_view", "empty", "detach", "alias", "reshape"):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    indices = torch.randint(0, 384, (800, 6), generator=rng, dtype=torch.int32).to(DEVICE)
    weights = torch.rand(800, 6, generator=rng).to(DEVICE)
    with Count():
        got = mt.route_tables(indices, weights, 384, 16)
    assert seen == ["sort", "_route_pairs_kernel", "_route_tiles_kernel"]
    _assert_tables_equal(got, mt.route_tables_torch(indices, weights, 384, 16))
    wide, narrow = indices.long(), weights.to(torch.bfloat16)
    seen.clear()
    with Count():  # int64 indices, bf16 weights: one cast each first
        got = mt.route_tables(wide, narrow, 384, 16)
    assert seen == ["_to_copy", "_to_copy", "sort", "_route_pairs_kernel", "_route_tiles_kernel"]
    _assert_tables_equal(got, mt.route_tables_torch(wide, narrow, 384, 16))


@pytest.mark.parametrize("fmt,n,E,k,kind", [("fp8_w", 37, 5, 2, "uniform"), ("fp4_w", 23, 32, 6, "few"),
                                            ("fp8_w", 19, 2, 8, "one")])
def test_moe_experts_over_the_sorted_path_equals_the_torch_path(rng, launches, fmt, n, E, k, kind):
    """``moe_experts`` past a pinned ``max_pairs``: the sorted path (``route.large``) and the torch
    tables give the same output, bit for bit."""
    import flashrt
    from flashrt import formats, ops
    from kernel_check import pinned_tiles

    D, I = 64, 32
    x = torch.randn(n, D, generator=rng).to(DEVICE, torch.bfloat16)
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    idx = _routing(rng, n, k, E, kind).to(DEVICE)
    w = [formats.quantize(torch.randn(*s, generator=rng) * 0.25, fmt).to(DEVICE)
         for s in ((E, I, D), (E, I, D), (E, D, I))]
    out = {}
    for large in (True, False):
        launches.clear()
        with pinned_tiles(moe=dict(route=dict(max_pairs=8, large=large))), flashrt.use_backend("cuda"):
            out[large] = ops.moe_experts(x, rw, idx, *w, 10.0)
        assert ("_route_tiles_kernel" in launches) == large and "_route_kernel" not in launches, launches
    assert torch.equal(out[True], out[False])
