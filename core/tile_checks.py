"""What a kernel family's tile values may be, and the check a profile's ``tiles`` pass when it loads.

A family declares ``tile_checks``: ``"entry.param"`` (``"*.param"`` for every entry, ``"entry"``
for a scalar entry such as ``linear.split_k``) -> :class:`Tile`. A parameter without a declaration
gets the common ones below (``num_warps``, ``num_stages``), else its default's type: a positive int,
a bool, the default string only. A family may also declare ``smem``: entry -> ``bytes(params)``, a
lower bound on the shared memory one program of that tile needs; a profile that names its device
(``match_capability``) gets it checked against the device's per-block limit.

Every failure is a ProfileError naming the file and the key (``tiles.linear.linear[2].BLOCK_K``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Mapping

from .errors import ProfileError

log = logging.getLogger("flashrt")

# opt-in shared memory per block, by CUDA compute capability (the CUDA programming guide's table)
SMEM_PER_BLOCK = {"8.0": 166912, "8.6": 101376, "8.7": 166912, "8.9": 101376, "9.0": 232448, "10.0": 232448,
                  "12.0": 101376}


@dataclass(frozen=True)
class Tile:
    """One tile parameter: an int (or float) in ``[low, high]``, a power of two and / or a multiple
    of ``multiple`` when asked, one of ``choices`` when given; ``nullable``: None is allowed
    ("decide at launch"); ``kind``: its type when the default is None."""

    low: float | None = 1
    high: float | None = None
    pow2: bool = False
    multiple: int = 1
    choices: tuple = ()
    nullable: bool = False
    kind: type | None = None

    def problem(self, value, kind: type) -> str | None:
        """None when ``value`` is valid for a parameter of type ``kind``, else what was expected."""
        if value is None:
            return None if self.nullable else f"{self.describe(kind)} (not null)"
        if self.choices:
            ok = any(value == c and type(value) is type(c) for c in self.choices)
            return None if ok else self.describe(kind)
        if kind is bool or kind is str:
            return None if type(value) is kind else self.describe(kind)
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or (kind is int and not isinstance(value, int)) or not math.isfinite(value):
            return self.describe(kind)
        bad = ((self.low is not None and value < self.low) or (self.high is not None and value > self.high)
               or (self.pow2 and (value <= 0 or int(value) & (int(value) - 1))) or value % self.multiple)
        return self.describe(kind) if bad else None

    def describe(self, kind: type) -> str:
        """What a valid value is, in words."""
        if self.choices:
            return "one of " + ", ".join(map(repr, self.choices))
        if kind is bool:
            return "true or false"
        if kind is str:
            return "a string"
        want = [f"a power of two" if self.pow2 else "", f"a multiple of {self.multiple}" if self.multiple > 1 else ""]
        if self.low is not None or self.high is not None:
            want.append(f">= {self.low}" if self.high is None else f"in [{self.low}, {self.high}]")
        text = ("an int" if kind is int else "a finite number") + "".join(f", {w}" for w in want if w)
        return text + (" or null" if self.nullable else "")


POW2 = Tile(pow2=True)                         # a block size: tl.arange needs a power of two
DOT = Tile(low=16, pow2=True)                  # a tl.dot dimension: a power of two >= 16
GEMM_ROWS = Tile(pow2=True)                    # a block-scaled GEMM's row tile: >= 16 a tl.dot, below it multiply-adds
WARPS = Tile(high=32, pow2=True)               # warps per program
STAGES = Tile(high=8)                          # software-pipeline stages
COUNT0 = Tile(low=0)                           # a count where 0 means "decide" (e.g. the SM count)
COMMON = {"*.num_warps": WARPS, "*.num_warps_wide": WARPS, "*.num_stages": STAGES}


def check_profile(p, file: str) -> None:
    """Every ``tiles.<family>`` of profile ``p`` against its kernel family's declarations (reached
    through dispatch): the shape and types of :func:`merge`, then :func:`check`."""
    families, strict = families_for(p.backend)
    for name, given in p.tiles.items():
        fam = families.get(name)
        if fam is None:
            if strict:
                raise ProfileError(f"{file}: key tiles.{name}: expected a kernel family of backend {p.backend!r} "
                                   f"with tiles ({', '.join(sorted(families)) or 'none'}), found {name!r}")
            log.warning("flashrt: %s: key tiles.%s: no kernel family of that name is registered here (backend %r "
                        "is not); not checked, not used", file, name, p.backend)
            continue
        merge(fam.tiles, given, f"tiles.{name}", p)
        check(fam, given, f"tiles.{name}", file, p.match_capability)


def families_for(backend: str) -> tuple[dict, bool]:
    """(family name -> family, strict) to check a profile of ``backend`` against: that backend's
    families when it is registered with some (strict: an unknown name is an error), else any
    registered family that has tiles (the CPU profile's tiles serve the CUDA kernels under the
    interpreter; a backend that is not here leaves its tiles unchecked)."""
    from . import dispatch

    registered = dispatch.families()
    if registered.get(backend):
        return {f.name: f for f in registered[backend] if f.tiles}, True
    found: dict = {}
    for fams in registered.values():
        for fam in fams:
            if fam.tiles:
                found.setdefault(fam.name, fam)
    return found, False


def check(family, given: Mapping, where: str, file: str, capabilities=()) -> None:
    """``given`` (a profile's ``tiles.<family>``, already merged-checked for shape and type) against
    ``family``'s declarations; ``where`` is ``tiles.<family>``."""
    for entry, value in given.items():
        default = family.tiles[entry]
        if isinstance(default, Mapping):
            _params(family, entry, value, f"{where}.{entry}", file)
        elif isinstance(default, (list, tuple)):
            _rules(family, entry, value, f"{where}.{entry}", file)
        else:
            _one(family, entry, None, value, default, f"{where}.{entry}", file)
        _smem(family, entry, value, f"{where}.{entry}", file, capabilities)


def _declared(family, entry: str, param: str | None) -> Tile | None:
    checks = {**COMMON, **family.tile_checks}
    keys = [entry] if param is None else [f"{entry}.{param}", f"*.{param}"]
    return next((checks[k] for k in keys if k in checks), None)


def _one(family, entry, param, value, default, where: str, file: str) -> None:
    tile = _declared(family, entry, param)
    kind = (tile.kind if tile is not None else None) or (type(default) if default is not None else None)
    if tile is None:
        tile = Tile(choices=(default,)) if kind is str else Tile(nullable=default is None)
    if kind is None:
        raise ProfileError(f"{file}: key {where}: the kernel declares no type for it (family {family.name!r})")
    why = tile.problem(value, kind)
    if why is not None:
        found = f"{type(value).__name__} {value!r}" if value is not None else "null"
        raise ProfileError(f"{file}: key {where}: expected {why}, found {found}")


def _params(family, entry, params: Mapping, where: str, file: str) -> None:
    defaults = family.tiles[entry]
    first = defaults[0][1] if isinstance(defaults, (list, tuple)) else defaults
    for param, value in params.items():
        _one(family, entry, param, value, first.get(param), f"{where}.{param}", file)


def _rules(family, entry, rules, where: str, file: str) -> None:
    """``[[limit, params], ...]``: limits ascending ints >= 1, the last one null (it serves any size)."""
    last = 0
    for i, (limit, params) in enumerate(rules):
        at = f"{where}[{i}]"
        final = i == len(rules) - 1
        if final and limit is not None:
            raise ProfileError(f"{file}: key {at}: expected the last rule's limit null (it serves every size), "
                               f"found {limit!r}")
        if not final and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= last):
            raise ProfileError(f"{file}: key {at}: expected an int limit > {last} (ascending; null only last), "
                               f"found {limit!r}")
        last = limit if limit is not None else last
        _params(family, entry, params, at, file)


