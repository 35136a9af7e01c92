"""Errors a serving engine raises for one request (the server maps them to HTTP statuses)."""
from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot take: ``param`` names the offending parameter."""

    def __init__(self, param: str, message: str):
        super().__init__(message if message.startswith(f"{param}:") else f"{param}: {message}")
        self.param = param


class PromptTooLong(RequestError):
    """The prompt plus the tokens asked for exceed the context or the KV pages the engine holds."""


class QueueFull(RuntimeError):
    """As many requests are waiting as the engine admits (``max_waiting``)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new requests."""
