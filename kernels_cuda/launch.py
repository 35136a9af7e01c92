"""Host-side helpers of the launchers: the active tiles and per-shape launch plans, device facts,
no-copy contiguity, zero inputs for the warm-up hooks.

A launcher's per-call Python work should be what truly changes per call (pointers, a few sizes):
everything that follows from the shapes, dtypes and the active profile's tiles (tile sizes, grid,
splits, constexprs) is computed once into a plan and kept in a :class:`PlanCache`, keyed by what
determines it. The cache belongs to one merged tiles dict: ``flashrt.profiles.tiles`` returns a
new one whenever the active profile changes (or its cache is cleared), and the cache then starts
empty, so a plan never outlives the profile it was made under.
"""
from __future__ import annotations

import torch
import triton.language as tl

from flashrt import jit_targets, profiles
from flashrt.dtypes import TORCH
from flashrt.formats import QTensor
from flashrt.kv.util import empty_qtensor


class PlanCache:
    """The tiles of one kernel family under the active profile (``tiles.<family>`` of the profile
    over the family's ``TILES`` defaults) and the launch plans made with them. Every launcher
    reads its tiles here (:meth:`tiles`)."""

    def __init__(self, family: str, defaults: dict):
        self.family, self.defaults = family, defaults
        self._tiles: dict | None = None  # the merged tiles the plans were made with (held: no id reuse)
        self._plans: dict = {}

    def tiles(self) -> dict:
        """The active tiles (read-only)."""
        return self.lookup(None)[0]

    def lookup(self, key) -> tuple[dict, object]:
        """(the active tiles, the plan stored under ``key`` for them or None)."""
        tiles = profiles.tiles(self.family, self.defaults)
        if tiles is not self._tiles:
            self._tiles, self._plans = tiles, {}
        return tiles, self._plans.get(key)

    def store(self, key, plan):
        self._plans[key] = plan
        return plan

    def __len__(self) -> int:
        return len(self._plans)


def sm_count(device: torch.device, default: int = 132) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (queried once per device) or of the architecture
    being cross-compiled for (:mod:`flashrt.jit_targets`); ``default`` elsewhere."""
    if jit_targets.cross_target() is not None or device.type == "cuda":
        return jit_targets.sm_count(device.index)
    return default


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous, else a contiguous copy."""
    return t if t.is_contiguous() else t.contiguous()


def last_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has unit stride, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def zeros_stored(fmt: str | None, shape, dtype: torch.dtype, device) -> torch.Tensor | QTensor:
    """A zero-filled tensor as ``fmt`` stores it (None: plain ``dtype``): compile-only inputs for warm-up."""
    if fmt is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty_qtensor(fmt, shape, device)


# torch -> Triton dtypes of flashrt.dtypes' table (Triton names them as torch does: tl.bfloat16, ...)
TL_DTYPES = {dt: getattr(tl, str(dt).removeprefix("torch.")) for dt in TORCH.values()}


def split_k(out_tiles: int, blocks: int, forced, sms: int, min_blocks: int | None = 4,
            per_sm: int | None = None) -> int:
    """K splits of a GEMM launch: ``forced`` (a count, capped at the K blocks); else none when
    ``min_blocks`` is None; else, with ``per_sm`` set, the count that brings the programs nearest to
    ``per_sm`` an SM (the smaller on a tie; whether or not the output tiles fill the SMs once); else
    none when the output tiles fill the SMs, and enough for ~2 programs an SM below that. A split
    keeps >= ``min_blocks`` K blocks."""
    if forced is not None:
        return max(1, min(int(forced), blocks))
    if min_blocks is None:
        return 1
    most = blocks // max(1, int(min_blocks))
    if per_sm is not None:
        return max(1, min(cdiv(2 * int(per_sm) * sms - out_tiles, 2 * out_tiles), most))
    if out_tiles >= sms:
        return 1
    return max(1, min(cdiv(2 * sms, out_tiles), most))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` (``triton.cdiv`` is a constexpr function: microseconds per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2``."""
    return n if n <= 1 else 1 << (n - 1).bit_length()
