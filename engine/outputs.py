"""Turning sampled tokens into what a client sees: finish checks (stop token ids, EOS, stop
strings, length), incremental text (through the tokenizer's incremental decoder, with held-back
stop-string prefixes), and output objects."""
from __future__ import annotations

import dataclasses

from .request import CompletionOutput, Request, RequestOutput, Sequence, Status


def check_finish(seq: Sequence, tokenizer, eos: int | None, max_model_len: int) -> None:
    """After a token was appended: extend ``seq.text`` through its incremental decoder (never
    part of a character; the stop token's own text left out) and set ``seq.finish_reason`` if it
    ends here."""
    p, tok, n_out = seq.request.params, seq.tokens[-1], seq.n_output
    by_id = tok in p.stop_token_ids or (eos is not None and tok == eos and not p.ignore_eos)
    if seq.decoder is None:
        seq.decoder = tokenizer.stream()
    before = len(seq.text)
    if not by_id:
        seq.text += seq.decoder.push(tok)
    at_length = n_out >= seq.request.max_tokens or len(seq.tokens) >= max_model_len
    if by_id or at_length:
        seq.text += seq.decoder.finish()
    if p.stop:
        start = max(0, before - max(map(len, p.stop)) + 1)
        hits = [(seq.text.find(s, start), s) for s in p.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits, key=lambda h: h[0])
            seq.stop_cut = i + len(s) if p.include_stop_str_in_output else i
            seq.finish_reason, seq.stop_reason = "stop", s
            return
    if by_id:
        seq.finish_reason, seq.stop_reason = "stop", tok
    elif at_length:
        seq.finish_reason = "length"


def visible_text(seq: Sequence) -> str:
    """The text a client may see now: cut at a stop string; while running, without a tail that
    could still become a stop string."""
    if seq.stop_cut is not None:
        return seq.text[:seq.stop_cut]
    text, stop = seq.text, seq.request.params.stop
    if seq.finish_reason is None and stop:
        hold = max(map(len, stop)) - 1
        text = text[:len(text) - hold] if hold else text
    return text


def completion(seq: Sequence) -> CompletionOutput:
    """This sequence's output so far, with what is new since the previous call."""
    text = visible_text(seq)
    out = seq.output  # a new list: the output's own
    lps = seq.logprobs
    c = CompletionOutput(seq.index, text, out, None if lps is None else list(lps), seq.finish_reason,
                         delta_text=text[seq.emitted_text:], delta_token_ids=seq.tokens[seq.prompt_len + seq.emitted_tokens:],
                         delta_logprobs=[] if lps is None else lps[seq.emitted_logprobs:], stop_reason=seq.stop_reason)
    seq.emitted_text, seq.emitted_tokens = max(seq.emitted_text, len(text)), len(out)
    seq.emitted_logprobs = 0 if lps is None else len(lps)
    return c


def request_output(req: Request) -> RequestOutput:
    return RequestOutput(req.id, req.prompt_ids, [completion(s) for s in req.seqs], req.finished,
                         req.error, req.prefix_hit_tokens)


def merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output standing for two consecutive ones of a request: ``newer`` with each sequence's
    deltas starting where ``older``'s did (what a stream sends when it fell behind the engine)."""
    before = {c.index: c for c in older.outputs}
    outs = []
    for c in newer.outputs:
        o = before.get(c.index)
        if o is not None:
            c = dataclasses.replace(c, delta_text=o.delta_text + c.delta_text,
                                    delta_token_ids=o.delta_token_ids + c.delta_token_ids,
                                    delta_logprobs=o.delta_logprobs + c.delta_logprobs)
        outs.append(c)
    return dataclasses.replace(newer, outputs=outs)


def finish(seq: Sequence, reason: str) -> None:
    if seq.finish_reason is None:
        seq.finish_reason = reason
    seq.status = Status.FINISHED
