"""One request run whole on every group of a multi-device run: what ``flashrt run --tp / --ep``
does for CED prefill, the prefix cache, images and speculative decoding (docs/parallel.md; the
vision tower and the DSpark draft layers are replicated on every rank: they are small, and their
outputs then need no exchange).

Every rank calls :func:`flashrt.engine.generation.generate` with the same request: its prefill
schedule, prefix lookups, image spans and decode steps are the same on every rank (the logits are
all-reduced or all-gathered, so every value a schedule decides on is the same everywhere), and so
are the collectives of the layers. With ``ep > 1`` each group runs the whole request and the MoE
layers use the ``replicated`` dispatch (no token moves; each rank runs its own experts' pairs).
The prefix cache is consulted in lockstep (:class:`AgreedPrefixCache`). Speculative rounds draft on
every rank from the same hidden states and accept from the same verify logits (greedy: the same
argmax; sampling: the same seeded generator), so every rank keeps the same tokens and rolls back
the same; the one choice that is not a pure function of shared values, an adaptive ``k``, is rank
0's (:func:`flashrt.engine.adaptive.agreed`).
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
    (per verify round with ``job["speculative"]``) is taken as each step's tokens are reported.

    A verify round reports its tokens before the next round runs; a plain decode step is launched
    before the host reads (and reports) the tokens it started from: the prefill's pairs are taken
    when the prefill is reported (dropped), each decode report then holds the step just launched,
    and the last report (no step after it, or every row at EOS) holds none worth keeping."""
    par = model.parallel
    if par.layout.ep > 1:
        par.dispatch = "replicated"
    load, spec = [], job.get("speculative")

    def report(phase, done, total):
        if phase == "prefill" and not spec:
            par.take_load_tensor()  # the prefill's pairs, dropped
        elif phase == "decode" and spec:  # the first token's: the prefill's pairs, dropped; then a round's
            pairs = par.take_load_tensor()
            if done >= 2:
                load.append(pairs)
        elif phase == "decode" and done < total:
            load.append(par.take_load_tensor())
        progress(phase, done, total)
    r = generate(model, [ids], job["max_new_tokens"], temperature=job["temperature"], prefill=job["prefill"],
                 seed=job["seed"], eos_token_id=job["eos"], kv_budget=job["kv_budget"],
                 prefill_chunk=job["prefill_chunk"], prefix_cache=None if cache is None else AgreedPrefixCache(cache),
                 cuda_graph=job["cuda_graph"] and not job.get("speculative"),  # rounds across ranks: eager
                 progress=report, images=images,
                 speculative=job.get("speculative"), draft_tokens=job.get("draft_tokens", "auto"))
    return ParallelResult(r.tokens, r.prompt_tokens, r.new_tokens, r.prefill_seconds, r.decode_seconds, [0],
                          r.first_logits, [], [t.tolist() for t in load], r.state, r.step_capture, r.image_tokens,
                          r.speculative)
