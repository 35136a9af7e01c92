"""Input validation shared by every op of :mod:`flashrt.ops`.

Shape specs are strings of dimension symbols (``"B S H D"``): the first occurrence of a symbol
binds it in ``env``, later ones must match; integer literals must match exactly. Every failure is
a ``ValueError`` naming the argument, the expected and the given shape or dtype.

Index-range checks read index values, which costs a device synchronisation on accelerators; they
run by default and can be switched off for a hot loop (e.g. inside CUDA-graph capture) with
``flashrt.value_checks(False)``.
"""
from __future__ import annotations

import contextlib

import torch

from .formats import FORMATS, QTensor, check_qtensor

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
F32 = (torch.float32,)
I32 = (torch.int32,)
KV_FORMATS = ("fp8", "fp4_b16", "fp4_b32", "int8")  # int8: devices with no FP8 (formats.py)
WEIGHT_FORMATS = ("fp8_w", "fp4_w", "int8_w")  # int8_w: int8_t activations (formats.py)
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
_STATE = {"values": True}


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Enable or disable the checks that read tensor values (index ranges) inside the block."""
    old = _STATE["values"]
    _STATE["values"] = bool(enabled)
    try:
        yield
    finally:
        _STATE["values"] = old


@contextlib.contextmanager
def host_syncs_raise():
    """Inside the block a CUDA operation that waits for the device (``.item()``, ``bool(t)``,
    ``nonzero``, a device-to-host copy) raises instead of syncing: how a caller learns, in an
    ordinary run, that the work could not be captured in a CUDA graph (a failed capture would
    leave the allocator and the RNG mid-capture). No effect without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def is_host_sync_error(exc: BaseException) -> bool:
    """Whether ``exc`` is what :func:`host_syncs_raise` raises for a synchronizing operation."""
    return isinstance(exc, RuntimeError) and "synchroniz" in str(exc)


_SPECS: dict[str, tuple] = {}


def _dims(spec: str) -> tuple:
    """``"B S 3"`` -> ``("B", "S", 3)``, parsed once per spec string."""
    dims = _SPECS.get(spec)
    if dims is None:
        dims = _SPECS[spec] = tuple(int(s) if s.isdigit() else s for s in spec.split())
    return dims


def values_checked() -> bool:
    """Whether checks that read tensor values (index ranges, token ids) are on."""
    return _STATE["values"]


def _fmt_dims(dims, env: dict) -> str:
    return "[" + ", ".join(f"{s}={env[s]}" if s in env else str(s) for s in dims) + "]"


def shape(name: str, t, spec: str, env: dict) -> None:
    """Check ``t.shape`` against ``spec``, binding new symbols into ``env``."""
    dims = _SPECS.get(spec) or _dims(spec)
    got = t.shape
    if len(got) != len(dims):
        raise ValueError(f"{name}: expected {len(dims)} dims {_fmt_dims(dims, env)}, got shape {tuple(got)}")
    for sym, n in zip(dims, got):
        want = sym if sym.__class__ is int else env.setdefault(sym, n)
        if want != n:
            raise ValueError(f"{name}: expected shape {_fmt_dims(dims, env)}, got {tuple(got)}")


def tensor(name: str, t, spec: str | None, env: dict, dtypes=None, device=None) -> None:
    """``t`` is a torch.Tensor of ``spec`` shape, one of ``dtypes``, on ``device`` when given."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if spec is not None:
        shape(name, t, spec, env)
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of the other inputs), got {t.device}")


def maybe_quantized(name: str, t, spec: str | None, env: dict, formats, device=None) -> None:
    """``t`` is a float tensor or a QTensor in one of ``formats``, of ``spec`` logical shape (any
    shape when ``spec`` is None)."""
    if isinstance(t, QTensor):
        if t.fmt not in formats:
            raise ValueError(f"{name}: expected a plain tensor or a QTensor in {list(formats)}, got fmt {t.fmt!r}")
        check_qtensor(t, name)
        if spec is not None:
            shape(name, t, spec, env)
        if device is not None and t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    else:
        tensor(name, t, spec, env, FLOATS, device)


def fmt(name: str, value) -> None:
    if value not in FORMATS:
        raise ValueError(f"{name}: expected one of {sorted(FORMATS)}, got {value!r}")


def integer(name: str, value, low: int, high: int | None = None) -> None:
    """``low <= value (<= high)`` and an int (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}: expected an int {bound}, got {value}")


