"""What a step's outputs look like on the pipe between the engine process and the server process
(:mod:`flashrt.engine.core_process`, :mod:`flashrt.engine.client`): only what is new.

A :class:`~flashrt.engine.request.RequestOutput` carries its request's whole prompt and, per
completion, everything generated so far; pickling all of it for every running request every step
would cost the engine's thread time that grows with the prompts and outputs. :func:`slim` turns an
unfinished output into a tuple of its deltas; the server process, which sent the prompt ids itself,
keeps an :class:`Accumulator` per open request and rebuilds the whole output from them. A finished
output (an error output is one) travels whole, so a request's last output never depends on the
accumulated state.

Slim form: ``(request_id, [(index, delta_text, delta_token_ids, delta_logprobs, finish_reason,
stop_reason)], prefix_hit_tokens)`` where ``delta_logprobs`` is a list of ``(token, logprob,
top)`` tuples, or None when the request asked for no logprobs.
"""
from __future__ import annotations

from .request import CompletionOutput, RequestOutput, TokenLogprob


def slim(out: RequestOutput):
    """``out`` as it goes on the pipe: the slim tuple while its request runs, else ``out`` itself."""
    if out.finished or out.error is not None:
        return out
    return (out.request_id, [_slim_completion(c) for c in out.outputs], out.prefix_hit_tokens)


def _slim_completion(c: CompletionOutput) -> tuple:
    lps = None if c.logprobs is None else [(lp.token, lp.logprob, lp.top) for lp in c.delta_logprobs]
    return (c.index, c.delta_text, c.delta_token_ids, lps, c.finish_reason, c.stop_reason)


def is_last(wire) -> bool:
    """Whether ``wire`` (as :func:`slim` made it) is its request's last output."""
    return isinstance(wire, RequestOutput) and wire.finished


class _Sofar:
    """One completion's text, token ids and logprobs (None when not asked for) so far."""
    __slots__ = ("text", "token_ids", "logprobs")

    def __init__(self, logprobs: bool):
        self.text, self.token_ids = "", []
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None


class Accumulator:
    """The server process's record of one open request: its prompt ids and what each completion
    has generated so far, from which :meth:`take` rebuilds whole outputs."""
    __slots__ = ("prompt_token_ids", "completions")

    def __init__(self, prompt_token_ids: list[int]):
        """``prompt_token_ids``: the ids the request was added with (shared by all its outputs)."""
        self.prompt_token_ids = prompt_token_ids
        self.completions: dict[int, _Sofar] = {}

    def take(self, wire) -> RequestOutput:
        """The whole output for ``wire`` (as :func:`slim` made it): a whole output as it is; a slim
        one rebuilt with its deltas appended to what came before (new lists each time)."""
        if isinstance(wire, RequestOutput):
            return wire
        request_id, completions, prefix_hit_tokens = wire
        outs = [self._completion(*c) for c in completions]
        return RequestOutput(request_id, self.prompt_token_ids, outs, False, None, prefix_hit_tokens)

    def _completion(self, index, delta_text, delta_token_ids, delta_logprobs, finish_reason, stop_reason):
        s = self.completions.get(index)
        if s is None:
            s = self.completions[index] = _Sofar(delta_logprobs is not None)
        s.text += delta_text
        s.token_ids += delta_token_ids
        logprobs, deltas = None, []
        if delta_logprobs is not None:
            deltas = [TokenLogprob(*lp) for lp in delta_logprobs]
            s.logprobs += deltas
            logprobs = list(s.logprobs)
        return CompletionOutput(index, s.text, list(s.token_ids), logprobs, finish_reason, delta_text=delta_text,
                                delta_token_ids=delta_token_ids, delta_logprobs=deltas, stop_reason=stop_reason)
