"""``flashrt.ops.topk_positions`` and ``flashrt.ops.candidate_blocks`` against independent
pure-Python loops over rows (exact comparison: both ops are selections, no arithmetic).

Scores are drawn from a small set of integers so that ties are frequent, with NaN, -inf and +inf
sprinkled in (never picked: only finite scores count).
"""
from __future__ import annotations

import math

import pytest
import torch

import flashrt
from flashrt import ops
from kernel_check import assert_error


def tied_scores(B, S, T, g, p_special=0.2, levels=5) -> torch.Tensor:
    """fp32 [B, S, T]: integers in [-levels, levels] (many ties, -0.0 too) plus NaN / +-inf."""
    s = torch.randint(-levels, levels + 1, (B, S, T), generator=g).to(torch.float32)
    s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
    special = torch.tensor([math.nan, math.inf, -math.inf])
    pick = torch.randint(0, 3, (B, S, T), generator=g)
    mask = torch.rand(B, S, T, generator=g) < p_special
    return torch.where(mask, special[pick], s)


def smooth_scores(B, S, T, g) -> torch.Tensor:
    return torch.randn(B, S, T, generator=g)



# ---------------------------------------------------------------------------------------------
# topk_positions


def expected_topk(scores, k, candidates=None) -> list:
    """Nested lists [B][S][min(k, T)]: best finite candidates (ties to the lower position),
    listed in ascending position, then -1 padding."""
    B, S, T = scores.shape
    width = min(k, T)
    rows = scores.tolist()
    cand = candidates.tolist() if candidates is not None else None
    out = []
    for b in range(B):
        out.append([])
        for s in range(S):
            row = rows[b][s]
            pool = [t for t in range(T) if math.isfinite(row[t]) and (cand is None or cand[b][s][t])]
            pool.sort(key=lambda t: (-row[t], t))  # -0.0 == 0.0 in Python: a tie
            picks = sorted(pool[:width])
            out[b].append(picks + [-1] * (width - len(picks)))
    return out


TOPK_CASES = [  # B, S, T, k
    (1, 1, 1, 1),
    (1, 1, 1, 4),  # k > T
    (2, 3, 5, 2),
    (3, 5, 37, 8),
    (2, 4, 37, 37),
    (1, 2, 37, 50),  # k > T
    (3, 2, 64, 16),
    (2, 1, 7, 3),
]


@pytest.mark.parametrize("B,S,T,k", TOPK_CASES)
@pytest.mark.parametrize("kind", ["tied", "smooth", "sparse_finite"])
@pytest.mark.parametrize("use_candidates", [False, True])
def test_topk_positions_matches_loop(B, S, T, k, kind, use_candidates, rng):
    g = rng
    if kind == "tied":
        scores = tied_scores(B, S, T, g)
    elif kind == "smooth":
        scores = smooth_scores(B, S, T, g)
    else:  # mostly non-finite: many rows with fewer finite scores than k
        scores = tied_scores(B, S, T, g, p_special=0.8)
    cand = torch.rand(B, S, T, generator=g) < 0.6 if use_candidates else None
    out = ops.topk_positions(scores, k, cand)
    assert out.dtype == torch.int32 and out.shape == (B, S, min(k, T))
    assert out.tolist() == expected_topk(scores, k, cand)


def test_topk_ties_go_to_lower_position():
    scores = torch.tensor([[[1.0, 3.0, 3.0, 2.0, 3.0, 3.0],
                            [0.0, -0.0, 0.0, -0.0, -1.0, 5.0],
                            [7.0, 7.0, 7.0, 7.0, 7.0, 7.0]]])
    assert ops.topk_positions(scores, 2).tolist() == [[[1, 2], [0, 5], [0, 1]]]
    assert ops.topk_positions(scores, 3).tolist() == [[[1, 2, 4], [0, 1, 5], [0, 1, 2]]]
    # candidates remove the lower copies of the tie: the next ones up are taken
    cand = torch.tensor([[[True, False, True, True, True, True]] * 3])
    assert ops.topk_positions(scores, 2, cand).tolist() == [[[2, 4], [0, 5], [0, 2]]]


def test_topk_non_finite_never_picked():
    nan, inf = math.nan, math.inf
    scores = torch.tensor([[[nan, inf, -inf, 1.0, nan, -5.0, inf],
                            [nan, nan, nan, nan, nan, nan, nan],
                            [-inf, -inf, 2.0, -inf, inf, nan, -inf]]])
    assert ops.topk_positions(scores, 3).tolist() == [[[3, 5, -1], [-1, -1, -1], [2, -1, -1]]]
    assert ops.topk_positions(scores, 1).tolist() == [[[3], [-1], [2]]]
    # the largest finite float is still finite
    big = torch.tensor([[[torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, inf]]])
    assert ops.topk_positions(big, 5).tolist() == [[[0, 1, -1]]]


