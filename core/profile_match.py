"""Device facts and profile matching: which hardware profile fits the device this process runs on.

Detection turns torch's view of a device into :class:`DeviceFacts`; matching is a pure function of
those facts and the profiles, so tests inject H200, A100, RTX 4090, 910B or CPU facts directly.
"""
from __future__ import annotations

import re
import types
from dataclasses import dataclass
from typing import Mapping

from .errors import ProfileError
from .profile_schema import convert

MATCH_KEYS = ("match_device_type", "match_name", "match_capability", "match_soc", "match_min_memory_gib",
              "match_max_memory_gib")


@dataclass(frozen=True)
class DeviceFacts:
    """What auto-selection knows about a device."""

    device_type: str                 # cpu | cuda | npu
    name: str = ""
    capability: str | None = None    # CUDA compute capability, "9.0"
    soc: str | None = None           # NPU SoC version, "Ascend910B3"
    memory_gib: float | None = None
    index: int = 0

    def describe(self) -> str:
        bits = [f"sm_{self.capability.replace('.', '')}" if self.capability else self.soc,
                f"{self.memory_gib:.1f} GiB" if self.memory_gib else None]
        extra = ", ".join(b for b in bits if b)
        where = self.device_type if self.device_type == "cpu" else f"{self.device_type}:{self.index}"
        return f"{where} {self.name}".rstrip() + (f" ({extra})" if extra else "")


def _cuda_facts(index: int) -> DeviceFacts:
    import torch

    p = torch.cuda.get_device_properties(index)
    return DeviceFacts("cuda", p.name, f"{p.major}.{p.minor}", None, p.total_memory / 2**30, index)


def _npu_facts(index: int) -> DeviceFacts:
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)

    name = torch.npu.get_device_name(index)  # the SoC version, e.g. "Ascend910B3"
    soc = name
    memory = torch.npu.get_device_properties(index).total_memory / 2**30
    return DeviceFacts("npu", name, None, soc, memory, index)


def _npu_available() -> bool:
    try:
        import torch
        import torch_npu  # noqa: F401
    except Exception:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def detect_device(device=None) -> DeviceFacts:
    """Facts of ``device`` ("cpu", "cuda:1", a torch.device, or None: cuda, else npu, else cpu)."""
    import torch

    if device is None:
        if torch.cuda.is_available():
            device = "cuda"
        elif _npu_available():
            device = "npu"
        else:
            device = "cpu"
    device = torch.device(device)
    index = device.index or 0
    if device.type == "cuda":
        return _cuda_facts(index)
    if device.type == "npu":
        return _npu_facts(index)
    return DeviceFacts(device.type)


def check_device(device) -> "torch.device":
    """``device`` ("cpu", "cuda", "cuda:N", "npu", "npu:N", or a torch.device) as a torch.device
    that exists here; a ValueError saying what exists otherwise."""
    import torch

    text = str(device)
    m = re.fullmatch(r"(cpu|cuda|npu)(?::(\d+))?", text)
    if not m:
        raise ValueError(f"device: expected cpu, cuda, cuda:N, npu or npu:N, got {device!r}")
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        return torch.device(text)
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    else:
        count = torch.npu.device_count() if _npu_available() else 0
    if count == 0:
        raise ValueError(f"device: {text!r} asked for, but torch sees no {kind.upper()} device")
    if index is not None and int(index) >= count:
        raise ValueError(f"device: {text!r} asked for, but torch sees {count} {kind.upper()} device(s), "
                         f"{kind}:0 to {kind}:{count - 1}")
    return torch.device(text)


def match_reasons(profile, facts: DeviceFacts) -> list[str] | None:
    """Why ``profile`` fits ``facts`` (one phrase per criterion), or None when it does not."""
    if profile.match_device_type != facts.device_type:
        return None
    why = [f"device type {facts.device_type}"]
    if profile.match_name:
        if not re.search(profile.match_name, facts.name, re.IGNORECASE):
            return None
        why.append(f"name matches /{profile.match_name}/")
    if profile.match_capability:
        if facts.capability not in profile.match_capability:
            return None
        why.append(f"capability {facts.capability}")
    if profile.match_soc:
        if not re.search(profile.match_soc, facts.soc or "", re.IGNORECASE):
            return None
        why.append(f"SoC matches /{profile.match_soc}/")
    low, high = profile.match_min_memory_gib, profile.match_max_memory_gib
    if low is not None or high is not None:
        mem = facts.memory_gib
        if mem is None or (low is not None and mem < low) or (high is not None and mem > high):
            return None
        upper = "inf" if high is None else f"{high:g}"
        why.append(f"memory {mem:.0f} GiB in [{low or 0:g}, {upper}]")
    return why


def mapping_matches(data, facts: DeviceFacts, hints: dict, file: str) -> bool:
    """Whether the match keys of a parsed profile mapping (one that may fail to load for another
    reason) select ``facts``; False when they are absent or unreadable. ``hints``: Profile's types."""
    if not isinstance(data, Mapping) or "match_device_type" not in data:
        return False
    try:
        given = {k: convert(data[k], hints[k], k, file) for k in MATCH_KEYS if k in data}
        probe = types.SimpleNamespace(**({k: None for k in MATCH_KEYS} | {"match_capability": ()} | given))
        return match_reasons(probe, facts) is not None
    except (ProfileError, re.error, TypeError):
        return False


def _capability(c: str | None) -> tuple[int, int]:
    return tuple(int(x) for x in c.split(".")) if c else (0, 0)


def _closest(facts: DeviceFacts, same_type: list) -> tuple[object, str]:
    """No profile matches: the same device type, the nearest capability at or below the device's,
    then the nearest memory size."""
    def rank(p):
        caps = [_capability(c) for c in p.match_capability] or [(0, 0)]
        fits = [c for c in caps if c <= _capability(facts.capability)] or [(-1, -1)]
        memory_gap = abs((p.device_memory_gib or 0) - (facts.memory_gib or 0))
        return max(fits), -memory_gap, p.name

    best = max(same_type, key=rank)
    if not facts.capability:
        return best, "closest by memory"
    if rank(best)[0] == (-1, -1):
        return best, "every profile needs a higher compute capability; closest by memory"
    return best, "closest by compute capability and memory"


def match_profile(facts: DeviceFacts, profiles: list) -> tuple[object, str]:
    """(profile, why) for ``facts``: the most specific match, else the closest of the same type."""
    matches = [(p, why) for p in profiles if (why := match_reasons(p, facts)) is not None]
    if matches:
        matches.sort(key=lambda m: (-len(m[1]), m[0].name))
        profile, why = matches[0]
        others = [p.name for p, w in matches[1:] if len(w) == len(why)]
        also = f" (equally specific: {', '.join(others)}; chose by name)" if others else ""
        return profile, f"auto: {facts.describe()} matches {profile.name}: {', '.join(why)}{also}"
    same_type = [p for p in profiles if p.match_device_type == facts.device_type]
    if not same_type:
        raise ProfileError(f"no profile for device type {facts.device_type!r} ({facts.describe()}); "
                           f"profiles: {', '.join(p.name for p in profiles)}; pass --profile or FLASHRT_PROFILE")
    profile, how = _closest(facts, same_type)
    return profile, f"auto: no profile matches {facts.describe()}; {how}: {profile.name}"
