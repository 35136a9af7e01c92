"""The op contract is one namespace: every op a group file (``core/ops_*.py``) defines is named by
``flashrt.ops`` and listed in ``OPS``, and every name of ``OPS`` is a function of ``flashrt.ops``."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import flashrt
from flashrt import ops


def group_modules() -> list:
    core = Path(flashrt.__file__).parent
    return [importlib.import_module(f"flashrt.{p.stem}") for p in sorted(core.glob("ops_*.py"))]


def test_every_op_of_a_group_file_is_named_by_the_contract():
    modules = group_modules()
    assert modules
    for module in modules:
        defined = [(name, fn) for name, fn in inspect.getmembers(module, inspect.isfunction)
                   if fn.__module__ == module.__name__ and not name.startswith("_")]
        assert defined, module.__name__
        for name, fn in defined:
            assert getattr(ops, name, None) is fn, f"flashrt.ops does not name {module.__name__}.{name}"
            assert name in ops.OPS, f"{module.__name__}.{name} is not listed in flashrt.ops.OPS"


def test_every_listed_op_is_a_function_of_the_contract():
    assert len(set(ops.OPS)) == len(ops.OPS)
    for name in ops.OPS:
        assert inspect.isfunction(getattr(ops, name, None)), f"flashrt.ops.OPS lists {name!r}, not a function there"
