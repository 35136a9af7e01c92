"""Import rules between the layers, read from every module's source (ast), not from a run.

| layer | may import |
|---|---|
| core (``flashrt``), outside ``cli`` and ``bench`` | core only |
| ``flashrt.cli``, ``flashrt.bench`` | anything |
| ``flashrt.graphs`` | core, graphs |
| ``flashrt.engine`` | core, graphs, engine |
| ``flashrt.kernels_cuda`` / ``kernels_ascend`` | core, the package itself |
| ``flashrt.backends.<name>`` | core; ``cuda`` and ``ascend`` also their own kernel package |

Every import statement counts, module level or inside a function (lazy imports are imports).
The package root names ``load``, ``generate`` and ``backends`` lazily through ``_FACADE`` (strings,
resolved on first attribute access): that is not an import, and the facade may name nothing else.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"core": "flashrt", "graphs": "flashrt.graphs", "engine": "flashrt.engine",
            "backends": "flashrt.backends", "kernels_cuda": "flashrt.kernels_cuda",
            "kernels_ascend": "flashrt.kernels_ascend", "hwconfigs": "flashrt.hwconfigs"}
CHECKED = ("core", "graphs", "engine", "backends", "kernels_cuda", "kernels_ascend")
OWN_KERNELS = {"cuda": "kernels_cuda", "ascend": "kernels_ascend"}


def module_name(path: Path) -> tuple[str, bool]:
    """(dotted module name, is a package ``__init__``) of a source file under ROOT."""
    rel = path.relative_to(ROOT)
    parts = [PACKAGES[rel.parts[0]].split(".")] + [list(rel.parts[1:-1])]
    name = [p for part in parts for p in part]
    package = rel.name == "__init__.py"
    if not package:
        name.append(rel.stem)
    return ".".join(name), package


def source_files() -> list[Path]:
    return sorted(p for folder in CHECKED for p in (ROOT / folder).rglob("*.py"))


KNOWN = {module_name(p)[0] for folder in PACKAGES for p in (ROOT / folder).rglob("*.py")}


def imports(source: str, module: str, package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) of every ``flashrt`` import in ``source``; ``from P import n``
    counts as ``P.n`` when that is a module, relative imports are resolved against ``module``."""
    found = []
    base = module.split(".") if package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in KNOWN else target))
    return [(line, name) for line, name in found if name == "flashrt" or name.startswith("flashrt.")]


def layer(name: str) -> str:
    """The layer a ``flashrt`` module belongs to: core, cli, bench, graphs, engine, kernels_cuda,
    kernels_ascend, or ``backends`` / ``backends.<name>``."""
    parts = name.split(".")
    if len(parts) == 1 or parts[1] == "hwconfigs":
        return "core"
    if parts[1] in ("cli", "bench", "graphs", "engine", "kernels_cuda", "kernels_ascend"):
        return parts[1]
    if parts[1] == "backends":
        return "backends" if len(parts) == 2 else f"backends.{parts[2]}"
    return "core"


def allowed(src: str, dst: str) -> bool:
    if src in ("cli", "bench") or dst == "core" or dst == src:
        return True
    if src == "engine":
        return dst == "graphs"
    if src.startswith("backends."):
        return dst == OWN_KERNELS.get(src.split(".")[1])
    return False


RULES = {"core": "core (outside cli and bench) imports core only",
         "graphs": "graphs imports only core",
         "engine": "engine imports graphs and core",
         "kernels_cuda": "a kernel package imports only core and itself",
         "kernels_ascend": "a kernel package imports only core and itself",
         "backends": "the backends package imports core only"}


def violations(source: str, path: str, module: str, package: bool = False) -> list[str]:
    """One line per import that breaks a rule: ``path:line: imports X (rule)``."""
    src = layer(module)
    out = []
    for line, name in imports(source, module, package):
        dst = layer(name)
        if not allowed(src, dst):
            if src.startswith("backends."):
                rule = f"a backend imports core and its own kernel package ({OWN_KERNELS.get(src[9:], 'none')})"
            else:
                rule = RULES[src]
            out.append(f"{path}:{line}: imports {name} ({rule})")
    return out


