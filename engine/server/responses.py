"""Engine outputs as OpenAI response bodies: completions and chat completions, whole or as SSE chunks."""
from __future__ import annotations

import json
import time

from ..request import CompletionOutput, RequestOutput, TokenLogprob


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, hit_tokens: int = 0) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if hit_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": hit_tokens}
    return out


def finish_reason(c: CompletionOutput) -> str | None:
    """OpenAI knows "stop" and "length"; an aborted or failed sequence reports "abort" / "error"."""
    return c.finish_reason


class Renderer:
    """Bodies of one response: ``kind`` "completion" or "chat"; choice index = prompt * n + seq."""

    def __init__(self, kind: str, rid: str, model: str, tokenizer, n: int):
        self.kind, self.id, self.model, self.tok, self.n = kind, rid, model, tokenizer, n
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # completions: text offset of each choice's next token
        self.sent_role: set[int] = set()
        self.ended: set[int] = set()  # choices whose finish_reason went out

    def token_text(self, t: int) -> str:
        as_str = getattr(self.tok, "token_str", None)
        return as_str(t) if as_str is not None else self.tok.decode([t])

    # ----- logprobs --------------------------------------------------------------------------------
    def completion_logprobs(self, index: int, lps: list[TokenLogprob] | None) -> dict | None:
        if lps is None:
            return None
        tokens = [self.token_text(lp.token) for lp in lps]
        offsets, at = [], self.offsets.get(index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self.offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def chat_logprobs(self, lps: list[TokenLogprob] | None) -> dict | None:
        if lps is None:
            return None
        entry = lambda t, v: {"token": self.token_text(t), "logprob": v,
                              "bytes": list(self.token_text(t).encode("utf-8"))}
        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    # ----- whole responses ---------------------------------------------------------------------------
    def full(self, outs: list[RequestOutput]) -> dict:
        choices, prompt, completion, hits = [], 0, 0, 0
        for p, out in enumerate(outs):
            prompt += len(out.prompt_token_ids)
            hits += out.prefix_hit_tokens
            for c in out.outputs:
                completion += len(c.token_ids)
                choices.append(self._choice(p * self.n + c.index, c))
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(prompt, completion, hits)}

    def _choice(self, index: int, c: CompletionOutput) -> dict:
        if self.kind == "completion":
            return {"index": index, "text": c.text, "logprobs": self.completion_logprobs(index, c.logprobs),
                    "finish_reason": finish_reason(c), "stop_reason": c.stop_reason}
        return {"index": index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self.chat_logprobs(c.logprobs), "finish_reason": finish_reason(c),
                "stop_reason": c.stop_reason}

    # ----- stream chunks ------------------------------------------------------------------------------
    def chunks(self, prompt_index: int, out: RequestOutput) -> list[str]:
        """SSE events for the deltas in ``out``."""
        events = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index in self.ended or not (c.delta_text or c.delta_token_ids or c.finish_reason
                                           or index not in self.sent_role):
                continue
            if c.finish_reason:
                self.ended.add(index)
            events.append(sse(self._chunk(index, c)))
        return events

    def _chunk(self, index: int, c: CompletionOutput) -> dict:
        if self.kind == "completion":
            choice = {"index": index, "text": c.delta_text,
                      "logprobs": self.completion_logprobs(index, c.delta_logprobs if c.logprobs is not None else None),
                      "finish_reason": finish_reason(c)}
            self.sent_role.add(index)
            return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [choice]}
        delta = {"content": c.delta_text}
        if index not in self.sent_role:
            delta["role"] = "assistant"
            self.sent_role.add(index)
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason(c),
                  "logprobs": self.chat_logprobs(c.delta_logprobs if c.logprobs is not None else None)}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> str:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return sse({"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens)})
