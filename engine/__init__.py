"""What drives a model over time: generation, the serving engine, captured decode steps, prefix reuse, sessions."""
from .generation import GenerateResult, generate
from .config import EngineConfig
from .engine import Engine
from .errors import EngineStopped, PromptTooLong, QueueFull, RequestError
from .request import CompletionOutput, RequestOutput
from .sampling import SamplingParams

__all__ = ["GenerateResult", "generate", "Engine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "RequestError", "PromptTooLong", "QueueFull", "EngineStopped"]
