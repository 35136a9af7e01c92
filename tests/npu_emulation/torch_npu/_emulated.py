"""Call recording and constraint checks shared by the emulated torch_npu operators.

Every emulated operator is wrapped by :func:`operator`, which records the call exactly as the
caller made it (operator name, the positional values, the keyword values, the result) before and
after running it. ``tests/ascend/test_ascend_schema.py`` replays these records against the operator
schemas and meta functions of the real torch_npu wheel; the backend tests read the arguments by
name through :func:`calls`.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch


@dataclass
class Call:
    name: str
    args: dict  # every parameter by name (defaults filled in), as the emulated operator saw it
    positional: tuple  # the values passed positionally, in order
    keywords: dict  # the values passed by keyword
    result: object = field(default=None)

    def signature(self) -> str:
        """The call as made, by kind: ``npu_x(Tensor, list[Tensor], k=int, mode=str)``."""
        parts = [_kind(v) for v in self.positional] + [f"{k}={_kind(v)}" for k, v in self.keywords.items()]
        return f"{self.name}({', '.join(parts)})"


def _kind(v) -> str:
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__}[{', '.join(sorted({_kind(e) for e in v}))}]"
    if isinstance(v, torch.Tensor):
        return f"Tensor[{str(v.dtype).replace('torch.', '')}]"
    return "dtype" if isinstance(v, torch.dtype) else type(v).__name__


CALLS: list[Call] = []
OPERATORS: dict = {}  # operator name -> the emulated function (unwrapped)


def calls(name: str) -> list[dict]:
    """Arguments of every recorded call of operator ``name``, oldest first."""
    return [c.args for c in CALLS if c.name == name]


def operator(fn):
    """Register ``fn`` as the emulated torch_npu operator of its name and record each call."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)  # a TypeError here is what the real binding raises too
        bound.apply_defaults()
        call = Call(fn.__name__, dict(bound.arguments), tuple(args), dict(kwargs))
        CALLS.append(call)
        call.result = fn(*args, **kwargs)
        return call.result

    OPERATORS[fn.__name__] = fn
    return wrapper


def check(cond: bool, msg: str) -> None:
    """A documented constraint: a violation raises ``RuntimeError`` as the real operator's check."""
    if not cond:
        raise RuntimeError(f"[emulated torch_npu] {msg}")


# ScalarType codes: torch_npu's ``int? *_dtype`` arguments receive a torch.dtype converted to its
# code by torch's argument parser (or the code itself); the emulation accepts both.
_CODES = {0: torch.uint8, 1: torch.int8, 3: torch.int32, 4: torch.int64, 5: torch.float16, 6: torch.float32,
          15: torch.bfloat16}


def scalar_type(value):
    """A ``ScalarType``-as-int argument as a torch.dtype (``None`` stays ``None``)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    check(isinstance(value, int) and value in _CODES, f"unsupported dtype code {value!r}")
    return _CODES[value]
