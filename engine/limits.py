"""What a request may ask of an engine, checked before it is queued: token ids in the vocabulary,
stop ids, the context length and the KV pages it would need. :class:`RequestLimits` holds only
plain settings (picklable), so a server process can check requests for an engine running in
another process (engine/client.py) exactly as the engine does."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import PromptTooLong, RequestError
from .sampling import SamplingParams
from .scheduler import pages_at
from .slots import MIN_ROWS


@dataclass(frozen=True)
class RequestLimits:
    cfg: object  # the model's ModelConfig
    max_model_len: int
    page_entries: int  # main-KV entries per page
    max_pages: int | None  # main-KV pages the engine may hold (None: no limit)

    def check(self, prompt: list[int], params: SamplingParams) -> int:
        """Validate a request; returns the tokens it may generate."""
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params", f"expected SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("prompt", f"expected a non-empty list of token ids, got {prompt!r:.80}")
        V = self.cfg.vocab_size
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V), None)
        if bad is not None:
            raise RequestError("prompt", f"expected token ids in [0, {V}), got {bad!r}")
        try:
            params.check_vocab(V)
        except ValueError as exc:
            raise RequestError("stop_token_ids", str(exc)) from None
        limit, n = self.max_model_len, len(prompt)
        new = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max(new, 1) > limit:
            raise PromptTooLong("prompt", f"{n} prompt tokens + max_tokens {new} = {n + new} exceed the "
                                f"model's context of {limit} tokens")
        P = self.page_entries
        seq, pad = pages_at(self.cfg, P, n + new), (MIN_ROWS - 1) * pages_at(self.cfg, P, 1)
        if self.max_pages is not None and seq + pad > self.max_pages:  # alone, with the decode batch's padding
            raise PromptTooLong("prompt", f"{n} prompt tokens + max_tokens {new} need {seq} KV pages (+ {pad} for "
                                f"the padding rows of a decode batch), the engine holds at most {self.max_pages}")
        return new
