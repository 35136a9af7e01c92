"""A cap on the device memory flashrt may allocate (``--memory-limit``), to run as a smaller card.

The cap is enforced through torch's CUDA caching allocator
(``torch.cuda.set_per_process_memory_fraction``, the fraction computed from the device's total):
an allocation that would take the tensors torch holds past the cap fails with an out-of-memory
error, as it would on a card of that size. It covers what torch allocates (weights, KV, the
activations and CUDA-graph pools); the CUDA context, cuBLAS workspaces and the memory Triton or the
driver take on their own are outside it. While a cap is set, :func:`device_total` reports the cap
in place of the device's total, so everything sized from device memory (the KV budget of
``flashrt.engine.generation.profile_kv_sizes``) is sized from the capped memory.

The cap needs a CUDA device; on any other device :func:`apply` raises a ``ValueError`` naming the
option. The arithmetic (:func:`parse_size`, :func:`memory_fraction`) is device-free.
"""
from __future__ import annotations

import math
import re

import torch

OPTION = "--memory-limit"
# unit -> bytes; decimal (KB, MB, ...) and binary (KiB, MiB, ...) prefixes, case-insensitive
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_BY_LOWER = {name.lower(): n for name, n in UNITS.items()}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]+)\s*$", re.IGNORECASE)

_CAPS: dict[int, int] = {}  # CUDA device index -> capped bytes


def parse_size(text: str) -> int:
    """Bytes of a size with a unit (``24GiB``, ``1.5 TiB``, ``80GB``, ``512MiB``); a bare number is
    rejected, since bytes and GiB are both plausible readings of it."""
    match = _SIZE.match(text) if isinstance(text, str) else None
    unit = match and _BY_LOWER.get(match.group(2).lower())
    value = float(match.group(1)) * unit if unit else math.nan
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"expected a size above 0 with a unit ({', '.join(UNITS)}), e.g. 24GiB, "
                         f"got {text!r}")
    return int(value)


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def memory_fraction(limit: int, total: int, where: str = "the device") -> float:
    """The allocator fraction that caps ``total`` bytes at ``limit`` bytes; a limit above the total
    is a ``ValueError`` (the cap would not hold: the card simulated is larger than this one)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"{OPTION}: expected a positive number of bytes, got {limit!r}")
    if limit > total:
        raise ValueError(f"{OPTION}: {gib(limit)} is more than {where} has ({gib(total)}); "
                         f"expected at most {total:,} bytes")
    return limit / total


def _cuda_index(device) -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"{OPTION}: needs a CUDA device (the cap is enforced by the CUDA caching allocator), "
                         f"the device is {dev}")
    return torch.cuda.current_device() if dev.index is None else dev.index


def _physical_total(index: int) -> int:
    return torch.cuda.get_device_properties(index).total_memory


def _set_fraction(fraction: float, index: int) -> None:
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def apply(limit: int, device=None) -> dict:
    """Cap the memory torch may allocate on CUDA ``device`` (None: the current one) at ``limit``
    bytes, for the rest of the process; returns what was set."""
    index = _cuda_index(device)
    total = _physical_total(index)
    where = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    fraction = memory_fraction(limit, total, where)
    _set_fraction(fraction, index)
    _CAPS[index] = limit
    return {"device": where, "limit_bytes": limit, "device_total_bytes": total, "fraction": fraction}


def clear(device=None) -> None:
    """Lift the cap of ``device`` (the allocator may use the whole device again)."""
    index = _cuda_index(device)
    if _CAPS.pop(index, None) is not None:
        _set_fraction(1.0, index)


def limit(device) -> int | None:
    """The cap set on ``device`` in bytes, None when there is none (or it is not a CUDA device)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return _CAPS.get(torch.cuda.current_device() if dev.index is None else dev.index)


def device_total(device) -> int:
    """Memory of CUDA ``device`` that flashrt sizes from: the cap when one is set, else the total."""
    cap = limit(device)
    if cap is not None:
        return cap
    dev = torch.device(device)
    return _physical_total(torch.cuda.current_device() if dev.index is None else dev.index)
