"""``prefix_attention`` (kernels_cuda/prefix_attention.py) against the reference (the sparse
attention over the indices it implies), on fresh random chunks: rows starting at 0, inside the
first window and far past it; ring starts at 0, mid-window and at the chunk; entries in any order,
some nowhere (-1); visible counts from 0 to all; head counts that leave 4, 2 or 1 queries a
program (1: the sparse kernel on the implied indices); partial query blocks; fp8 / fp4 / bf16
segments; no entries (a window-only layer); no sink; fp32 q."""
import pytest
import torch

from kernel_check import DEVICE, launches, pinned_tiles, rel_err, requires_kernels, run_both  # noqa: F401

from flashrt import formats, refmath
from flashrt.kernels_cuda import prefix_attention as pa

pytestmark = requires_kernels


def _seg(kind, B, T, D, g):
    x = torch.randn(B, T, D, generator=g)
    return (x.to(torch.bfloat16) if kind == "bf16" else formats.quantize(x, kind)).to(DEVICE)


def _case(g, B, S, H, D, W, T, kinds=("fp8", "fp8", "fp4_b16"), q_dtype=torch.bfloat16, entries=True, sink=True):
    starts = torch.tensor([0, W // 2, 5 * W + 3, 1][:B])
    positions = (starts.view(-1, 1) + torch.arange(S)).to(DEVICE)
    ring_start = torch.stack([torch.randint(0, int(s) + 1, (1,), generator=g)[0] for s in starts]).to(DEVICE)
    kv = (_seg(kinds[0], B, W, D, g), _seg(kinds[1], B, S, D, g)) + ((_seg(kinds[2], B, T, D, g),) if entries else ())
    q = torch.randn(B, S, H, D, generator=g).to(q_dtype).to(DEVICE)
    ent = vis = None
    if entries:
        ent = (W + S + torch.stack([torch.randperm(T, generator=g) for _ in range(B)])).to(torch.int32)
        ent[torch.rand(B, T, generator=g) < 0.1] = -1
        vis = torch.randint(0, T + 1, (B, S), generator=g, dtype=torch.int32)
        vis[0, 0], vis[-1, -1] = 0, T
        ent, vis = ent.to(DEVICE), vis.to(DEVICE)
    s = torch.randn(H, generator=g).to(DEVICE) if sink else None
    return q, kv, positions, ring_start, W, ent, vis, s, D ** -0.5


def _check(case, tol=2e-2):
    got, want = run_both("prefix_attention", *case)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got.float().cpu(), want.float().cpu()) < tol


@pytest.mark.parametrize("B,S,H,W,T", [(2, 9, 16, 8, 20), (3, 5, 4, 6, 7), (1, 13, 32, 4, 33), (4, 3, 6, 16, 5)])
def test_matches_the_reference(rng, launches, B, S, H, W, T):
    _check(_case(rng, B, S, H, 64, W, T))
    assert launches[-1] == "_prefix_attention_kernel"


def test_one_query_a_program_runs_the_sparse_kernel(rng, launches):
    _check(_case(rng, 2, 5, 64, 64, 8, 12))  # 64 heads fill M_BLOCK: nothing to share
    assert "_sparse_attention_kernel" in launches and "_prefix_attention_kernel" not in launches


@pytest.mark.parametrize("kinds", [("bf16", "bf16", "bf16"), ("fp8", "fp8", "fp4_b32"), ("bf16", "fp8", "fp8")])
def test_segment_formats(rng, kinds):
    _check(_case(rng, 2, 6, 16, 64, 8, 10, kinds))


def test_shared_page_pool_and_staging_segments(rng):
    """The paged main KV: a batch-1 page pool every row shares and a per-row staging segment of cold
    rows in the same format (four segments, the fourth joining the pool's dequant path)."""
    B, S, H, W, D = 2, 7, 16, 8, 64
    q, kv, positions, ring_start, _, _, vis, sink, scale = _case(rng, B, S, H, D, W, 12)
    pool, staging = _seg("fp4_b16", 1, 30, D, rng), _seg("fp4_b16", B, 5, D, rng)
    ent = (W + S + torch.randint(0, 35, (B, 12), generator=rng)).to(torch.int32).to(DEVICE)
    _check((q, kv[:2] + (pool, staging), positions, ring_start, W, ent, vis, sink, scale))


def test_window_only_without_sink(rng):
    _check(_case(rng, 3, 7, 16, 64, 5, 0, entries=False, sink=False))


def test_fp32_queries(rng):
    _check(_case(rng, 2, 6, 16, 64, 8, 10, q_dtype=torch.float32), tol=1e-4)


@pytest.mark.parametrize("tiles", [{"M_BLOCK": 32, "K_BLOCK": 16}, {"D_SPLIT": 2}, {"D_SPLIT": 2, "M_BLOCK": 128},
                                   {"D_SPLIT": 2, "M_BLOCK": 128, "K_BLOCK": 16}])
def test_other_tiles(rng, tiles):
    """Two or eight queries a program, 16-row K blocks, the output columns split over two programs:
    the block edges fall elsewhere, the same results."""
    with pinned_tiles(prefix_attention={"prefix": tiles}):
        _check(_case(rng, 2, 11, 16, 64, 8, 37))
        _check(_case(rng, 1, 6, 16, 96, 4, 9, q_dtype=torch.float32), tol=1e-4)  # 96: a half is partly padding


def test_implied_indices_are_the_window_and_the_visible_prefix(rng):
    q, kv, positions, ring_start, W, ent, vis, _, _ = _case(rng, 2, 4, 4, 64, 6, 9)
    win, picks = refmath.prefix_indices(positions.cpu(), ring_start.cpu(), W, ent.cpu(), vis.cpu())
    assert torch.equal(win, refmath.window_indices(positions.cpu(), ring_start.cpu().view(1, -1), W)[0])
    for b in range(2):
        for s in range(4):
            n = int(vis[b, s])
            assert torch.equal(picks[b, s, :n], ent[b, :n].cpu()) and bool((picks[b, s, n:] == -1).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B,T", [(4, 512), (2, 256)])
def test_prompt_chunk_at_small_shapes(rng, B, T):
    """``small``'s heads (16 x 512) over a 512-token chunk, a 128-token window and T entries."""
    _check(_case(rng, B, 512, 16, 512, 128, T))
