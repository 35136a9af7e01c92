"""Engine outputs as OpenAI response bodies: completions and chat completions, whole or as SSE chunks."""
from __future__ import annotations

import json
import time

from .. import text
from ..request import CompletionOutput, RequestOutput, TokenLogprob
from . import chat


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
    """Bodies of one response: ``kind`` "completion" or "chat" (``thinking``: the chat prompt's
    mode, which decides how the text splits); choice index = prompt * n + seq."""

    def __init__(self, kind: str, rid: str, model: str, tokenizer, n: int, thinking: bool = True):
        self.kind, self.id, self.model, self.tok, self.n = kind, rid, model, tokenizer, n
        self.thinking = thinking
        self.created = int(time.time())
        self.offsets: dict[int, tuple] = {}  # completions: (text offset, incremental decoder) per choice
        self.streams: dict[int, chat.ChatStream] = {}  # chat: the split of each choice's stream
        self.sent_role: set[int] = set()
        self.ended: set[int] = set()  # choices whose finish_reason went out

    def token_text(self, t: int) -> str:
        return text.token_str(self.tok, t)

    # ----- logprobs --------------------------------------------------------------------------------
    def completion_logprobs(self, index: int, lps: list[TokenLogprob] | None) -> dict | None:
        """Logprobs of the next tokens of choice ``index``; a token's text offset is where the
        text it completes starts (the choice's text decoded token by token)."""
        if lps is None:
            return None
        at, decoder = self.offsets.get(index) or (0, self.tok.stream())
        offsets = []
        for lp in lps:
            offsets.append(at)
            at += len(decoder.push(lp.token))
        self.offsets[index] = (at, decoder)
        return {"tokens": [self.token_text(lp.token) for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def chat_logprobs(self, lps: list[TokenLogprob] | None) -> dict | None:
        if lps is None:
            return None
        entry = lambda t, v: {"token": self.token_text(t), "logprob": v,
                              "bytes": list(text.token_bytes(self.tok, t) or b"")}
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
        msg = chat.message(c.text, self.thinking)
        return {"index": index, "message": msg, "logprobs": self.chat_logprobs(c.logprobs),
                "finish_reason": chat.finish_reason(finish_reason(c), msg), "stop_reason": c.stop_reason}

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
        split = self.streams.setdefault(index, chat.ChatStream(self.thinking))
        reasoning, content, msg = split.delta(c.text, c.finish_reason is not None)
        delta = {"role": "assistant"} if index not in self.sent_role else {}
        self.sent_role.add(index)
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content or not reasoning:
            delta["content"] = content
        reason = finish_reason(c)
        if msg is not None and msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(msg["tool_calls"])]
            reason = chat.finish_reason(reason, msg)
        choice = {"index": index, "delta": delta, "finish_reason": reason,
                  "logprobs": self.chat_logprobs(c.delta_logprobs if c.logprobs is not None else None)}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> str:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return sse({"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens)})
