"""The real torch_npu operator schemas and meta (shape) functions, read from the published wheel.

The torch_npu wheel on PyPI ships, next to its compiled library, the schema of every operator it
registers (``npu_native_functions_by_codegen.yaml``), the Python binding of each public operator
(``utils/custom_ops.py``: ``torch_npu.X = torch.ops.npu.X``) and a meta function per operator that
computes the output shapes and dtypes (``op_plugin/meta/_meta_registrations.py``). This module
downloads the wheel once (``pip download --no-deps``, pinned by version and SHA-256, never
installed), reads those files out of the zip, and checks recorded calls against them:

- :func:`binding_problems`: operator name, positional count, keyword names, required arguments and
  the kind of every value against the schema, in readable terms;
- :class:`SchemaOps`: the same schemas defined in a private ``torch.library`` namespace with the
  wheel's meta functions as their Meta kernels, so a call is bound by torch's own argument parser
  (exactly the path ``torch_npu.X(...)`` takes on a device) and its output shapes computed.
"""
from __future__ import annotations

import ast
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import types
import urllib.request
import zipfile
from pathlib import Path

import torch
import yaml

TORCH_NPU_VERSION = "2.14.0"  # flashrt.backends.ascend.TORCH_NPU_TARGET
WHEEL_NAME = f"torch_npu-{TORCH_NPU_VERSION}-cp311-cp311-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "7736f7d82cf9f16c7dfc4537f7e7c638153da760273a193455e70857f912189e"
SCHEMA_FILE = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
BINDINGS_FILE = "torch_npu/utils/custom_ops.py"
META_FILE = "torch_npu/op_plugin/meta/_meta_registrations.py"
TARGET_SOC = 223  # get_soc_version() seen by the meta functions: Ascend910B3 (an Atlas A2)
TARGET_CANN = "9.1.0"  # get_cann_version() seen by the meta functions: the CANN torch_npu 2.14.0 names
DEFAULT_INDEX = "https://pypi.org/simple"


class IndexUnreachable(Exception):
    """The package index could not be reached (the only reason the schema check skips)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _index_reachable(index: str) -> str | None:
    """None when ``index`` answers, else why not."""
    try:
        with urllib.request.urlopen(f"{index.rstrip('/')}/torch-npu/", timeout=20) as r:
            r.read(1)
        return None
    except Exception as exc:  # DNS, refused, timeout, proxy: all mean unreachable here
        return f"{type(exc).__name__}: {exc}"


def fetch_wheel(cache: Path) -> Path:
    """The pinned torch_npu wheel in ``cache`` (downloaded there once, checked by SHA-256)."""
    wheel = cache / WHEEL_NAME
    if wheel.exists() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
               "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", tmp,
               f"torch_npu=={TORCH_NPU_VERSION}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        got = Path(tmp) / WHEEL_NAME
        if r.returncode != 0 or not got.exists():
            index = os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX)
            why = _index_reachable(index)
            if why:
                raise IndexUnreachable(f"package index {index} unreachable ({why})")
            raise RuntimeError(f"pip download of torch_npu=={TORCH_NPU_VERSION} failed:\n{r.stdout}\n{r.stderr}")
        digest = _sha256(got)
        if digest != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL_NAME}: sha256 {digest}, expected {WHEEL_SHA256}")
        os.replace(got, wheel)  # atomic: a reader never sees a partial wheel
    return wheel


def read_member(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(member).decode("utf-8")


def load_schemas(wheel: Path) -> dict[str, list[str]]:
    """operator name -> its schema strings (one per overload), from the wheel's codegen YAML."""
    doc = yaml.safe_load(read_member(wheel, SCHEMA_FILE))
    out: dict[str, list[str]] = {}
    for entries in doc.values():
        for e in entries if isinstance(entries, list) else ():
            func = e.get("func") if isinstance(e, dict) else None
            if func and "(" in func:
                name = func.split("(", 1)[0].split(".", 1)[0]
                if func not in out.setdefault(name, []):
                    out[name].append(func)
    return out


def bound_operators(wheel: Path) -> set[str]:
    """The public operators torch_npu binds as ``torch_npu.X = torch.ops.npu.X``."""
    tree = ast.parse(read_member(wheel, BINDINGS_FILE))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute):
            target, value = node.targets[0], node.value
            if (getattr(target.value, "id", None) == "torch_npu" and isinstance(value, ast.Attribute)
                    and value.attr == target.attr and ast.unparse(value.value) == "torch.ops.npu"):
                names.add(target.attr)
    return names


class _ErrCode:
    def __getattr__(self, name):
        return name


def _meta_namespace(registry: dict) -> dict:
    """The names the meta file imports, stubbed: torch_npu's dtype codes, the SoC and CANN version
    of the target, and ``impl`` collecting each function by operator name."""
    npu = types.SimpleNamespace(utils=types.SimpleNamespace(_is_gte_cann_version=lambda v, m="CANN": TARGET_CANN >= v))
    torch_npu = types.SimpleNamespace(int4=285, hifloat8=290, float8_e8m0fnu=293, float4_e2m1fn_x2=296,
                                      float4_e1m2fn_x2=297, npu=npu)

    def impl(lib, name):
        def register(fn):
            if lib == "npu":
                registry.setdefault(name, fn)
            return fn
        return register

    return {"__name__": "torch_npu_meta", "torch": torch, "torch_npu": torch_npu, "Library": lambda ns, *a: ns,
            "impl": impl, "has_side_effect": lambda op: None, "ErrCode": _ErrCode(), "ops_error": lambda code: "",
            "get_cann_version": lambda: TARGET_CANN, "get_soc_version": lambda: TARGET_SOC}