def test_topk_candidates_mask_and_padding():
    scores = torch.tensor([[[5.0, 4.0, 3.0, 2.0, 1.0]]])
    none = torch.zeros(1, 1, 5, dtype=torch.bool)
    assert ops.topk_positions(scores, 3, none).tolist() == [[[-1, -1, -1]]]
    cand = torch.tensor([[[False, True, False, True, True]]])
    assert ops.topk_positions(scores, 2, cand).tolist() == [[[1, 3]]]
    assert ops.topk_positions(scores, 4, cand).tolist() == [[[1, 3, 4, -1]]]
    assert ops.topk_positions(scores, 9, cand).tolist() == [[[1, 3, 4, -1, -1]]]  # min(k, T) columns
    # a non-finite score stays out even when it is a candidate
    scores[0, 0, 3] = math.nan
    assert ops.topk_positions(scores, 4, cand).tolist() == [[[1, 4, -1, -1]]]


def test_topk_empty_rows():
    """T == 0 gives min(k, 0) == 0 columns; S == 0 gives no rows."""
    assert ops.topk_positions(torch.zeros(2, 3, 0), 4).shape == (2, 3, 0)
    out = ops.topk_positions(torch.zeros(2, 0, 5), 4, torch.zeros(2, 0, 5, dtype=torch.bool))
    assert out.shape == (2, 0, 4) and out.dtype == torch.int32


def test_topk_no_mutation(rng):
    g = rng
    scores = tied_scores(2, 3, 11, g)
    cand = torch.rand(2, 3, 11, generator=g) < 0.5
    s0, c0 = scores.clone(), cand.clone()
    ops.topk_positions(scores, 4, cand)
    assert torch.equal(scores.isnan(), s0.isnan()) and torch.equal(scores.nan_to_num(), s0.nan_to_num())
    assert torch.equal(cand, c0)


def test_topk_bad_inputs():
    scores = torch.randn(2, 3, 37)
    cand = torch.ones(2, 3, 37, dtype=torch.bool)
    ops.topk_positions(scores, 4, cand)
    assert_error(lambda: ops.topk_positions(scores, 0), "k", ">= 1", "got 0")
    assert_error(lambda: ops.topk_positions(scores, -3), "k", ">= 1", "got -3")
    assert_error(lambda: ops.topk_positions(scores, 2.0), "k", "int", "float")
    assert_error(lambda: ops.topk_positions(scores, True), "k", "int", "bool")
    assert_error(lambda: ops.topk_positions(scores, 4, cand.to(torch.uint8)), "candidates", "torch.bool", "torch.uint8")
    assert_error(lambda: ops.topk_positions(scores, 4, cand.float()), "candidates", "torch.float32")
    assert_error(lambda: ops.topk_positions(scores, 4, cand[..., :36]), "candidates", "T=37", "(2, 3, 36)")
    assert_error(lambda: ops.topk_positions(scores, 4, cand[0]), "candidates", "3 dims")
    assert_error(lambda: ops.topk_positions(scores.to(torch.bfloat16), 4), "scores", "torch.float32", "torch.bfloat16")
    assert_error(lambda: ops.topk_positions(scores.double(), 4), "scores", "torch.float64")
    assert_error(lambda: ops.topk_positions(scores[0], 4), "scores", "3 dims", "(3, 37)")


# ---------------------------------------------------------------------------------------------
# candidate_blocks


