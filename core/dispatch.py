"""Plugin manager and op table.

Backends are collected through pluggy (built-ins first, then the ``flashrt.backends`` entry
points). For each (explicit choice, op, device type) the implementation is resolved once and
cached in ``_TABLE``; the hot path in :mod:`flashrt.ops` is one dict lookup and a call.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from typing import Callable

import pluggy
import torch

from . import hookspecs, support
from .errors import BackendError
from .families import Support
from .hookspecs import Backend

log = logging.getLogger("flashrt")

ENTRY_POINT_GROUP = "flashrt.backends"
BUILTIN_PLUGINS = ("flashrt.backends.reference", "flashrt.backends.trace", "flashrt.backends.cuda", "flashrt.backends.ascend")

_CHOICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("flashrt_backend", default=None)
_TABLE: dict[tuple, Callable] = {}


@dataclass(frozen=True)
class BackendStatus:
    """One line of ``flashrt.backends.available()``."""

    name: str
    device_types: tuple[str, ...]
    available: bool
    reason: str
    ops: tuple[str, ...]
    priority: int


class _State:
    def __init__(self):
        self.pm: pluggy.PluginManager | None = None
        self.backends: dict[str, Backend] = {}
        self.availability: dict[str, tuple[bool, str]] = {}
        self.load_errors: dict[str, str] = {}
        self.env_choice: str | None = None
        self.logged_fallback: set[str] = set()


_STATE = _State()


def _manager() -> pluggy.PluginManager:
    if _STATE.pm is None:
        _load()
    return _STATE.pm


def _load() -> None:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for modname in BUILTIN_PLUGINS:
        try:
            pm.register(importlib.import_module(modname), name=modname)
        except Exception as exc:  # e.g. a backend's optional dependency is broken: report, go on
            _STATE.load_errors[modname] = f"{type(exc).__name__}: {exc}"
            log.warning("flashrt: built-in backend %s failed to load: %s", modname, exc)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as exc:  # a broken third-party plugin must not take the runtime down
            _STATE.load_errors[ep.name] = f"{ep.value}: {type(exc).__name__}: {exc}"
            log.warning("flashrt: plugin %r (%s) failed to load: %s", ep.name, ep.value, exc)
    _STATE.pm = pm
    _collect()


def _collect() -> None:
    from .ops import OPS

    _STATE.backends = {}
    for hook in reversed(_STATE.pm.hook.flashrt_backend.get_hookimpls()):  # registration order
        try:
            backend = hook.function()
            if backend is None:
                continue
            if not isinstance(backend, Backend):
                raise BackendError(f"flashrt_backend() returned {type(backend).__name__}, expected a Backend")
            unknown = sorted(set(backend.ops) - set(OPS))
            if unknown:
                raise BackendError(f"backend {backend.name!r} declares unknown ops {unknown}; known: {list(OPS)}")
            if backend.name in _STATE.backends:
                raise BackendError(f"a backend named {backend.name!r} is already registered")
            stray = sorted(set(backend.supports) - set(backend.ops))
            if stray:
                raise BackendError(f"backend {backend.name!r} declares support for ops it does not serve: {stray}")
            for op, declared in backend.supports.items():
                support.check_declaration(op, _as_support(declared), backend.name)
        except Exception as exc:
            _STATE.load_errors[hook.plugin_name] = f"{type(exc).__name__}: {exc}"
            log.warning("flashrt: plugin %r skipped: %s", hook.plugin_name, exc)
            continue
        _STATE.backends[backend.name] = backend
    reset_table()


def reload() -> None:
    """Discover the plugins again (built-ins and entry points), e.g. after installing one."""
    _STATE.pm = None
    _STATE.load_errors.clear()
    _load()


def load_errors() -> dict[str, str]:
    """Plugins that failed to load, with the error."""
    _manager()
    return dict(_STATE.load_errors)


def reset_table() -> None:
    """Forget every resolution (after a plugin or environment change)."""
    _TABLE.clear()
    _STATE.availability.clear()
    _STATE.logged_fallback.clear()
    support.reset_fallbacks()
    _STATE.env_choice = os.environ.get("FLASHRT_BACKEND") or None


def register(plugin, name: str | None = None) -> None:
    """Register a plugin object or module at run time (as an entry point would)."""
    _manager().register(plugin, name=name)
    _collect()


def unregister(plugin) -> None:
    _manager().unregister(plugin)
    _collect()


def backends() -> dict[str, Backend]:
    """Registered backends by name."""
    _manager()
    return dict(_STATE.backends)


def availability(name: str) -> tuple[bool, str]:
    """(available, reason) of a registered backend, evaluated once."""
    if name not in _STATE.availability:
        backend = backends()[name]
        try:
            ok, reason = backend.is_available()
        except Exception as exc:
            ok, reason = False, f"is_available() raised {type(exc).__name__}: {exc}"
        _STATE.availability[name] = (bool(ok), str(reason))
    return _STATE.availability[name]


def available() -> list[BackendStatus]:
    """Every registered backend with its availability and, when unavailable, why."""
    out = []
    for name, b in sorted(backends().items(), key=lambda kv: -kv[1].priority):
        ok, reason = availability(name)
        out.append(BackendStatus(name, tuple(b.device_types) + tuple(f"{d} (explicit)" for d in b.explicit_device_types),
                                 ok, reason, tuple(sorted(b.ops)), b.priority))
    return out


def _registered() -> str:
    return ", ".join(sorted(backends())) or "none"


def _check_choice(name: str) -> Backend:
    registered = backends()
    if name not in registered:
        raise BackendError(f"backend {name!r} is not registered; registered backends: {_registered()}")
    ok, reason = availability(name)
    if not ok:
        raise BackendError(f"backend {name!r} is not available: {reason}; registered backends: {_registered()}")
    return registered[name]


@contextlib.contextmanager
def use_backend(name: str):
    """Run the ops inside the block on backend ``name``, or fail with ``BackendError``."""
    _check_choice(name)
    token = _CHOICE.set(name)
    try:
        yield backends()[name]
    finally:
        _CHOICE.reset(token)


def current_choice() -> str | None:
    """The explicit backend in force: ``use_backend`` first, then ``FLASHRT_BACKEND``."""
    return _CHOICE.get() or _STATE.env_choice


def impl(op: str, device) -> Callable:
    """The implementation of ``op`` for a torch ``device`` (resolved once per device type)."""
    key = (_CHOICE.get() or _STATE.env_choice, op, device)
    try:
        return _TABLE[key]
    except KeyError:
        _manager()
        choice = current_choice()
        device_type = device if isinstance(device, str) else device.type
        fn = _resolved(choice, op, device_type)
        _TABLE[(choice, op, device)] = fn
        return fn


def _resolved(choice: str | None, op: str, device_type: str) -> Callable:
    key = (choice, op, device_type)
    if key not in _TABLE:
        _TABLE[key] = _resolve(*key)
    return _TABLE[key]


def chain(op: str, device_type: str) -> list[str]:
    """Names of the backends that would serve ``op`` on ``device_type``, in the order tried."""
    choice = current_choice()
    if choice:
        return [choice]
    return [b.name for b in _candidates(op, device_type) if availability(b.name)[0]]


def zero_copy(op: str, device) -> bool:
    """Whether the backend that serves ``op`` on ``device`` (the first of :func:`chain`) reads
    host-memory inputs in place there, with no host synchronisation (``Backend.zero_copy``)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    names = chain(op, device.type)
    check = backends()[names[0]].zero_copy.get(op) if names and names[0] in backends() else None
    return bool(check(device)) if check is not None else False


