"""Expert-parallel dispatch and combine: this group's tokens through the routed experts of every rank.

Both return this rank's share of the routed experts' sum for its group's tokens, fp32 ``[>= n, D]``
(the group's ranks then add the shared expert and all-reduce, :meth:`MoE._forward_parallel`).

``gather`` (the default): every group's tokens are all-gathered, every rank routes all of them
and runs the (token, expert) pairs of its own experts, and a reduce-scatter hands each group the
sums for its tokens. Fixed shapes, two collectives per layer.

``all_to_all``: each group routes its own tokens; rank ``t`` of a group sends each token once to
every rank of slice ``t`` that holds some of its experts (every pair leaves the group once), with
the (weight, expert) pairs it runs there; that rank sends back one fp32 sum per token. A count
exchange first, split sizes known on the host, five collectives per layer; fewer bytes when the
ranks outnumber top-k.

``replicated``: every group already holds the same tokens (the serving engine runs every sequence
on every group); each rank runs its own experts' pairs and one all-reduce across the groups adds
them up. One collective per layer, no token exchange; attention is repeated on every group.

``routed_static`` (taken instead of any of them inside :meth:`Parallel.static_shapes`, which
CUDA-graph-captured decode steps use): the collectives of ``gather`` (or of ``replicated``) with
fixed shapes and no host sync. Each rank runs every routed slot of every row (the padded rows of
every group too) through ``moe_experts``, the slots of other ranks' experts and the padding rows
weighing 0 and pointed at a local expert: their outputs are exact zeros (the routing weight scales
W2's input), so the sum is the dynamic dispatch's, with ``world`` times the expert slots computed
(the weights read are the same: the decode step's cost at small batches).
"""
from __future__ import annotations

import torch

from flashrt import distributed, ops


def _pairs(moe, xs: torch.Tensor, rows: torch.Tensor, partial: torch.Tensor, vl=None) -> None:
    """Add into ``partial`` the outputs of the (token, expert) pairs of ``xs[rows]`` on this rank's
    experts (``vl``: the image-span rows of ``xs``, routed with ``bias_vl``)."""
    cfg = moe.cfg
    weights, indices = moe.routes(xs[rows], None if vl is None else vl[rows])
    moe.par.record_load(indices, moe.n_routed)
    local = indices - moe.first
    tok, slot = torch.nonzero((local >= 0) & (local < moe.w1.shape[0]), as_tuple=True)
    if tok.numel():  # one (token, expert) pair per row: only the pairs this rank serves run
        y = ops.moe_experts(xs[rows[tok]], weights[tok, slot].unsqueeze(1),
                            local[tok, slot].unsqueeze(1).to(torch.int32), moe.w1, moe.w3, moe.w2, cfg.swiglu_limit)
        partial.index_add_(0, rows[tok], y)


def _no_spans_across_groups(par, vl) -> None:
    if vl is not None and par.layout.ep > 1:
        raise ValueError("vl_mask: tokens of image spans exchanged between expert-parallel groups are not "
                         "supported; run image requests whole on every group (the 'replicated' dispatch)")


def routed_gather(moe, x: torch.Tensor, vl=None) -> torch.Tensor:
    par = moe.par
    _no_spans_across_groups(par, vl)
    xs, counts = par.gather_tokens(x)  # [ep * m, D], group blocks of m rows
    m = xs.shape[0] // len(counts)
    rows = torch.cat([torch.arange(g * m, g * m + c, device=x.device) for g, c in enumerate(counts)])
    partial = torch.zeros(xs.shape[0], xs.shape[1], dtype=torch.float32, device=x.device)
    if rows.numel():
        _pairs(moe, xs, rows, partial, vl)
    return distributed.reduce_scatter(partial, group=par.ep_group) if par.layout.ep > 1 else partial