def expected_blocks(scores, visible, topk_blocks, block_size) -> list:
    """Nested bool lists [B][S][T], following the docstring of ops.candidate_blocks:
    block score = max of its finite scores (None when it has none); the block of visible - 1 is
    pinned and counts among the topk_blocks; the other picks go to the best scored blocks, ties
    to the lower block; every position of a kept block is marked."""
    B, S, T = scores.shape
    nb = -(-T // block_size)
    rows = scores.tolist()
    vis = visible.tolist()
    out = []
    for b in range(B):
        out.append([])
        for s in range(S):
            row = rows[b][s]
            block_score = []
            for i in range(nb):
                finite = [x for x in row[i * block_size : (i + 1) * block_size] if math.isfinite(x)]
                block_score.append(max(finite) if finite else None)
            kept = []
            if vis[b][s] > 0:
                kept.append((vis[b][s] - 1) // block_size)
            rest = [i for i in range(nb) if i not in kept and block_score[i] is not None]
            rest.sort(key=lambda i: (-block_score[i], i))
            kept += rest[: max(0, topk_blocks - len(kept))]
            out[b].append([t // block_size in kept for t in range(T)])
    return out


BLOCK_CASES = [  # B, S, T, block_size, topk_blocks
    (1, 1, 1, 1, 1),
    (1, 2, 1, 4, 3),
    (2, 3, 5, 2, 1),
    (2, 3, 5, 2, 2),
    (3, 5, 37, 4, 3),  # partial last block (37 = 9 * 4 + 1)
    (2, 4, 37, 8, 2),
    (1, 3, 37, 16, 100),  # topk_blocks > number of blocks
    (2, 2, 64, 16, 2),
    (3, 2, 37, 64, 1),  # one (partial) block
    (2, 3, 37, 1, 5),  # block_size 1: a top-k of positions with the pinned one
]


@pytest.mark.parametrize("B,S,T,bs,nblk", BLOCK_CASES)
@pytest.mark.parametrize("kind", ["tied", "smooth", "sparse_finite"])
def test_candidate_blocks_matches_loop(B, S, T, bs, nblk, kind, rng):
    g = rng
    if kind == "tied":
        scores = tied_scores(B, S, T, g, levels=2)
    elif kind == "smooth":
        scores = smooth_scores(B, S, T, g)
    else:
        scores = tied_scores(B, S, T, g, p_special=0.85, levels=2)
    visible = torch.randint(0, T + 1, (B, S), generator=g)
    visible.view(-1)[0] = 0
    visible.view(-1)[-1] = T
    visible = visible.to(torch.int32)
    out = ops.candidate_blocks(scores, visible, nblk, bs)
    assert out.dtype == torch.bool and out.shape == (B, S, T)
    assert out.tolist() == expected_blocks(scores, visible, nblk, bs)


def _row(values):
    return torch.tensor([[values]], dtype=torch.float32)


def _vis(v):
    return torch.tensor([[v]], dtype=torch.int32)


def test_candidate_blocks_pinned_counts_among_picks():
    # blocks of 2: [0,1] [2,3] [4,5] [6]; block scores 9, 1, 5, 0 (partial last block)
    scores = _row([9.0, 2.0, 1.0, -3.0, 5.0, 4.0, 0.0])
    T = 7
    # visible 7: the partial block 3 is pinned; one pick left -> block 0
    assert ops.candidate_blocks(scores, _vis(7), 2, 2)[0, 0].tolist() == [1, 1, 0, 0, 0, 0, 1]
    # a single pick is the pinned block alone, even when it scores worst
    assert ops.candidate_blocks(scores, _vis(7), 1, 2)[0, 0].tolist() == [0, 0, 0, 0, 0, 0, 1]
    # the pinned block is also the best one: it is not counted twice
    assert ops.candidate_blocks(scores, _vis(1), 2, 2)[0, 0].tolist() == [1, 1, 0, 0, 1, 1, 0]
    # visible - 1 at the last position of a full block pins that block (not the next)
    assert ops.candidate_blocks(scores, _vis(4), 2, 2)[0, 0].tolist() == [1, 1, 1, 1, 0, 0, 0]
    # visible == 0 pins nothing: the plain top blocks
    assert ops.candidate_blocks(scores, _vis(0), 2, 2)[0, 0].tolist() == [1, 1, 0, 0, 1, 1, 0]
    assert ops.candidate_blocks(scores, _vis(0), 9, 2)[0, 0].tolist() == [1] * T


def test_candidate_blocks_ties_and_non_finite():
    nan, inf = math.nan, math.inf
    # blocks of 3: [3, nan, 1] [inf, 3, -inf] [nan, nan, nan] [-inf, 3, 0] [2]
    scores = _row([3.0, nan, 1.0, inf, 3.0, -inf, nan, nan, nan, -inf, 3.0, 0.0, 2.0])
    # three blocks tie at 3 (the +inf in block 1 does not count); ties go to the lower block
    assert ops.candidate_blocks(scores, _vis(0), 2, 3)[0, 0].tolist() == [1] * 6 + [0] * 7
    assert ops.candidate_blocks(scores, _vis(0), 3, 3)[0, 0].tolist() == [1] * 6 + [0] * 3 + [1] * 3 + [0]
    # the all-NaN block is never picked, even when there is room
    assert ops.candidate_blocks(scores, _vis(0), 10, 3)[0, 0].tolist() == [1] * 6 + [0] * 3 + [1] * 4
    # ...but a pinned block is kept whatever its score
    assert ops.candidate_blocks(scores, _vis(8), 1, 3)[0, 0].tolist() == [0] * 6 + [1] * 3 + [0] * 4
    assert ops.candidate_blocks(scores, _vis(8), 2, 3)[0, 0].tolist() == [1] * 3 + [0] * 3 + [1] * 3 + [0] * 4
    # a row with no finite score at all: only the pinned block, or nothing
    dead = torch.full((1, 1, 5), nan)
    assert ops.candidate_blocks(dead, _vis(5), 3, 2)[0, 0].tolist() == [0, 0, 0, 0, 1]
    assert not ops.candidate_blocks(dead, _vis(0), 3, 2).any()


def test_candidate_blocks_empty():
    """T == 0 (visible must be 0) keeps nothing; S == 0 gives no rows."""
    out = ops.candidate_blocks(torch.zeros(2, 3, 0), torch.zeros(2, 3, dtype=torch.int32), 2, 4)
    assert out.shape == (2, 3, 0) and out.dtype == torch.bool
    out = ops.candidate_blocks(torch.zeros(2, 0, 9), torch.zeros(2, 0, dtype=torch.int32), 2, 4)
    assert out.shape == (2, 0, 9) and out.dtype == torch.bool


def test_candidate_blocks_rows_independent_and_no_mutation(rng):
    g = rng
    B, S, T = 3, 4, 37
    scores = tied_scores(B, S, T, g, p_special=0.0, levels=3)
    visible = torch.randint(0, T + 1, (B, S), generator=g, dtype=torch.int32)
    s0, v0 = scores.clone(), visible.clone()
    out = ops.candidate_blocks(scores, visible, 3, 4)
    assert torch.equal(scores, s0) and torch.equal(visible, v0)
    for b in range(B):
        for s in range(S):
            one = ops.candidate_blocks(scores[b : b + 1, s : s + 1], visible[b : b + 1, s : s + 1], 3, 4)
            assert torch.equal(one[0, 0], out[b, s])
    # a kept block is kept whole; the number of kept blocks never exceeds topk_blocks
    nb = -(-T // 4)
    padded = torch.nn.functional.pad(out, (0, nb * 4 - T))
    per_block = padded.view(B, S, nb, 4)
    full = per_block[:, :, :-1]  # the last block (37 = 9 * 4 + 1) is partial: one real position
    assert torch.equal(full.all(-1), full.any(-1))
    assert (per_block.any(-1).sum(-1) <= 3).all()


def test_candidate_blocks_bad_inputs():
    scores = torch.randn(2, 3, 37)
    visible = torch.randint(0, 38, (2, 3), dtype=torch.int32)
    ops.candidate_blocks(scores, visible, 2, 4)
    assert_error(lambda: ops.candidate_blocks(scores, visible, 0, 4), "topk_blocks", ">= 1", "got 0")
    assert_error(lambda: ops.candidate_blocks(scores, visible, 2.0, 4), "topk_blocks", "int", "float")
    assert_error(lambda: ops.candidate_blocks(scores, visible, 2, 0), "block_size", ">= 1", "got 0")
    assert_error(lambda: ops.candidate_blocks(scores, visible, 2, -4), "block_size", ">= 1", "got -4")
    assert_error(lambda: ops.candidate_blocks(scores, visible, 2, True), "block_size", "bool")
    high = visible.clone()
    high[1, 2] = 38
    assert_error(lambda: ops.candidate_blocks(scores, high, 2, 4), "visible", "[0, 38)", "38]")
    low = visible.clone()
    low[0, 0] = -1
    assert_error(lambda: ops.candidate_blocks(scores, low, 2, 4), "visible", "[0, 38)", "[-1,")
    assert_error(lambda: ops.candidate_blocks(scores, visible.long(), 2, 4), "visible", "torch.int32", "torch.int64")
    assert_error(lambda: ops.candidate_blocks(scores, visible[:, :2], 2, 4), "visible", "S=3", "(2, 2)")
    assert_error(lambda: ops.candidate_blocks(scores.to(torch.bfloat16), visible, 2, 4), "scores", "torch.bfloat16")
    assert_error(lambda: ops.candidate_blocks(scores[0], visible, 2, 4), "scores", "3 dims")
    with flashrt.value_checks(False):
        ops.candidate_blocks(scores, visible, 2, 4)
