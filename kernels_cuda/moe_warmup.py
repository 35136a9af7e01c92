"""Warm-up launches of ``moe_experts`` and its routing tables (:mod:`.moe`'s FAMILY): every tile rule,
the shared expert in the routed launches and alone, the tables at the model's expert count."""
from __future__ import annotations

import torch

from flashrt import formats, profiles
from flashrt.kernels_cuda import moe, moe_tables  # moe imports this module: names read at call time
from flashrt.kernels_cuda import warmup as _warmup
from flashrt.kernels_cuda.launch import zeros_stored


def warmup_cases(device, d: dict, dtype):
    """moe_experts with every tile rule (a token count whose mean rows per expert falls in it), with
    the shared expert (``fp8_w``) in the same launches where the model has one, and the shared
    expert alone (E = 1, k = 1: the expert-parallel path). 16 experts stand for the model's: the
    kernels see E only as an integer (specialised on % 16, like 32 and 384), and the token count
    picks the rule."""
    D, I, k, E = d["dim"], d["moe_inter_dim"], d["n_activated_experts"], 16
    fmt = "fp4_w" if d["expert_dtype"] == "fp4" else "fp8_w"
    profile = profiles.active_profile()
    k_major, words = profile.expert_scales == "k_major", profile.expert_fp4 == "words"
    stack = lambda f, shape: formats.as_expert_stack(zeros_stored(f, shape, None, device), k_major, words)  # as loaded
    weights = {e: (stack(fmt, (e, I, D)), stack(fmt, (e, I, D)), stack(fmt, (e, D, I))) for e in (E, 1)}
    shared = tuple(stack("fp8_w", s) for s in ((1, I, D), (1, I, D), (1, D, I)))
    with_shared = (None, dtype, shared) if d.get("n_shared_experts") else ()  # the model's call
    for n in sorted({1, *rule_tokens(moe.PLANS.tiles()["experts"], E, k)}):  # 1: a batch-1 step's pair tiles
        x, rw = _warmup.rand((n, D), dtype, device), torch.rand(n, k, device=device)
        idx = torch.randint(0, E, (n, k), dtype=torch.int32, device=device)
        yield _warmup.Launch("moe_experts", moe.moe_experts, (x, rw, idx, *weights[E], d["swiglu_limit"], *with_shared))
    for n in _warmup.TOKENS:
        x, one = _warmup.rand((n, D), dtype, device), torch.ones(n, 1, device=device)
        first = torch.zeros(n, 1, dtype=torch.int32, device=device)
        yield _warmup.Launch("moe_experts shared", moe.moe_experts, (x, one, first, *weights[1], d["swiglu_limit"]))
    yield from route_cases(device, d["n_routed_experts"], k)


def route_cases(device, experts: int, k: int):
    """The routing tables at the model's expert count (their kernels' expert width follows it, where
    the experts' GEMMs above see 16 stand-in experts): the one-program kernel at every power-of-two
    pair count it serves (its sort width follows the pairs: decode batches, prefill chunks) and the
    sorted path past it, for each tile rule's row height (its ``qgmma`` row tiles' where it takes that knob)."""
    route = moe.PLANS.tiles()["route"]
    rules = [t for _, t in moe.PLANS.tiles()["experts"]]
    heights = {t["BLOCK_M"] for t in rules} | {moe.qgmma_rows(t) for t in rules if t.get("qgmma")}
    for bm in sorted(heights):
        pairs = 16
        while pairs <= route["max_pairs"]:
            yield _route_launch(device, experts, k, max(1, pairs // k), bm, route)  # sort width: pairs
            pairs *= 2
        if route["large"]:
            yield _route_launch(device, experts, k, route["max_pairs"] // k + 1, bm, route)


def _route_launch(device, experts: int, k: int, tokens: int, bm: int, route: dict):
    idx = torch.randint(0, experts, (tokens, k), dtype=torch.int32, device=device)
    return _warmup.Launch(f"moe route tables {tokens * k} pairs", moe_tables.route_tables,
                          (idx, torch.rand(tokens, k, device=device), experts, bm, route))


def rule_tokens(rules, experts: int, k: int) -> list[int]:
    """One token count per tile rule whose mean rows per expert (n * k / experts) it serves."""
    out, low = [], 0
    for limit, _ in rules:
        rows = limit if limit is not None else 2 * max(low, 16)
        n = max(1, rows * experts // k)
        assert n * k / experts > low, (rules, n)
        out.append(n)
        low = limit if limit is not None else low
    return out