def _candidates(op: str, device_type: str) -> list[Backend]:
    found = [b for b in backends().values() if device_type in b.device_types and op in b.ops]
    return sorted(found, key=lambda b: -b.priority)


def _resolve(choice: str | None, op: str, device_type: str) -> Callable:
    if choice:
        b = _check_choice(choice)
        if device_type not in (*b.device_types, *b.explicit_device_types) or op not in b.ops:
            raise BackendError(
                f"backend {choice!r} (chosen explicitly) does not serve op {op!r} on device type "
                f"{device_type!r}: it serves {sorted(b.ops)} on {list(b.device_types + b.explicit_device_types)}"
            )
        return _runner(op, [b], device_type)
    usable, skipped = [], []
    for b in _candidates(op, device_type):
        ok, reason = availability(b.name)
        (usable if ok else skipped).append(b if ok else f"{b.name}: {reason}")
    if not usable:
        raise BackendError(
            f"no backend serves op {op!r} on device type {device_type!r}; "
            f"registered backends: {_registered()}" + (f" (unavailable: {'; '.join(skipped)})" if skipped else "")
        )
    if usable[0].name == "reference" and device_type not in _STATE.logged_fallback:
        _STATE.logged_fallback.add(device_type)
        why = "; ".join(skipped) or "no other backend serves this device type"
        log.info("flashrt: using the reference backend on %s (first op: %s; %s)", device_type, op, why)
    return _runner(op, usable, device_type)


def _runner(op: str, chain_: list[Backend], device_type: str) -> Callable:
    """The first backend's function when it declares no support for ``op`` (it serves every call),
    else a runner choosing along the chain once per call key (:mod:`flashrt.support`)."""
    first = chain_[0]
    if op not in first.supports:
        return first.ops[op]
    steps = [(b.name, _as_support(b.supports.get(op)), b.ops[op]) for b in chain_]
    return support.runner(op, device_type, steps, _describe)


def _as_support(declared) -> Support | None:
    """A declared :class:`Support`, or a plain predicate (``Support(extra=predicate)``)."""
    return declared if declared is None or isinstance(declared, Support) else Support(extra=declared)


def _describe(args) -> str:
    parts = []
    for a in args:
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            parts.append(f"{a.dtype} {tuple(a.shape)} on {a.device}")
        elif hasattr(a, "fmt"):
            parts.append(f"{a.fmt} {tuple(a.shape)} on {a.device}")
        else:
            parts.append(repr(a))
    return ", ".join(parts)


def families() -> dict[str, tuple]:
    """Backend name -> the kernel families it declares (``Backend.families``), for backends with any."""
    return {name: tuple(b.families) for name, b in backends().items() if b.families}


def family(name: str, backend: str | None = None):
    """The kernel family ``name`` (of ``backend``, or of whichever backend declares it), or None."""
    for owner, fams in families().items():
        for fam in fams:
            if fam.name == name and backend in (None, owner):
                return fam
    return None


fallbacks = support.fallbacks