def _smem(family, entry, value, where: str, file: str, capabilities) -> None:
    need = family.smem.get(entry)
    if need is None or not any(c in SMEM_PER_BLOCK for c in capabilities):
        return
    defaults = family.tiles[entry]
    if isinstance(defaults, (list, tuple)):  # a rule's parameters fill in from the default rule at its place
        tiles = [(f"{where}[{i}]", {**defaults[min(i, len(defaults) - 1)][1], **params})
                 for i, (_, params) in enumerate(value)]
    else:
        tiles = [(where, {**defaults, **value})]
    cap = min((c for c in capabilities if c in SMEM_PER_BLOCK), key=SMEM_PER_BLOCK.get)
    for at, params in tiles:
        if need(params) > SMEM_PER_BLOCK[cap]:
            raise ProfileError(f"{file}: key {at}: expected a tile within the device's shared memory (sm_"
                               f"{cap.replace('.', '')}: {SMEM_PER_BLOCK[cap]} bytes per program), found one that "
                               f"needs at least {need(params)}")


def gemm_smem(params: Mapping) -> int:
    """A lower bound for a pipelined GEMM tile: (stages - 1) buffers of the A tile (1-byte fp8
    activations) and the B tile (4-bit weights at least)."""
    a, b = params["BLOCK_M"] * params["BLOCK_K"], params["BLOCK_N"] * params["BLOCK_K"] // 2
    return max(1, params["num_stages"] - 1) * (a + b)


