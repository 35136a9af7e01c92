"""topk_positions and candidate_blocks: torch.topk (aclnnTopk) for the threshold value only."""
from __future__ import annotations

import torch
from flashrt import refmath

from .npu_runtime import npu_family, positions_of, select_top, via_torch


def topk_positions(scores, k, candidates):
    """``topk_positions`` -> ``torch.topk`` (the NPU's TopK) for the k-th largest value, then exact
    selection in plain torch.

    Neither ``torch.topk`` on the NPU nor torch_npu's top-k operators document a tie rule, and
    docs/ops.md wants ties to the lower position and the result in ascending position order. So only
    the k-th largest *value* is taken from the operator (a value does not depend on tie-breaking);
    entries above it are kept, entries equal to it are kept lowest position first until ``k`` are
    chosen (a cumulative count), and the chosen positions are scattered in ascending order with
    ``-1`` for each pick left over. Layout: ``[B, S, T]`` as is, top-k along the last dim.
    """
    B, S, T = scores.shape
    kk = min(k, T)
    if kk == 0:
        return torch.empty(B, S, 0, dtype=torch.int32, device=scores.device)
    via_torch("topk_positions", "torch.topk (aclnnTopk) for the k-th value; ties and order in plain torch")
    valid = torch.isfinite(scores)
    if candidates is not None:
        valid &= candidates
    return positions_of(select_top(scores, valid, kk), kk)


def candidate_blocks(scores, visible, topk_blocks, block_size):
    """``candidate_blocks``: block maxima (``amax`` over a padded ``[B, S, nb, block_size]`` view),
    the block of ``visible - 1`` pinned to ``+inf``, then the same exact selection as
    :func:`topk_positions` (``torch.topk`` for the threshold value, ties to the lower block in plain
    torch) among blocks with a finite score or pinned; kept blocks are expanded back to positions.
    """
    T = scores.shape[-1]
    if T == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    via_torch("candidate_blocks", "torch.topk (aclnnTopk) for the k-th block value; ties in plain torch")
    blocks, pinned = refmath.block_scores(scores, visible, block_size)
    keep = select_top(blocks, torch.isfinite(blocks) | pinned, min(topk_blocks, blocks.shape[-1]))
    return keep.repeat_interleave(block_size, -1)[..., :T]


FAMILY = npu_family("topk", {"topk_positions": topk_positions, "candidate_blocks": candidate_blocks},
                    "top-k positions and candidate blocks (torch.topk for the threshold)")
