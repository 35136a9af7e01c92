"""Per-request sampling: :class:`SamplingParams` and a batched sampler over fp32 logits [B, vocab].

Each row of a batch carries its own parameters and its own ``torch.Generator`` (seeded from the
request's ``seed``), so a request's draws do not depend on what else is in the batch. The order
of the logits processors follows vLLM: penalties on the raw logits, then temperature, then
``min_p`` (relative to the most likely token), ``top_k`` and ``top_p`` (over what ``top_k``
kept, renormalized), then one draw. Temperature 0 is greedy: exactly ``ops.sample(logits, 0)``
(argmax, ties to the lower id) on the penalized logits. Log-probabilities are those of the
model's raw distribution (``log_softmax`` of the logits, before any processing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashrt import ops
from flashrt.kv.util import to_device

MAX_LOGPROBS = 20


def _bad(name: str, expected: str, value) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {value!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    """How one request samples. Defaults follow the OpenAI API (temperature 1, max_tokens 16)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no limit
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0  # no stop token / EOS before this many tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-N alternatives per token (0: only the sampled token's)

    def __post_init__(self):
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", "an int >= 1", self.n)
        if not _is_num(self.temperature) or self.temperature < 0:
            raise _bad("temperature", "a number >= 0", self.temperature)
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", "a number in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", "an int >= 1, or 0 / -1 for no limit", self.top_k)
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", "a number in [0, 1]", self.min_p)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", "an int >= 1 or None", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", "an int >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", f"at most max_tokens ({self.max_tokens})", self.min_tokens)
        self.stop = self._strings(self.stop)
        self.stop_token_ids = self._ids(self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, "a bool", getattr(self, name))
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", "an int or None", self.seed)
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", "a number > 0", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                raise _bad(name, "a number in [-2, 2]", v)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _bad("logprobs", f"an int in [0, {MAX_LOGPROBS}] or None", self.logprobs)

    @staticmethod
    def _strings(stop) -> tuple[str, ...]:
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", "a non-empty string or a list of them", stop)
        return tuple(stop)

    @staticmethod
    def _ids(ids) -> tuple[int, ...]:
        ids = () if ids is None else ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise _bad("stop_token_ids", "a list of token ids (ints >= 0)", ids)
        return tuple(ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in ``stop_token_ids`` must exist in the model's vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise _bad("stop_token_ids", f"ids below the vocabulary size {vocab_size}", bad)


@dataclass
class SamplerRow:
    """What the sampler needs of one sequence: its parameters, generator and token history."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt: list[int]
    output: list[int]  # the tokens generated so far, for the penalties (empty for a row without them)
    banned: tuple[int, ...] = ()  # ids masked out this step (stop ids / EOS before min_tokens)


@dataclass
class Sampled:
    token: int
    logprob: float | None = None  # of the raw distribution
    top: list[tuple[int, float]] | None = None  # the top-N (id, logprob), most likely first


def apply_penalties(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """Repetition (prompt and output tokens: positive logits divided, negative multiplied),
    frequency (times each output token's count) and presence (once per output token) penalties."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        if not p.penalized:
            continue
        row = out[i]
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(r.prompt) | set(r.output)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if r.output and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(r.output, dtype=torch.long), minlength=row.shape[0])
            counts = counts.to(device=row.device, dtype=row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return out


def filter_logits(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``z`` [B, V] (already divided by the temperature) with the tokens that ``min_p``,
    ``top_k`` (0: none) and ``top_p`` (over what the first two kept) remove set to ``-inf``."""
    B, V = z.shape
    srt, order = z.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=z.device).expand(B, V)
    probs = torch.softmax(srt, dim=-1)
    drop = rank >= torch.where(top_k > 0, top_k, V).unsqueeze(1)
    drop |= probs < (min_p * probs[:, 0]).unsqueeze(1)
    kept = torch.softmax(srt.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (kept.cumsum(-1) - kept) >= top_p.unsqueeze(1)  # the mass before a token already reached p
    drop[:, 0] = False  # the most likely token always stays
    return torch.full_like(z, float("-inf")).scatter(1, order, srt.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> list[Sampled]:
    """One token per row of fp32 ``logits`` [B, vocab], each row under its own parameters."""
    return sample_async(logits, rows).result()


def sample_async(logits: torch.Tensor, rows: list[SamplerRow]) -> "SampleJob":
    """:func:`sample` with the host left out until :meth:`SampleJob.result`: the draws (and the
    log-probabilities asked for) are queued on the device, their copy to the host started, and
    ``job.tokens`` holds the tokens on the device (row order), so the next forward can read them
    before the host has."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits: expected [{len(rows)}, vocab], got {tuple(logits.shape)}")
    raw = logits.to(torch.float32)
    z = apply_penalties(raw, rows) if any(r.params.penalized for r in rows) else raw
    if any(r.banned for r in rows):
        z = z.clone() if z is raw else z
        for i, r in enumerate(rows):
            if r.banned:
                z[i].index_fill_(0, to_device(sorted(r.banned), z.device), float("-inf"))  # t[idx] = number would wait
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
    parts = []  # token tensors on the device, in the order of ``greedy + drawn``
    if greedy:
        parts.append(ops.sample(_rows(z, greedy) if len(greedy) < len(rows) else z, 0.0))
    if drawn:
        par = [rows[i].params for i in drawn]
        # the rows' settings in one host->device copy (float64 holds each exactly; a top_k past the
        # vocabulary keeps every token, as the vocabulary's size does)
        V = z.shape[1]
        packed = to_device([[p.temperature for p in par], [min(max(p.top_k, 0), V) for p in par],
                            [p.top_p for p in par], [p.min_p for p in par]], z.device, torch.float64)
        temp, top_p, min_p = (packed[i].to(torch.float32) for i in (0, 2, 3))
        filt = filter_logits(_rows(z, drawn) / temp.unsqueeze(1), packed[1].to(torch.long), top_p, min_p)
        # one generator per row: its draws depend on nothing else
        parts += [ops.sample(filt[j:j + 1], 1.0, rows[i].generator) for j, i in enumerate(drawn)]
    picked = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
    order = greedy + drawn
    if order != list(range(len(rows))):  # back to row order
        picked = torch.empty_like(picked).index_copy_(0, to_device(order, picked.device), picked)
    return SampleJob(raw, rows, picked.to(torch.long))


class SampleJob:
    """Tokens drawn on the device (``tokens``, int64 [B] in row order) and, for the rows that ask,
    their log-probabilities, on their way to the host; :meth:`result` waits for them."""

    def __init__(self, raw: torch.Tensor, rows: list[SamplerRow], tokens: torch.Tensor):
        self.tokens = tokens
        self.want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        self.ks = [rows[i].params.logprobs for i in self.want]
        device_parts = [tokens]
        if self.want:
            lp = torch.log_softmax(raw[self.want], dim=-1)
            n = max(self.ks)
            device_parts.append(lp.gather(1, tokens[self.want].unsqueeze(1))[:, 0])
            if n:
                top_v, top_i = lp.topk(n, dim=-1)
                device_parts += [top_i, top_v]
        self._copy = HostCopy(*device_parts)
        self._result: list[Sampled] | None = None

    def result(self) -> list[Sampled]:
        """One :class:`Sampled` per row (waits for the device's copies once)."""
        if self._result is None:
            host = self._copy.lists()
            out = [Sampled(t) for t in host[0]]
            for j, i in enumerate(self.want):
                k = self.ks[j]
                top = list(zip(host[2][j][:k], host[3][j][:k])) if k else []
                out[i] = Sampled(out[i].token, host[1][j], top)
            self._result = out
        return self._result


class HostCopy:
    """Copies of device tensors on the host, started now (into pinned memory, not waited for, from
    a CUDA device): the device goes on with what is queued after them; :meth:`lists` waits."""

    def __init__(self, *tensors: torch.Tensor):
        self._host = [_to_host(t) for t in tensors]
        self._ready = None
        if any(t.is_cuda for t in tensors):
            self._ready = torch.cuda.Event()
            self._ready.record()

    def lists(self) -> list[list]:
        """Each tensor as (nested) Python lists, once its copy has landed."""
        if self._ready is not None:
            self._ready.synchronize()
        return [t.tolist() for t in self._host]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _rows(z: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return z.index_select(0, to_device(rows, z.device))


def make_generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
