"""Checkpoint save / load: ``config.json``, safetensors shards, ``SHA256SUMS`` (docs/model.md, 8).

Files: ``config.json`` (``cfg.to_dict()``); ``model.safetensors`` when all fits one shard, else
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` (HF: ``metadata.total_size``,
``weight_map``); ``SHA256SUMS`` (``sha256sum`` format). Plain kinds are stored BF16 / F32; quantized
kinds as ``name`` + ``.scale`` (F8_E8M0) with F8_E4M3 data, or for ``fp4_w`` the packed bytes
``[out, in/2]`` as F4 (``float4_e2m1fn_x2``) where safetensors supports it, else I8 (``fp4_dtype``).
:func:`load` accepts BF16 or F32 for plain kinds and I8, U8 or F4 for FP4 bytes, which are ``uint8``
in memory; it also reads the published directory as it is (:mod:`.published`: the Hugging Face
root config, ``wo_a`` stored FP8 + scale, the vision tensors), checks every weight for NaN / Inf
(:mod:`.finite`) and, with ``verify``, ``SHA256SUMS`` (:mod:`.verify`). A save writes a hidden
temporary sibling directory and renames it into place, so a killed save never leaves a
complete-looking checkpoint; the next save of the same target sweeps what a killed one left
(:mod:`.partial`). Errors name the tensor or the file.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save as _st_save, save_file

from flashrt.errors import CheckpointError
from flashrt.formats import QTensor, dequantize, expected_layout

from . import partial, published
from .config import ModelConfig
from .finite import FiniteCheck, checks_enabled
from .params import QUANTIZED, ParamSpec, param_specs
from .shards import DTYPE_BYTES, INDEX, SINGLE, open_shards
from .verify import SUMS, sha256_file, verify_checksums

CONFIG = "config.json"
PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
F4 = getattr(torch, "float4_e2m1fn_x2", None)
FP4_LOAD_DTYPES = (torch.int8, torch.uint8) + ((F4,) if F4 is not None else ())
Progress = Callable[[int, int], None] | None


@functools.cache
def f4_supported() -> bool:
    """Whether torch and the installed safetensors can store ``float4_e2m1fn_x2`` (F4)."""
    try:
        return F4 is not None and bool(_st_save({"x": torch.zeros(1, 1, dtype=torch.uint8).view(F4)}))
    except Exception:  # noqa: BLE001 - any failure means "not supported"
        return False


def fp4_store_dtype(choice: str = "auto") -> torch.dtype:
    """The dtype FP4 bytes are written in: ``auto`` (F4 if supported, else I8), ``f4``, ``i8``, ``u8``."""
    f4 = F4 if f4_supported() else None
    table = {"auto": f4 or torch.int8, "i8": torch.int8, "u8": torch.uint8, "f4": f4}
    if table.get(choice) is None:
        raise ValueError(f"fp4_dtype: expected auto, i8, u8 or f4 (if supported), got {choice!r}")
    return table[choice]


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _expect(name: str, t: torch.Tensor, dtypes, shape: torch.Size) -> None:
    if t.dtype not in dtypes or t.shape != shape:
        want = "/".join(_dt(d) for d in dtypes)
        raise CheckpointError(f"tensor {name!r}: expected {want} {list(shape)}, "
                              f"found {_dt(t.dtype)} {list(t.shape)}")


def decode(spec: ParamSpec, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor | QTensor:
    """Check the stored tensor(s) of ``spec`` and return the in-memory value (CheckpointError if bad).
    A plain-kind weight given with a ``scale`` is stored FP8 (``published.fp8_plain``): dequantized."""
    if spec.kind in PLAIN_DTYPES and scale is not None:
        want_data, want_scale = expected_layout("fp8_w", spec.shape)
        _expect(spec.name, data, (torch.float8_e4m3fn,), want_data)
        _expect(published.fp8_scale_name(spec.name), scale, (torch.float8_e8m0fnu,), want_scale)
        return dequantize(QTensor(data, scale, "fp8_w", torch.Size(spec.shape)), PLAIN_DTYPES[spec.kind])
    if spec.kind in PLAIN_DTYPES:
        _expect(spec.name, data, (torch.bfloat16, torch.float32), torch.Size(spec.shape))
        return data.to(PLAIN_DTYPES[spec.kind])
    fmt = QUANTIZED[spec.kind]
    want_data, want_scale = expected_layout(fmt, spec.shape)
    _expect(spec.name, data, FP4_LOAD_DTYPES if fmt == "fp4_w" else (torch.float8_e4m3fn,), want_data)
    _expect(spec.scale_name, scale, (torch.float8_e8m0fnu,), want_scale)
    data = data.view(torch.uint8) if fmt == "fp4_w" else data
    return QTensor(data, scale, fmt, torch.Size(spec.shape))


def expected_names(specs: list[ParamSpec], fp8_plain=()) -> dict[str, str]:
    """Every stored tensor name -> a description of what is expected there (``fp8_plain``: plain
    weights stored as FP8 + scale)."""
    out = {}
    for s in specs:
        if s.kind in QUANTIZED:
            data, scale = expected_layout(QUANTIZED[s.kind], s.shape)
            out[s.name] = f"{s.kind} data {list(data)}"
            out[s.scale_name] = f"float8_e8m0fnu {list(scale)}"
        elif s.name in fp8_plain:
            data, scale = expected_layout("fp8_w", s.shape)
            out[s.name] = f"{s.kind} {list(s.shape)} stored as float8_e4m3fn {list(data)}"
            out[published.fp8_scale_name(s.name)] = f"float8_e8m0fnu {list(scale)}"
        else:
            out[s.name] = f"{s.kind} {list(s.shape)}"
    return out


def check_names(specs: list[ParamSpec], found: dict[str, str], fp8_plain=()) -> None:
    """CheckpointError naming the first missing or unexpected tensor (``found``: name -> description)."""
    expected = expected_names(specs, fp8_plain)
    missing, extra = [n for n in expected if n not in found], sorted(set(found) - set(expected))
    for what, names in (("missing", missing), ("unexpected", extra)):
        if names:
            n, more = names[0], f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            want, got = (expected[n], "nothing") if what == "missing" else ("no such tensor", found[n])
            raise CheckpointError(f"{what} tensor {n!r}: expected {want}, found {got}{more}")


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, contiguous and owning its storage (a view of a stacked expert weight is
    copied out: safetensors refuses tensors that share memory)."""
    t = t.detach().cpu().contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def encode(weights: dict, cfg: ModelConfig, fp4_dtype: str = "auto") -> dict[str, torch.Tensor]:
    """The tensors to store for ``weights`` (validated like a load), in ``param_specs`` order, on CPU."""
    specs = param_specs(published.text_config(cfg) if published.text_only(cfg, weights, False) else cfg)
    found = {k: type(v).__name__ for k, v in weights.items()}
    check_names(specs, found | {s.scale_name: "scale" for s in specs if s.scale_name and s.name in found})
    store4, out = fp4_store_dtype(fp4_dtype), {}
    for s in specs:
        w, scale = weights[s.name], None
        quantized = isinstance(w, QTensor)
        if quantized != (s.kind in QUANTIZED) or (quantized and w.fmt != QUANTIZED[s.kind]):
            found = f"QTensor {w.fmt}" if quantized else f"tensor {_dt(w.dtype)}"
            raise CheckpointError(f"tensor {s.name!r}: expected kind {s.kind}, found {found}")
        if quantized:
            data, scale = _own(w.data), _own(w.scale)
            if w.fmt == "fp4_w" and data.dtype in FP4_LOAD_DTYPES:
                data = data.view(store4)
        else:
            data = _own(w)
        decode(s, data, scale)
        out[s.name] = data if scale is not None else data.to(PLAIN_DTYPES[s.kind])
        if scale is not None:
            out[s.scale_name] = scale
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> dict[str, list[str]]:
    """File name -> tensor names, in order; a ``.scale`` stays with the weight before it (``encode``)."""
    shards, size = [[]], 0
    for name, t in tensors.items():
        if shards[-1] and size + _nbytes(t) > max_shard_bytes and not name.endswith(".scale"):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += _nbytes(t)
    if len(shards) == 1:
        return {SINGLE: shards[0]}
    return {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_dir(tmp: Path, cfg: ModelConfig, tensors: dict, files: dict, progress: Progress) -> None:
    (tmp / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    total, done = sum(_nbytes(t) for t in tensors.values()), 0
    for fname, names in files.items():
        save_file({n: tensors[n] for n in names}, str(tmp / fname), metadata={"format": "pt"})
        _fsync(tmp / fname)
        done += sum(_nbytes(tensors[n]) for n in names)
        if progress is not None:
            progress(done, total)
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: fname for fname, names in files.items() for n in names}}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    listed = [p for p in sorted(tmp.iterdir()) if p.name != partial.MARKER]
    (tmp / SUMS).write_text("".join(f"{sha256_file(p)}  {p.name}\n" for p in listed))
    _fsync(tmp / SUMS)