def _a2a(par, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    return distributed.all_to_all(t, send, recv, group=par.ep_group) if par.layout.ep > 1 else t


def routed_all_to_all(moe, x: torch.Tensor, vl=None) -> torch.Tensor:
    par, cfg, layout = moe.par, moe.cfg, moe.par.layout
    n, ep, dev = x.shape[0], layout.ep, x.device
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=dev)
    row_tok = torch.empty(0, dtype=torch.long, device=dev)
    meta = torch.empty(0, 3, dtype=torch.float32, device=dev)  # (row in its block, routing weight, expert on its rank)
    counts = torch.zeros(ep, 2, dtype=torch.long, device=dev)  # rows and pairs for each destination
    if n:
        weights, indices = moe.routes(x, vl)
        par.record_load(indices, moe.n_routed)
        per = moe.n_routed // layout.world
        owner = indices.long() // per  # the global rank holding each pair's expert
        tok, slot = torch.nonzero(owner % layout.tp == layout.tp_rank, as_tuple=True)
        dest = owner[tok, slot] // layout.tp  # its place in this rank's expert-parallel slice
        uniq, row = torch.unique(dest * n + tok, return_inverse=True)  # one row per (destination, token)
        row_tok, row_dest = uniq % n, uniq // n
        counts[:, 0] = torch.bincount(row_dest, minlength=ep)
        counts[:, 1] = torch.bincount(dest, minlength=ep)
        order = torch.argsort(row, stable=True)  # pairs grouped by destination, as the rows are
        first_row = torch.cumsum(counts[:, 0], 0) - counts[:, 0]
        meta = torch.stack([(row - first_row[dest]).to(torch.float32), weights[tok, slot],
                            (indices[tok, slot] % per).to(torch.float32)], dim=1)[order]
    recv = _a2a(par, counts, [1] * ep, [1] * ep).tolist()
    sent = counts.tolist()
    rows = _a2a(par, x[row_tok], [c[0] for c in sent], [c[0] for c in recv])
    pairs = _a2a(par, meta, [c[1] for c in sent], [c[1] for c in recv])
    sums = torch.zeros(rows.shape[0], x.shape[1], dtype=torch.float32, device=dev)
    if pairs.shape[0]:  # a received pair names its row by its index in the sender's block
        got_rows, got_pairs = (torch.tensor([c[i] for c in recv], device=dev) for i in (0, 1))
        source = torch.repeat_interleave(torch.arange(ep, device=dev), got_pairs)
        at = pairs[:, 0].long() + (torch.cumsum(got_rows, 0) - got_rows)[source]
        y = ops.moe_experts(rows[at], pairs[:, 1:2].contiguous(), pairs[:, 2:].to(torch.int32), moe.w1, moe.w3,
                            moe.w2, cfg.swiglu_limit)
        sums.index_add_(0, at, y)
    back = _a2a(par, sums, [c[0] for c in recv], [c[0] for c in sent])
    out.index_add_(0, row_tok, back)
    return out


def routed_replicated(moe, x: torch.Tensor, vl=None) -> torch.Tensor:
    """Every group runs the same tokens: no tokens move; each rank runs the pairs of its own
    experts and one all-reduce across the groups sums every slice's share (each pair runs once)."""
    par = moe.par
    partial = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _pairs(moe, x, torch.arange(x.shape[0], device=x.device), partial, vl)
    return distributed.all_reduce(partial, group=par.ep_group) if par.layout.ep > 1 else partial


def _static_pairs(moe, xs: torch.Tensor, valid: torch.Tensor | None, counted: torch.Tensor | None,
                  vl=None) -> torch.Tensor:
    """fp32 ``[N, D]``: this rank's experts' share of every row of ``xs`` (rows where ``valid`` is
    False give zeros), with fixed shapes; ``counted`` rows go into the load count."""
    cfg = moe.cfg
    weights, indices = moe.routes(xs, vl)
    moe.par.record_load(indices, moe.n_routed, counted)
    local = indices - moe.first
    mine = (local >= 0) & (local < moe.w1.shape[0])
    if valid is not None:
        mine = mine & valid.unsqueeze(1)
    return ops.moe_experts(xs, torch.where(mine, weights, 0.0), torch.where(mine, local, 0).to(torch.int32),
                           moe.w1, moe.w3, moe.w2, cfg.swiglu_limit)


def routed_static(moe, x: torch.Tensor, vl=None) -> torch.Tensor:
    """The gather (or replicated) dispatch with fixed shapes: no ``nonzero``, no host sync. Needs
    the token counts from the runner's plan (``Parallel.counts``) when groups exchange tokens."""
    par, layout = moe.par, moe.par.layout
    if par.dispatch == "replicated" or layout.ep == 1:
        partial = _static_pairs(moe, x, None, None, vl)
        return distributed.all_reduce(partial, group=par.ep_group) if layout.ep > 1 else partial
    _no_spans_across_groups(par, vl)
    if par.counts is None:
        raise ValueError("counts: the fixed-shape MoE dispatch needs every group's token count from the "
                         "runner's plan (Parallel.counts), got None")
    xs, counts = par.gather_tokens(x)
    m = xs.shape[0] // len(counts)
    row = torch.arange(m, device=x.device)
    valid = torch.cat([row < c for c in counts])  # the padding rows of each group block
    counted = valid
    if par.dispatch == "all_to_all":  # that dispatch counts each group's own pairs (take_load sums the groups)
        counted = torch.cat([valid[g * m:(g + 1) * m] & (g == layout.ep_rank) for g in range(len(counts))])
    partial = _static_pairs(moe, xs, valid, counted)
    return distributed.reduce_scatter(partial, group=par.ep_group)


DISPATCH = {"gather": routed_gather, "all_to_all": routed_all_to_all, "replicated": routed_replicated}
