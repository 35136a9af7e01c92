"""Kernel families: what one kernel module of a backend declares, as data.

A backend's kernel package lists its families explicitly (``FAMILIES = (...)`` in its
``__init__``); the backend builds its op table from them (:func:`family_tables`) and hands them
to dispatch (``Backend.families``), which is how core reaches their tiles and warm-up without
importing a kernel. A family declares:

- ``ops``: op name -> launcher with the op's signature (``flashrt.ops``);
- ``supports``: op name -> :class:`Support`, what the launcher serves as data (dtypes, formats,
  dimension ranges) plus an optional ``extra`` predicate. Dispatch checks it once per call key
  (the dtypes / formats / ranks / emptiness of the arguments, non-numeric scalars, and whether
  each declared dimension is in range), not on every call: ``extra`` may therefore read only
  what the key holds. An op without an entry serves every valid call;
- ``tiles``: the tile defaults (profile ``tiles.<name>`` overrides them; ``tile_checks`` and
  ``smem`` say which values are valid, see :mod:`flashrt.tile_checks`);
- ``warmup``: ``hook(profile) -> dict | str | None`` compiling its kernels ahead of time
  (:mod:`flashrt.jit_warmup`); ``warmup_cases`` the launches it makes;
- ``zero_copy``: op name -> ``(device) -> bool``, ops whose launcher reads pinned host memory in
  place (``flashrt.dispatch.zero_copy``);
- ``paths``: op name -> ``(*args) -> str``, the launch a call takes under the active tiles where one
  tile rule holds the knobs of several launches (``flashrt tune`` sweeps the knobs of the one its
  case takes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping


@dataclass(frozen=True)
class Dim:
    """A range of one dimension (or int argument): ``low <= n <= high`` and ``n % multiple == 0``."""

    low: int = 0
    high: int | None = None
    multiple: int = 1

    def holds(self, n: int) -> bool:
        return self.low <= n and (self.high is None or n <= self.high) and n % self.multiple == 0

    def __str__(self) -> str:
        bound = f">= {self.low}" if self.high is None else f"in [{self.low}, {self.high}]"
        return bound + (f", a multiple of {self.multiple}" if self.multiple > 1 else "")


@dataclass(frozen=True)
class Support:
    """What a launcher serves of one op.

    inputs: argument name -> accepted values: ``torch.dtype`` entries accept a plain tensor of
        that dtype, ``str`` entries a QTensor in that format (or a str argument equal to it). A
        tuple of KV segments checks every segment, ``PagedKeys`` its pool; None always passes.
    dims: ``"q[-1]"`` (a dimension of an argument; of every segment of a tuple) or ``"topk"`` (an
        int argument) -> :class:`Dim`.
    excluded_dtypes: dtypes no plain tensor argument may have (e.g. float64 on a device without it).
    extra: ``(*args) -> bool`` for what the data cannot say; its verdict is cached per call key.
    """

    inputs: Mapping[str, tuple] = field(default_factory=dict)
    dims: Mapping[str, Dim] = field(default_factory=dict)
    excluded_dtypes: tuple = ()
    extra: Callable[..., bool] | None = None


@dataclass(frozen=True)
class KernelFamily:
    """One kernel module's declaration (see the module docstring)."""

    name: str
    ops: Mapping[str, Callable] = field(default_factory=dict)
    supports: Mapping[str, Support] = field(default_factory=dict)
    tiles: Mapping = field(default_factory=dict)
    tile_checks: Mapping = field(default_factory=dict)
    smem: Mapping[str, Callable[[dict], int]] = field(default_factory=dict)
    warmup: Callable | None = None
    warmup_cases: Callable | None = None
    zero_copy: Mapping[str, Callable] = field(default_factory=dict)
    # op -> (its args) -> the name of the launch the call takes under the active tiles, for ops whose tile
    # rules hold knobs of several launches (``flashrt tune`` sweeps the knobs of the one its case takes)
    paths: Mapping[str, Callable[..., str]] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self):
        unknown = sorted(set(self.supports) - set(self.ops))
        if unknown:
            raise ValueError(f"family {self.name!r}: supports names ops it does not implement: {unknown}")

    def serves(self, op: str, *args) -> str | None:
        """None when this family's launcher serves ``op(*args)``, else why not (as dispatch says it)."""
        from .support import why_not

        if op not in self.ops:
            return f"family {self.name!r} does not implement {op!r}"
        return why_not(op, self.supports.get(op), args)


def family_tables(families) -> dict:
    """``ops``, ``supports`` and ``zero_copy`` of a Backend made of ``families`` (each op from one)."""
    ops, supports, zero_copy, owner = {}, {}, {}, {}
    for fam in families:
        for op in fam.ops:
            if op in owner:
                raise ValueError(f"op {op!r} is implemented by two families: {owner[op]!r} and {fam.name!r}")
            owner[op] = fam.name
        ops.update(fam.ops)
        supports.update(fam.supports)
        zero_copy.update(fam.zero_copy)
    return {"ops": ops, "supports": supports, "zero_copy": zero_copy}
