"""Which backend of a chain serves a call: declared support checked once per call key.

A call key is what a :class:`flashrt.families.Support` may depend on: per argument its dtype (or
QTensor format; for a tuple of KV segments, per segment, and whether it is empty), the value of
non-numeric scalars (formats, score functions, dtypes, flags), and whether each declared
dimension is in range. Ranks are the contract's (validated before dispatch). The first call with a
key evaluates the chain's declarations in order and keeps the verdict; later calls with the key
pay for the key and one dict lookup. A call that a backend declines and a later one serves is a
fallback: logged once (op, backends, reason) and counted in :func:`fallbacks`.
"""
from __future__ import annotations

import functools
import inspect
import logging
import re
from typing import Callable

import torch

from .errors import BackendError
from .families import Support
from .formats import QTensor
from .kv.paged import PagedKeys

log = logging.getLogger("flashrt")

_FALLBACKS: dict[tuple, int] = {}  # (op, device type, declined by, reason, served by) -> call keys


def fallbacks() -> list[dict]:
    """The fallbacks seen in this process: op, device type, the backend that declined and why, the
    backend that served, and how many distinct call keys took that way."""
    return [{"op": op, "device_type": dev, "declined_by": who, "reason": why, "served_by": served, "keys": n}
            for (op, dev, who, why, served), n in _FALLBACKS.items()]


def reset_fallbacks() -> None:
    _FALLBACKS.clear()


def _segment(e):
    """A KV segment of a tuple: its dtype or format, and whether it is empty (attention reads
    only the non-empty ones)."""
    return (sig(e), 0 in e.shape) if hasattr(e, "shape") else sig(e)


_SIG = {torch.Tensor: lambda a: a.dtype, QTensor: lambda a: a.fmt, float: lambda a: float, int: lambda a: int,
        type(None): lambda a: None, str: lambda a: a, bool: lambda a: a, torch.dtype: lambda a: a,
        tuple: lambda a: tuple(map(_segment, a)), PagedKeys: lambda a: ("paged", sig(a.pool))}


def sig(a):
    """The part of one argument a verdict may depend on: a tensor's dtype, a QTensor's format, per
    segment of a tuple that and its emptiness, the value of strings, flags and dtypes; the type of
    anything else (numbers: their values do not enter, except as declared ``dims``)."""
    f = _SIG.get(type(a))
    if f is not None:
        return f(a)
    for kind, f in _SIG.items():  # subclasses (nn.Parameter, ...)
        if isinstance(a, kind):
            return f(a)
    return type(a)


@functools.cache
def arg_names(op: str) -> tuple[str, ...]:
    """Parameter names of ``flashrt.ops.<op>`` (how declarations name arguments)."""
    from . import ops

    return tuple(inspect.signature(getattr(ops, op)).parameters)


_DIM = re.compile(r"^(\w+)(?:\[(-?\d+)\])?$")


@functools.cache
def _dim_spec(op: str, spec: str) -> tuple[int, int | None]:
    m = _DIM.match(spec)
    if m is None or m.group(1) not in arg_names(op):
        raise ValueError(f"support of {op!r}: dims key {spec!r}: expected 'arg' or 'arg[axis]' with arg among "
                         f"{arg_names(op)}")
    return arg_names(op).index(m.group(1)), None if m.group(2) is None else int(m.group(2))


def check_declaration(op: str, support: Support | None, backend: str) -> None:
    """A backend's declaration names only arguments ``op`` has (BackendError otherwise: the plugin
    is reported and skipped when it loads, not at its first call)."""
    if support is None:
        return
    names = arg_names(op)
    unknown = [n for n in support.inputs if n not in names]
    if unknown:
        raise BackendError(f"backend {backend!r}: support of {op!r} names unknown arguments {unknown}; "
                           f"the op's arguments: {list(names)}")
    for spec in support.dims:
        try:
            _dim_spec(op, spec)
        except ValueError as exc:
            raise BackendError(f"backend {backend!r}: {exc}") from None


def _elements(a) -> tuple:
    if isinstance(a, (tuple, list)):
        return tuple(x for e in a for x in _elements(e))
    return (a.pool,) if isinstance(a, PagedKeys) else (a,)