def merge(default, given, where: str, profile):
    """A family's tile defaults with a profile's ``given`` section merged over them; ProfileError
    (naming ``profile.source`` and the key) for an entry the defaults lack or of another shape or type."""
    def bad(expected):
        found = f"{type(given).__name__} {given!r}" if given is not None else "null"
        raise ProfileError(f"{profile.source}: key {where}: expected {expected}, found {found}")

    if isinstance(default, Mapping):
        if not isinstance(given, Mapping):
            bad("a mapping, as the kernel's TILES")
        for key in set(given) - set(default):
            raise ProfileError(f"{profile.source}: key {where}.{key}: unknown tile parameter; expected one of "
                               f"{', '.join(map(str, default))} (the kernel's TILES)")
        return {k: merge(v, given[k], f"{where}.{k}", profile) if k in given else v for k, v in default.items()}
    if isinstance(default, (list, tuple)):  # [limit, parameters] rules
        if not isinstance(given, (list, tuple)) or not given:
            bad("a non-empty list of [limit, parameters] rules, as the kernel's TILES")
        known = {k for _, params in default for k in params}
        for i, (limit, params) in enumerate(given):
            if set(params) - known:
                bad(f"rule {i} with parameters among {', '.join(sorted(known))}")
        return tuple((limit, dict(params)) for limit, params in given)
    if given is not None and default is not None:  # null means "decide at launch": allowed either way
        if _scalar_kind(given) != _scalar_kind(default) or (type(default) is int and type(given) is float):
            bad(type(default).__name__)
    return given


def _scalar_kind(value) -> str:
    return "bool" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else type(value).__name__


def differences(defaults: Mapping, given: Mapping) -> dict:
    """``given`` (a ``tiles.<family>`` section) less what equals ``defaults``: parameters of a
    mapping entry one by one, rule lists and scalars whole."""
    out = {}
    for entry, value in given.items():
        default = defaults.get(entry)
        if isinstance(value, Mapping) and isinstance(default, Mapping):
            kept = {k: v for k, v in value.items() if k not in default or default[k] != v}
            if kept:
                out[entry] = kept
        elif _rules_of(value) != _rules_of(default):
            out[entry] = value
    return out


def _rules_of(value):
    """Rule lists compared as plain lists (YAML gives lists, defaults tuples)."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return [[limit, dict(params)] for limit, params in value]
    return value
