"""Requests and their sequences inside the serving engine, and what the engine hands back.

A :class:`Request` has ``n`` :class:`Sequence` objects (one until its prompt is prefilled, then
forked). A sequence's ``tokens`` are its prompt then its output; ``computed`` of them are in its KV
state. The next forward call of a sequence runs ``tokens[computed:...]``: prompt chunks while
prefilling, then one token per decode step. When ``computed`` reaches ``len(tokens)`` the step's
logits are sampled; below it (a sequence recomputing after a preemption) the known tokens are fed
again without sampling, which reproduces the original run exactly.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from .sampling import Sampled, SamplerRow, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # nothing computed (new, or dropped by a preemption)
    PREFILL = "prefill"  # prompt chunks running in its own one-row state
    RUNNING = "running"  # a row of the decode batch
    SWAPPED = "swapped"  # preempted, its KV state on the host
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything so far (stop string removed)
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None (still running)
    delta_text: str = ""  # new since the previous output of this sequence
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_reason: str | int | None = None  # the stop string or token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]  # one list shared by the outputs of a request: read it, do not change it
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    prefix_hit_tokens: int = 0


class Sequence:
    def __init__(self, request: "Request", index: int, generator: torch.Generator | None,
                 output: list[int] | None = None):
        self.request, self.index, self.generator = request, index, generator
        self.tokens = list(request.prompt) + list(output or [])
        self.prompt_len = len(request.prompt)  # a request's prompt never changes
        self.order = (request.arrival_index, index)  # scheduling priority: earlier requests first (preemption takes the last)
        self.computed = 0
        self.status = Status.WAITING
        self.state = None  # the KVState it prefills in (row ``row``) while prefilling
        self.row = 0
        self.slot: int | None = None  # its row of the decode batch while running
        self.snapshot = None  # its KV state on the host while swapped
        self.logprobs: list[TokenLogprob] | None = [] if request.params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.text = ""  # the decoded output so far (whole characters only)
        self.decoder = None  # its tokenizer's incremental decoder, made at the first token
        self.emitted_text = self.emitted_tokens = self.emitted_logprobs = 0
        self.stop_cut: int | None = None  # text length kept after a stop string
        self.prefix_snap = None  # a cached prefix of its prompt, restored when it starts
        self.looked_up = False  # the prefix store was asked (once per start)
        self.forked_from: Sequence | None = None  # set for the step in which it was forked
        self._sampler_row: SamplerRow | None = None  # kept once it no longer changes (sampler_row)

    @property
    def output(self) -> list[int]:
        """The generated tokens (a new list)."""
        return self.tokens[self.prompt_len:]

    @property
    def n_output(self) -> int:
        """How many tokens it has generated (``len(self.output)`` without the copy)."""
        return len(self.tokens) - self.prompt_len


    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def sampler_row(self, eos: int | None) -> SamplerRow:
        if self._sampler_row is not None:
            return self._sampler_row
        p = self.request.params
        output = self.output if p.penalized else []  # only the penalties read the history
        if self.n_output < p.min_tokens:
            banned = tuple(p.stop_token_ids) + ((eos,) if eos is not None and not p.ignore_eos else ())
            return SamplerRow(p, self.generator, self.request.prompt, output, banned)
        row = SamplerRow(p, self.generator, self.request.prompt, output)
        if not p.penalized:  # nothing in it changes from now on
            self._sampler_row = row
        return row

    def append(self, s: Sampled) -> None:
        self.tokens.append(s.token)
        if self.logprobs is not None:
            self.logprobs.append(TokenLogprob(s.token, s.logprob, s.top or []))


class Request:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, arrival_index: int,
                 max_tokens: int, images=None):
        self.id, self.prompt, self.params = request_id, prompt, params
        self.images = images  # its PromptImages (engine/images.py), None without images
        self.arrival_index = arrival_index
        self.max_tokens = max_tokens  # params.max_tokens, or what the context leaves
        self.arrival = time.monotonic()
        self.scheduled_time: float | None = None  # its first prompt chunk was planned (the queue ends)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.seqs: list[Sequence] = []
        self.prompt_ids = list(prompt)  # the ``prompt_token_ids`` of its outputs: one copy, not one per output
        self.prefix_hit_tokens = 0
        self.error: str | None = None
        self.sink = None  # called with each RequestOutput (from the engine's thread)

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.status is not Status.FINISHED:
                return False
        return bool(self.seqs)

    @property
    def output_tokens(self) -> int:
        return sum(s.n_output for s in self.seqs)


@dataclass(frozen=True)
class Finished:
    """The times of a finished request (what ``/metrics`` histograms read; monotonic clock, shared
    by the processes of one machine)."""
    arrival: float
    first_token_time: float | None
    finish_time: float | None
    output_tokens: int
    n_seqs: int
    scheduled_time: float | None = None


def finished_record(req) -> Finished:
    return Finished(req.arrival, req.first_token_time, req.finish_time, req.output_tokens, len(req.seqs),
                    req.scheduled_time)
