"""Checking YAML values against dataclass field types and ranges, and reading YAML strictly.

Used by :mod:`flashrt.profiles`: every error names the file, the key (dotted for nested
mappings), what was expected and what was found.
"""
from __future__ import annotations

import math
import re
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


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """safe_load that rejects a key given twice (PyYAML keeps the last one silently); libyaml's
    parser where PyYAML was built with it (several times faster on the profiles)."""


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


# ---- value ranges of the non-tile keys (one check per key group) -----------------------------

MAX_PAGE_ENTRIES = 1 << 16     # KV entries per page: larger pages cannot be allocated whole
MAX_PREFETCH_DEPTH = 1 << 10   # Engram blocks copied ahead
MAX_STEP_TOKENS = 1 << 20      # tokens in one serving-engine step
MAX_SPARSE_QUERIES = 64        # queries a sequence the decode path's attention takes (a verify's chunk)
MAX_GIB = float(1 << 20)       # 1 PiB: any memory or disk size above it is a typo
MAX_TTL_HOURS = 24 * 365 * 10  # ten years; the caches multiply TTLs into seconds


def _bad(file: str, key: str, expected: str, found) -> None:
    raise ProfileError(f"{file}: key {key}: expected {expected}, found {found!r}")


def _number(p, file: str, key: str, unit: str, high: float, zero_ok: bool) -> None:
    value = getattr(p, key)
    if value is None:
        return
    low_ok = value >= 0 if zero_ok else value > 0
    if not (math.isfinite(value) and low_ok and value <= high):
        _bad(file, key, f"a finite number of {unit} {'>=' if zero_ok else '>'} 0 and <= {high:.10g}", value)


def check_fractions(p, file: str) -> None:
    """Fractions of memory: each in (0, 1] (NaN fails every comparison), hot + warm <= 1."""
    for key in ("hkcp_hot_fraction", "hkcp_warm_fraction", "memory_utilization"):
        if not 0.0 < getattr(p, key) <= 1.0:
            _bad(file, key, "a fraction in (0, 1]", getattr(p, key))
    if p.hkcp_hot_fraction + p.hkcp_warm_fraction > 1.0:
        _bad(file, "hkcp_warm_fraction", "hot + warm fractions <= 1", p.hkcp_hot_fraction + p.hkcp_warm_fraction)


def check_sizes(p, file: str) -> None:
    """Page, prefetch, serving-step and mix-stream sizes, and memory and disk sizes in GiB: finite and within what exists."""
    n = p.hkcp_page_entries
    if n <= 0 or n & (n - 1) or n > MAX_PAGE_ENTRIES:
        _bad(file, "hkcp_page_entries", f"a power of two in [1, {MAX_PAGE_ENTRIES}]", n)
    if not 0 <= p.engram_prefetch_depth <= MAX_PREFETCH_DEPTH:
        _bad(file, "engram_prefetch_depth", f"an integer >= 0 and <= {MAX_PREFETCH_DEPTH}", p.engram_prefetch_depth)
    if not 1 <= p.serve_max_step_tokens <= MAX_STEP_TOKENS:
        _bad(file, "serve_max_step_tokens", f"an integer >= 1 and <= {MAX_STEP_TOKENS}", p.serve_max_step_tokens)
    for key in ("hc_mix_stream_max_tokens", "indexer_stream_max_tokens"):
        if not 0 <= getattr(p, key) <= MAX_STEP_TOKENS:
            _bad(file, key, f"an integer >= 0 and <= {MAX_STEP_TOKENS}", getattr(p, key))
    if not 1 <= p.sparse_max_queries <= MAX_SPARSE_QUERIES:
        _bad(file, "sparse_max_queries", f"an integer >= 1 and <= {MAX_SPARSE_QUERIES}", p.sparse_max_queries)
    _number(p, file, "hkcp_cold_host_gib", "GiB", MAX_GIB, zero_ok=True)
    _number(p, file, "hkcp_persistent_disk_gib", "GiB", MAX_GIB, zero_ok=False)
    if p.hkcp_persistent_disk_gib * 2**30 < 1:  # the prefix cache needs room for a byte
        _bad(file, "hkcp_persistent_disk_gib", "at least one byte (2**-30 GiB)", p.hkcp_persistent_disk_gib)
    _number(p, file, "device_memory_gib", "GiB", MAX_GIB, zero_ok=False)


def check_durations(p, file: str) -> None:
    """Cache lifetimes: finite and positive (the caches reject a zero TTL)."""
    _number(p, file, "hkcp_prefix_ttl_hours", "hours", MAX_TTL_HOURS, zero_ok=False)
    _number(p, file, "hkcp_window_pool_ttl_minutes", "minutes", MAX_TTL_HOURS * 60, zero_ok=False)


def check_match(p, file: str) -> None:
    """Device matching keys: valid regular expressions, capabilities like "9.0", a memory range."""
    for key in ("match_name", "match_soc"):
        try:
            re.compile(getattr(p, key) or "")
        except re.error as exc:
            _bad(file, key, f"a regular expression ({exc})", getattr(p, key))
    for cap in p.match_capability:
        if not re.fullmatch(r"\d+\.\d+", cap):
            _bad(file, "match_capability", 'capabilities like "9.0"', cap)
    _number(p, file, "match_min_memory_gib", "GiB", MAX_GIB, zero_ok=True)
    _number(p, file, "match_max_memory_gib", "GiB", MAX_GIB, zero_ok=True)
    low, high = p.match_min_memory_gib, p.match_max_memory_gib
    if low is not None and high is not None and high < low:
        _bad(file, "match_max_memory_gib", f">= match_min_memory_gib ({low!r})", high)


def check_speculative(p, file: str) -> None:
    """``speculative_costs``: per batch size >= 1, ``verify`` (k = 0, 1, ...: at least two finite
    times > 0, relative to a plain decode step) and ``draft`` (finite, >= 0)."""
    for batch, entry in p.speculative_costs.items():
        where = f"speculative_costs.{batch}"
        if batch < 1:
            _bad(file, "speculative_costs", "batch sizes >= 1", batch)
        if set(entry) != {"verify", "draft"}:
            _bad(file, where, "the keys verify and draft", sorted(entry))
        verify, draft = entry["verify"], entry["draft"]
        if not isinstance(verify, list) or len(verify) < 2 or not all(math.isfinite(v) and v > 0 for v in verify):
            _bad(file, f"{where}.verify", "a list of at least two finite times > 0 (k = 0, 1, ...)", verify)
        if isinstance(draft, list) or not (math.isfinite(draft) and draft >= 0):
            _bad(file, f"{where}.draft", "a finite time >= 0", draft)


VALUE_CHECKS = (check_fractions, check_sizes, check_durations, check_match, check_speculative)