def _dim_values(args, pos: int, axis: int | None) -> list[int]:
    a = args[pos] if pos < len(args) else None
    if axis is None:
        return [a] if isinstance(a, int) and not isinstance(a, bool) else []
    parts = a if isinstance(a, (tuple, list)) else (a,)
    return [int(p.shape[axis]) for p in parts if hasattr(p, "shape") and len(p.shape) > abs(axis) - (axis < 0)]


def _dim_check(dim, pos: int, axis: int | None) -> Callable:
    """``check(args) -> bool``: the declared dimension is in range (a fast path for a plain argument)."""
    if axis is None:
        return lambda args: all(dim.holds(v) for v in _dim_values(args, pos, None))

    def check(args):
        a = args[pos]
        if type(a) is torch.Tensor and a.dim() > abs(axis) - (axis < 0):
            return dim.holds(a.shape[axis])
        return all(dim.holds(v) for v in _dim_values(args, pos, axis))

    return check


def _describe(e) -> str:
    if isinstance(e, QTensor):
        return f"a QTensor in {e.fmt!r}"
    if isinstance(e, torch.Tensor):
        return f"dtype {e.dtype}"
    return repr(e)


def why_not(op: str, support: Support | None, args) -> str | None:
    """None when ``support`` covers the call ``op(*args)``, else the first reason it does not."""
    if support is None:
        return None
    names = arg_names(op)
    if support.excluded_dtypes:
        for name, a in zip(names, args):
            bad = [e.dtype for e in _elements(a) if isinstance(e, torch.Tensor) and e.dtype in support.excluded_dtypes]
            if bad:
                return f"{name}: dtype {bad[0]} is not served"
    for name, accepted in support.inputs.items():
        a = args[names.index(name)] if names.index(name) < len(args) else None
        for e in _elements(a):
            key = e.fmt if isinstance(e, QTensor) else e.dtype if isinstance(e, torch.Tensor) else e
            if e is not None and key not in accepted:
                return f"{name}: {_describe(e)} is not served (served: {', '.join(map(str, accepted))})"
    for spec, dim in support.dims.items():
        for v in _dim_values(args, *_dim_spec(op, spec)):
            if not dim.holds(v):
                return f"{spec} = {v}: served {dim}"
    if support.extra is not None and not support.extra(*args):
        return f"{getattr(support.extra, '__name__', 'extra')} declines the call"
    return None


def _fell_back(op: str, device_type: str, declined: list, served: str) -> None:
    for who, why in declined:
        key = (op, device_type, who, why, served)
        if key not in _FALLBACKS:
            log.info("flashrt: %s on %s: %s declines (%s); %s serves it", op, device_type, who, why, served)
        _FALLBACKS[key] = _FALLBACKS.get(key, 0) + 1


def runner(op: str, device_type: str, steps: list[tuple[str, Support | None, Callable]], describe) -> Callable:
    """``run(*args)`` calling the first of ``steps`` ((backend, support, fn), in order) that serves
    the call, its verdict kept per call key; ``describe(args)`` words a call nobody serves."""
    dims = [_dim_check(dim, *_dim_spec(op, spec)) for _, s, _ in steps if s is not None for spec, dim in s.dims.items()]
    verdicts: dict = {}

    def choose(args) -> Callable:
        declined = []
        for name, support, fn in steps:
            why = why_not(op, support, args)
            if why is None:
                _fell_back(op, device_type, declined, name)
                return fn
            declined.append((name, why))
        reasons = "; ".join(f"{n}: {w}" for n, w in declined)
        message = (f"op {op!r}: no backend serves this call ({describe(args)}); tried {[n for n, _ in declined]} "
                   f"({reasons})")

        def refuse(*_):
            raise BackendError(message)

        return refuse

    def run(*args):
        key = tuple([a.dtype if a.__class__ is torch.Tensor else sig(a) for a in args])  # sig, plain tensors inlined
        if dims:
            key = (key, tuple([check(args) for check in dims]))
        fn = verdicts.get(key)
        if fn is None:
            fn = verdicts[key] = choose(args)
        return fn(*args)

    run.verdicts = verdicts
    return run