def number(name: str, value, low: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    if low is not None and not value >= low:
        raise ValueError(f"{name}: expected a number >= {low}, got {value}")


def choice(name: str, value, options) -> None:
    if value not in options:
        raise ValueError(f"{name}: expected one of {list(options)}, got {value!r}")


def host_memory(name: str, t: QTensor, device: torch.device) -> None:
    """``t`` lives on ``device`` or on the CPU, page-locked when ``device`` is an accelerator (a
    kernel there reads it in place). Pinning is asked of the driver: a value check, skipped under
    ``value_checks(False)`` (e.g. inside a CUDA-graph capture)."""
    where = t.device
    if where == device or device.type == "meta":
        return
    if where.type != "cpu":
        raise ValueError(f"{name}: expected a tensor on the CPU or on {device}, got {where}")
    if device.type != "cpu" and _STATE["values"] and not (t.data.is_pinned() and t.scale.is_pinned()):
        raise ValueError(f"{name}: expected pinned (page-locked) host memory for a {device.type} computation, "
                         f"got pageable memory (pin it with .pin_memory())")


def value_range(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, read with one device sync."""
    lo, hi = torch.stack(torch.aminmax(t)).tolist()
    return lo, hi


def index_range(name: str, idx: torch.Tensor, low: int, high: int) -> None:
    """Every value of ``idx`` lies in ``[low, high)`` (skipped under ``value_checks(False)``)."""
    if not _STATE["values"] or idx.numel() == 0 or idx.device.type == "meta":
        return
    lo, hi = value_range(idx)
    if lo < low or hi >= high:
        raise ValueError(f"{name}: expected values in [{low}, {high}), got values in [{lo}, {hi}]")


def paged_keys(name: str, k, spec: str, env: dict, formats, device=None) -> None:
    """``k`` is a :class:`flashrt.kv.paged.PagedKeys` of logical ``spec`` shape ``[B, T, D]``: a pool
    ``[1, rows, D]`` (plain or QTensor in ``formats``) with ``rows % page_size == 0``, an int32
    block table ``[B, max_pages]`` on the same device, ``0 <= length <= max_pages * page_size``
    and block-table entries in ``[0, rows / page_size)`` (a value check)."""
    b_sym, t_sym, d_sym = _dims(spec)
    integer(f"{name}.page_size", k.page_size, 1)
    integer(f"{name}.length", k.length, 0)
    pool_env = {d_sym: env[d_sym]} if d_sym in env else {}
    maybe_quantized(f"{name}.pool", k.pool, f"1 rows {d_sym}", pool_env, formats, device)
    rows = pool_env["rows"]
    if rows % k.page_size:
        raise ValueError(f"{name}.pool: expected rows % page_size == 0 (page_size={k.page_size}), got {rows} rows")
    tensor(f"{name}.block_table", k.block_table, f"{b_sym} max_pages", env, (torch.int32,), k.pool.device)
    if k.length > env["max_pages"] * k.page_size:
        raise ValueError(f"{name}.length: expected <= max_pages * page_size = {env['max_pages'] * k.page_size}, "
                         f"got {k.length}")
    env.pop("max_pages")
    env.setdefault(d_sym, pool_env[d_sym])
    if env.setdefault(t_sym, k.length) != k.length:
        raise ValueError(f"{name}.length: expected {t_sym}={env[t_sym]}, got {k.length}")
    if k.length:
        used = k.block_table[:, : -(-k.length // k.page_size)]
        index_range(f"{name}.block_table", used, 0, rows // k.page_size)


def same_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """``t`` has ``dtype`` (the dtype of the op's first input)."""
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype} (the dtype of q), got {t.dtype}")
