"""Checking YAML values against dataclass field types, and reading YAML strictly.

Used by :mod:`flashrt.profiles`: every error names the file, the key (dotted for nested
mappings), what was expected and what was found.
"""
from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Literal, Mapping, Union

import yaml

from .errors import ProfileError


def type_name(tp) -> str:
    """A readable name: ``int``, ``float | None``, ``dict[str, int]``, ``one of 'a', 'b'``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (dict, list, tuple):
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _kind(value) -> type | None:
    return dict if isinstance(value, Mapping) else list if isinstance(value, (list, tuple)) else None


def convert(value, tp, where: str, file: str):
    """``value`` checked against the type ``tp`` (and normalised: int -> float, list -> tuple).

    Nested values name their place: ``tiles.attention.split.min_blocks``, ``match_capability[0]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = None  # the error of the arm shaped like the value (a mapping, a list): the precise one
        for arg in args:
            try:
                return convert(value, arg, where, file)
            except ProfileError as exc:
                if inner is None and _kind(value) and _kind(value) in (typing.get_origin(arg), arg):
                    inner = exc
        if inner is not None:
            raise inner
    elif origin is Literal:
        if isinstance(value, str) and value in args:
            return value
    elif origin in (tuple, list) and isinstance(value, (list, tuple)):
        if origin is list or args[-1] is Ellipsis:
            return origin(convert(v, args[0], f"{where}[{i}]", file) for i, v in enumerate(value))
        if len(value) == len(args):
            return tuple(convert(v, a, f"{where}[{i}]", file) for i, (v, a) in enumerate(zip(value, args)))
    elif origin is dict and isinstance(value, Mapping):
        return {convert(k, args[0], f"{where} key", file): convert(v, args[1], f"{where}.{k}", file)
                for k, v in value.items()}
    elif tp is type(None) and value is None:
        return None
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif tp in (int, str, bool) and type(value) is tp:
        return value
    found = f"{type(value).__name__} {value!r}" if value is not None else "null"
    raise ProfileError(f"{file}: key {where}: expected {type_name(tp)}, found {found}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that rejects a key given twice (PyYAML keeps the last one silently)."""


def _unique_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_yaml(path: str):
    """The parsed YAML of ``path``; ProfileError naming the file (and line) if unreadable."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ProfileError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
