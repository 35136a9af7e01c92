"""The ``flashrt`` command line: one module per command group (``main`` parses and dispatches)."""
from .commands import main

__all__ = ["main"]
