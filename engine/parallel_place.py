"""Which expert-parallel group serves a new request (data-parallel attention, docs/parallel.md).

Rank 0 decides and sends the choice with the turn's commands, so only its view matters. A prompt
whose leading ``chunk``-token blocks were placed before goes where they went (that group's prefix
cache may hold their state: a hit skips those chunks); otherwise the group holding the fewest tokens
(prompts and outputs of its unfinished requests), then the one given the fewest requests, then the
lowest index. The prefix record is a bounded LRU of block-aligned prompt prefixes; the group's own
cache may have evicted an entry since, which costs a prefill, never a wrong token.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict


class Placer:
    def __init__(self, groups: int, chunk: int | None, keep: int = 1 << 14):
        """``chunk``: the prefix cache's block (None: no prefix cache, placement by load alone);
        ``keep``: prefixes remembered."""
        self.groups, self.chunk, self.keep = groups, chunk, keep
        self.holders: OrderedDict[bytes, int] = OrderedDict()  # prefix digest -> group it was placed on
        self.pending: dict[str, tuple[int, int]] = {}  # request id -> (group, prompt tokens), not yet added

    def _prefixes(self, prompt: list[int]) -> list[bytes]:
        """Digests of the prompt's block-aligned prefixes that a prefix cache can hold, shortest first."""
        if self.chunk is None:
            return []
        h, out = hashlib.blake2b(digest_size=16), []
        for end in range(self.chunk, len(prompt) + 1, self.chunk):
            h.update(repr(prompt[end - self.chunk:end]).encode())
            out.append(h.copy().digest())
        return out

    def choose(self, request_id: str, prompt: list[int], loads: list[int], placed: list[int]) -> int:
        """The group for a new request; ``loads``: tokens each group holds, ``placed``: requests each
        group was given. Remembered as pending until :meth:`settle`."""
        keys = self._prefixes(prompt)
        holder = next((self.holders[k] for k in reversed(keys) if k in self.holders), None)
        if holder is None:
            loads = [loads[g] + self.pending_tokens(g) for g in range(self.groups)]
            given = [placed[g] + sum(1 for p, _ in self.pending.values() if p == g) for g in range(self.groups)]
            holder = min(range(self.groups), key=lambda g: (loads[g], given[g], g))
        for k in keys:
            self.holders[k] = holder
            self.holders.move_to_end(k)
        while len(self.holders) > self.keep:
            self.holders.popitem(last=False)
        self.pending[request_id] = (holder, len(prompt))
        return holder

    def settle(self, request_id: str) -> None:
        """The request was added (or refused): its tokens now count in its group's load, or nowhere."""
        self.pending.pop(request_id, None)

    def pending_tokens(self, group: int) -> int:
        return sum(n for g, n in self.pending.values() if g == group)