def _check_target(path: Path) -> None:
    if path.exists() and not (path.is_dir() and (not any(path.iterdir()) or (path / CONFIG).is_file())):
        raise FileExistsError(f"{path}: exists and is not a checkpoint directory; not overwriting it")


def _move_into_place(tmp: Path, path: Path) -> None:
    _check_target(path)
    if not path.exists() or not any(path.iterdir()):
        os.replace(tmp, path)  # rename(2) replaces an empty directory atomically
        return
    old = partial.make_temp(path.parent, path.name, "old")
    os.replace(path, old / path.name)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save(weights: dict, cfg: ModelConfig, path, max_shard_bytes: int = 2**30, progress: Progress = None,
         *, fp4_dtype: str = "auto") -> Path:
    """Write ``weights`` (as ``init_weights`` / ``load`` make them) and ``cfg`` as a checkpoint at ``path``.
    ``progress(done, total)`` counts tensor bytes written, once per shard. Returns ``path``."""
    path = Path(path)
    _check_target(path)
    tensors = encode(weights, cfg, fp4_dtype)
    files = plan_shards(tensors, max_shard_bytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial.sweep(path.parent, path.name, CONFIG)
    tmp = partial.make_temp(path.parent, path.name, "tmp")
    try:
        _write_dir(tmp, cfg, tensors, files, progress)
        _move_into_place(tmp, path)
        (path / partial.MARKER).unlink(missing_ok=True)
        partial.sweep(path.parent, path.name, CONFIG)  # old copies of killed saves, now that path is complete
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_config(path) -> ModelConfig:
    """The config of checkpoint directory ``path``: ``config.json`` (flat or the published Hugging
    Face layout), checked against ``inference/config.json`` when that exists."""
    path = Path(path)
    try:
        cfg = ModelConfig.from_file(str(path / CONFIG))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / CONFIG}: {exc}") from None
    published.check_inference_config(path, cfg)
    return cfg