def load_meta(wheel: Path) -> dict:
    """operator name (with overload, e.g. ``npu_grouped_matmul.List``) -> its meta function.

    The file is executed without its torch_npu imports and module-level ``has_side_effect`` calls
    (they need the compiled library); :func:`_meta_namespace` provides those names."""
    tree = ast.parse(read_member(wheel, META_FILE))
    keep = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if mod.startswith("torch_npu") or mod == "torch.library" or mod == "torch.fx.node":
                continue
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "has_side_effect"):
            continue
        keep.append(node)
    registry: dict = {}
    exec(compile(ast.Module(keep, type_ignores=[]), META_FILE, "exec"), _meta_namespace(registry))
    return registry


def _kind_ok(t, v) -> bool:
    kind = t.kind()
    if kind == "OptionalType":
        return v is None or _kind_ok(t.getElementType(), v)
    if kind == "TensorType":
        return isinstance(v, torch.Tensor)
    if kind == "ListType":
        return isinstance(v, (list, tuple)) and all(_kind_ok(t.getElementType(), e) for e in v)
    if kind in ("IntType", "SymIntType"):  # a torch.dtype is passed as its ScalarType code
        return (isinstance(v, int) and not isinstance(v, bool)) or isinstance(v, torch.dtype)
    if kind == "FloatType":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "BoolType":
        return isinstance(v, bool)
    if kind == "StringType":
        return isinstance(v, str)
    return True  # other kinds: left to torch's parser in SchemaOps


def _kind_of(v) -> str:
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__}[{', '.join(sorted({_kind_of(e) for e in v}))}]"
    return "Tensor" if isinstance(v, torch.Tensor) else type(v).__name__


def binding_problems(schema_str: str, positional: tuple, keywords: dict) -> list[str]:
    """What is wrong with calling ``schema_str`` with these values (empty: nothing)."""
    s = torch._C.parse_schema(schema_str)
    args = list(s.arguments)
    plain = [a for a in args if not a.kwarg_only]
    problems, given = [], {}
    if len(positional) > len(plain):
        problems.append(f"{len(positional)} positional arguments, the schema takes {len(plain)}")
    for a, v in zip(plain, positional):
        given[a.name] = v
    names = {a.name: a for a in args}
    for k, v in keywords.items():
        if k not in names:
            problems.append(f"unknown argument {k!r}")
        elif k in given:
            problems.append(f"argument {k!r} given positionally and by keyword")
        else:
            given[k] = v
    for a in args:
        if a.name not in given and not a.has_default_value():
            problems.append(f"required argument {a.name!r} ({a.type}) missing")
        elif a.name in given and not _kind_ok(a.type, given[a.name]):
            problems.append(f"argument {a.name!r} expects {a.type}, got {_kind_of(given[a.name])}")
    return problems


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in v):
        return [_to_meta(e) for e in v]
    return v


class SchemaOps:
    """The wheel's schemas defined in the private namespace ``torch.ops.flashrt_torch_npu`` (one
    per process), each overload with the wheel's meta function as its Meta kernel."""

    NAMESPACE = "flashrt_torch_npu"
    _lib = None
    _defined: set = set()

    def __init__(self, schemas: dict[str, list[str]], metas: dict):
        self.schemas, self.metas = schemas, metas
        if SchemaOps._lib is None:
            SchemaOps._lib = torch.library.Library(self.NAMESPACE, "FRAGMENT")

    def op(self, name: str):
        """``torch.ops.flashrt_torch_npu.<name>`` (defined on first use)."""
        if name not in SchemaOps._defined:
            for func in self.schemas[name]:
                overload = func.split("(", 1)[0]
                meta = self.metas.get(overload)
                if meta is None:
                    raise KeyError(f"the wheel has no meta function for {overload}")
                SchemaOps._lib.define(func)
                SchemaOps._lib.impl(overload, meta, "Meta")
            SchemaOps._defined.add(name)
        return getattr(getattr(torch.ops, self.NAMESPACE), name)

    def run(self, name: str, positional: tuple, keywords: dict):
        """The call bound by torch's argument parser against the schema, its outputs computed by the
        wheel's meta function on meta tensors of the same shapes, strides and dtypes."""
        return self.op(name)(*[_to_meta(v) for v in positional], **{k: _to_meta(v) for k, v in keywords.items()})


def output_problems(meta, actual, where: str = "output") -> list[str]:
    """Where ``actual`` (what the emulation returned, i.e. what the backend consumed) differs in
    structure, shape or dtype from ``meta`` (what the real operator returns per its meta function)."""
    if isinstance(meta, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(meta):
            return [f"{where}: the meta function returns {len(meta)} outputs, the emulation {_kind_of(actual)}"]
        return [p for i, (m, a) in enumerate(zip(meta, actual)) for p in output_problems(m, a, f"{where}[{i}]")]
    if isinstance(meta, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{where}: a tensor per the meta function, the emulation returned {_kind_of(actual)}"]
        if tuple(meta.shape) != tuple(actual.shape) or meta.dtype != actual.dtype:
            return [f"{where}: meta {meta.dtype} {list(meta.shape)}, emulation {actual.dtype} {list(actual.shape)}"]
    return []
