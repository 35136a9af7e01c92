"""Backend plugins: ``reference`` (torch, any device), ``trace`` (shape-only, meta tensors).

``available()`` lists every registered backend with its availability and, when unavailable, why.
"""
from flashrt.dispatch import BackendStatus, available, backends, register, unregister

__all__ = ["BackendStatus", "available", "backends", "register", "unregister"]