def load(path, cfg: ModelConfig | None = None, device=None, verify: bool = False, progress: Progress = None,
         check_finite: bool | None = None, verify_files=()) -> tuple[ModelConfig, dict[str, torch.Tensor | QTensor]]:
    """Read a checkpoint: ``(cfg, weights)`` with weights as :func:`init_weights` makes them. A given
    ``cfg`` overrides ``config.json``; ``verify`` checks ``SHA256SUMS`` first (``verify_files``: more
    names that must be listed); ``check_finite`` rejects NaN / Inf weights (None: on unless a
    ``finite.weight_checks(False)`` block says otherwise); ``progress(done, total)``
    counts parameters; weights move to ``device`` when given."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if verify:
        verify_checksums(path, verify_files)
    cfg = cfg if cfg is not None else read_config(path)
    weights, finite = {}, FiniteCheck() if checks_enabled(check_finite) else None
    with contextlib.ExitStack() as stack:
        where = open_shards(path, stack)
        headers = {k: h.get_slice(k) for k, h in where.items()}
        text_only = published.text_only(cfg, headers, published.is_published(path))
        specs = param_specs(published.text_config(cfg) if text_only else cfg)
        ignored = published.vision_tensors(headers, cfg) if text_only else []
        if text_only and not ignored:
            published.log_no_vision(cfg)
        fp8_plain = published.fp8_plain(specs, {k: v.get_dtype() for k, v in headers.items()})
        skip = set(ignored)
        check_names(specs, {k: f"{v.get_dtype()} {v.get_shape()}" for k, v in headers.items() if k not in skip},
                    fp8_plain)
        published.log_ignored(ignored, sum(_slice_bytes(headers[n]) for n in ignored))
        for i, s in enumerate(specs):
            scale_name = published.fp8_scale_name(s.name) if s.name in fp8_plain else s.scale_name
            scale = where[scale_name].get_tensor(scale_name) if scale_name else None
            value = decode(s, where[s.name].get_tensor(s.name), scale)
            value = value if device is None else value.to(device)
            if finite is not None:  # on the target device: a GPU reduces faster than the host reads
                finite.add(s.name, value)
            weights[s.name] = value
            if progress is not None:
                progress(i + 1, len(specs))
        if finite is not None:
            finite.finish()
    return cfg, weights


def _slice_bytes(sl) -> int:
    n = 1
    for d in sl.get_shape():
        n *= d
    return int(n * DTYPE_BYTES.get(sl.get_dtype(), 1))
