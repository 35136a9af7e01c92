"""What drives a model over time: generation, captured decode steps, prefix reuse, sessions."""
from .generation import GenerateResult, generate

__all__ = ["GenerateResult", "generate"]
