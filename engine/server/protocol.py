"""The OpenAI request bodies the server takes (pydantic, strict types, unknown fields refused) and
their translation to :class:`~flashrt.engine.SamplingParams`. Beyond OpenAI's fields, the vLLM
extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``ignore_eos``, ``include_stop_str_in_output`` and (chat) ``chat_template_kwargs`` are accepted;
the chat fields that shape the prompt are read by :mod:`.chat`."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from ..sampling import SamplingParams

Number = Union[StrictInt, StrictFloat]
TokenIds = list[StrictInt]


class BadRequest(ValueError):
    """A request the server refuses: ``param`` names the field (OpenAI's error ``param``)."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    user: StrictStr | None = None
    # vLLM extensions
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise BadRequest("logit_bias", "logit_bias: not supported by this server")
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "seed", "presence_penalty",
                                               "frequency_penalty", "top_k", "min_p", "repetition_penalty",
                                               "min_tokens", "stop_token_ids", "ignore_eos",
                                               "include_stop_str_in_output") if getattr(self, k) is not None}
        try:
            return SamplingParams(n=self.n, max_tokens=max_tokens, stop=self.stop, logprobs=logprobs, **given)
        except ValueError as exc:
            raise BadRequest(str(exc).split(":", 1)[0], str(exc)) from None

    @property
    def include_usage(self) -> bool:
        """Streams end with a usage chunk unless ``stream_options.include_usage`` is false."""
        return self.stream_options is None or self.stream_options.include_usage is not False


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise BadRequest("prompt", "prompt: expected a non-empty prompt, got []")
        return list(p)

    def params(self) -> SamplingParams:
        if self.suffix:
            raise BadRequest("suffix", "suffix: not supported by this server")
        if self.echo:
            raise BadRequest("echo", "echo: not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of", f"best_of: only best_of == n is supported, got {self.best_of} with n {self.n}")
        return self.sampling(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    reasoning_effort: StrictStr | StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None

    def params(self) -> SamplingParams:
        if self.response_format is not None and self.response_format.type != "text":
            raise BadRequest("response_format", f"response_format: only 'text' is supported, got "
                             f"{self.response_format.type!r}")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs", "top_logprobs: needs logprobs: true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        try:
            return self.sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        except BadRequest as exc:
            if exc.param == "max_tokens":
                raise BadRequest(name, str(exc).replace("max_tokens", name, 1)) from None
            if exc.param == "logprobs":
                raise BadRequest("top_logprobs", str(exc).replace("logprobs", "top_logprobs", 1)) from None
            raise


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """``body`` (decoded JSON) as ``model``, or BadRequest naming the first offending field."""
    if not isinstance(body, dict):
        raise BadRequest(None, f"expected a JSON object as the request body, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
        param = ".".join(loc) or None
        if err["type"] == "extra_forbidden":
            raise BadRequest(param, f"{param}: unknown field") from None
        if err["type"] == "missing":
            raise BadRequest(param, f"{param}: required") from None
        raise BadRequest(param, f"{param}: {err['msg'].lower()}, got {err.get('input')!r:.80}") from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "list[int]", "list[str]", "function-after"}