def test_every_module_keeps_the_import_rules():
    found = []
    for path in source_files():
        module, package = module_name(path)
        found += violations(path.read_text(), str(path.relative_to(ROOT)), module, package)
    assert not found, "import rules broken:\n" + "\n".join(found)


@pytest.mark.parametrize("module,source,broken", [
    ("flashrt.kv.pages", "from flashrt.kernels_cuda import kv_gather\n", "flashrt.kernels_cuda.kv_gather"),
    ("flashrt.jit", "def f():\n    from .cli.jit import warmup\n", "flashrt.cli.jit"),
    ("flashrt.graphs.plan", "from flashrt.backends import trace\n", "flashrt.backends.trace"),
    ("flashrt.graphs.model", "from ..engine import generation\n", "flashrt.engine.generation"),
    ("flashrt.engine.run", "import flashrt.cli.commands\n", "flashrt.cli.commands"),
    ("flashrt.kernels_ascend.misc", "from flashrt.backends import reference as ref\n", "flashrt.backends.reference"),
    ("flashrt.kernels_cuda.linear", "from flashrt.backends.cuda import interpreted\n", "flashrt.backends.cuda"),
    ("flashrt.kernels_cuda.linear", "from flashrt.kernels_ascend import misc\n", "flashrt.kernels_ascend.misc"),
    ("flashrt.backends.cuda", "from flashrt.kernels_ascend import misc\n", "flashrt.kernels_ascend.misc"),
    ("flashrt.backends.ascend", "from flashrt.backends import reference\n", "flashrt.backends.reference"),
    ("flashrt.backends.reference", "from flashrt.kernels_cuda import quant\n", "flashrt.kernels_cuda.quant"),
])
def test_the_checker_catches_a_violation(module, source, broken):
    found = violations(source, "scratch.py", module)
    assert len(found) == 1 and found[0].startswith(f"scratch.py:{source.count(chr(10))}: imports {broken} ("), found


@pytest.mark.parametrize("module,source", [
    ("flashrt.cli.model", "from flashrt.engine.run import load_model\nfrom flashrt.backends import ascend\n"),
    ("flashrt.bench.gemm", "from flashrt.kernels_cuda import linear\n"),
    ("flashrt.engine.step_capture", "from flashrt.graphs.context import StepContext\nfrom flashrt.kv import pages\n"),
    ("flashrt.backends.cuda", "from flashrt.kernels_cuda import attention\nfrom flashrt import dispatch\n"),
    ("flashrt.kernels_cuda.moe", "from . import linear\nfrom .launch import cdiv\nfrom flashrt.formats import QTensor\n"),
    ("flashrt.kv.pages", "from .util import empty_qtensor\nfrom .. import ops\n"),
])
def test_the_checker_allows_what_the_rules_allow(module, source):
    assert violations(source, "scratch.py", module) == []


def test_relative_imports_resolve_to_their_package():
    src = "from . import util\nfrom .. import dispatch\nfrom ..graphs import model\n"
    assert imports(src, "flashrt.kv.pages", False) == [
        (1, "flashrt.kv.util"), (2, "flashrt.dispatch"), (3, "flashrt.graphs.model")]
    assert imports("from .launch import cdiv\n", "flashrt.kernels_cuda", True) == [(1, "flashrt.kernels_cuda.launch")]


def test_the_package_root_names_only_the_facade_lazily():
    import flashrt

    assert set(flashrt._FACADE) == {"load", "generate", "Engine", "SamplingParams", "backends"}
    assert {m for m, _ in flashrt._FACADE.values()} == {"flashrt.graphs.loader", "flashrt.engine.generation",
                                                        "flashrt.engine.engine", "flashrt.engine.sampling",
                                                        "flashrt.backends"}
    root = (ROOT / "core" / "__init__.py").read_text()
    assert all(layer(name) == "core" for _, name in imports(root, "flashrt", True))
