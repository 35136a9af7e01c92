"""Which expert-parallel group serves a new request (data-parallel attention, docs/parallel.md).

Rank 0 decides and sends the choice with the turn's commands, so only its view matters. Each group
is scored by the tokens it holds (prompts and outputs of its unfinished requests, requests placed
this turn included) less the prompt tokens its prefix cache may already hold for this prompt (the
longest run of leading ``chunk``-token blocks placed on it before): the lowest score wins, then
the group given the fewest requests, then the lowest index. A repeated prompt so goes back to the
group holding its prefix unless that group holds more tokens than the saving is worth; a prefix
every request shares (a system prompt) does not pull them all onto one group. The prefix record
is a bounded LRU on rank 0; a group's cache may have evicted an entry since, which costs a
prefill, never a wrong token.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict


class Placer:
    def __init__(self, groups: int, chunk: int | None, keep: int = 1 << 14):
        """``chunk``: the prefix cache's block (None: no prefix cache, placement by load alone);
        ``keep``: prefixes remembered."""
        self.groups, self.chunk, self.keep = groups, chunk, keep
        self.holders: OrderedDict[bytes, set[int]] = OrderedDict()  # prefix digest -> groups given it
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

    def cached(self, keys: list[bytes]) -> list[int]:
        """Prompt tokens each group may hold in its prefix cache (its longest block-aligned prefix)."""
        out = [0] * self.groups
        for blocks, k in enumerate(keys, 1):
            for g in self.holders.get(k, ()):
                out[g] = blocks * self.chunk
        return out

    def choose(self, request_id: str, prompt: list[int], loads: list[int], placed: list[int]) -> int:
        """The group for a new request; ``loads``: tokens each group holds, ``placed``: requests each
        group was given. Remembered as pending until :meth:`settle`."""
        keys = self._prefixes(prompt)
        saved = self.cached(keys)
        given = [placed[g] + sum(1 for p, _ in self.pending.values() if p == g) for g in range(self.groups)]
        group = min(range(self.groups),
                    key=lambda g: (loads[g] + self.pending_tokens(g) - saved[g], given[g], g))
        for k in keys:
            self.holders.setdefault(k, set()).add(group)
            self.holders.move_to_end(k)
        while len(self.holders) > self.keep:
            self.holders.popitem(last=False)
        self.pending[request_id] = (group, len(prompt))
        return group

    def settle(self, request_id: str) -> None:
        """The request was added (or refused): its tokens now count in its group's load, or nowhere."""
        self.pending.pop(request_id, None)

    def pending_tokens(self, group: int) -> int:
        return sum(n for g, n in self.pending.values() if g == group)
