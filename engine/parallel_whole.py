"""One request run whole on every group of a multi-device run: what ``flashrt run --tp / --ep``
does for CED prefill, the prefix cache and images (docs/parallel.md; the vision tower is
replicated on every rank: it is small, and its span embeddings then need no exchange).

Every rank calls :func:`flashrt.engine.generation.generate` with the same request: its prefill
schedule, prefix lookups, image spans and decode steps are the same on every rank (the logits are
all-reduced or all-gathered, so every value a schedule decides on is the same everywhere), and so
are the collectives of the layers. With ``ep > 1`` each group runs the whole request and the MoE
layers use the ``replicated`` dispatch (no token moves; each rank runs its own experts' pairs).
The prefix cache is consulted in lockstep (:class:`AgreedPrefixCache`).
"""
from __future__ import annotations

import torch

from flashrt import distributed

from .generation import generate
from .parallel import ParallelResult


class AgreedPrefixCache:
    """A :class:`~flashrt.kv.prefix_cache.PrefixCache` that every rank consults in the same order:
    a lookup is a hit only where every rank finds its own entry (one small all-reduce per lookup),
    so the ranks prefill the same tokens. Each rank stores and loads its own state under its own
    keys (the key's model identity covers the rank's shard of the weights)."""

    def __init__(self, cache):
        self.cache = cache

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def get(self, key: str):
        found = self.cache.get(key)
        flag = torch.tensor([int(found is not None)], device=distributed.collective_device())
        if distributed.all_reduce(flag, "min").item():
            return found
        if found is not None:  # this rank had it, another did not: a miss for everyone
            self.cache.hits -= 1
            self.cache.misses += 1
        return None


def generate_whole(model, ids: list[int], job: dict, progress, cache=None, images=None) -> ParallelResult:
    """``generate`` of one prompt on this rank, as every other rank runs it; the load per decode step
    is taken as each step's token is reported."""
    par = model.parallel
    if par.layout.ep > 1:
        par.dispatch = "replicated"
    load = []

    def report(phase, done, total):
        if phase == "decode":  # the first token's: the prefill's pairs, dropped; then one decode step's
            pairs = par.take_load()
            if done >= 2:
                load.append(pairs)
        progress(phase, done, total)
    r = generate(model, [ids], job["max_new_tokens"], temperature=job["temperature"], prefill=job["prefill"],
                 seed=job["seed"], eos_token_id=job["eos"], kv_budget=job["kv_budget"],
                 prefill_chunk=job["prefill_chunk"], prefix_cache=None if cache is None else AgreedPrefixCache(cache),
                 cuda_graph=job["cuda_graph"], progress=report, images=images)
    return ParallelResult(r.tokens, r.prompt_tokens, r.new_tokens, r.prefill_seconds, r.decode_seconds, [0],
                          r.first_logits, [], load, r.state, r.step_capture, r.image_tokens)
