"""The Ascend backend's torch_npu calls checked against the real torch_npu (the pinned wheel).

Set-up downloads the torch_npu wheel named in ``npu_schema`` once (``pip download --no-deps``, into
``$FLASHRT_CACHE_DIR/torch_npu``, else the pytest cache, else ``~/.cache/flashrt/torch_npu``) and
skips only when the package index cannot be reached. Then:

- every operator the adapters call exists in the wheel's schemas, is bound as
  ``torch_npu.X = torch.ops.npu.X`` and has a meta function;
- every emulated operator has exactly its schema's signature (names, order, keyword-only, defaults);
- every call the backend makes while running its ops (recorded by the emulation) binds to the
  schema (readable check, then torch's own parser on the schema), and the output shapes and dtypes
  the emulation returned, i.e. what the backend consumed, are those of the wheel's meta function.
"""
from __future__ import annotations

import inspect
import types
import os
import re
from pathlib import Path

import pytest
import torch

import npu_schema
from ascend_exercise import exercise_backend
from ascend_helpers import npu_emulation  # noqa: F401
from npu_schema import binding_problems, output_problems

KERNELS = Path(__file__).resolve().parents[2] / "kernels_ascend"
OPERATOR_CALL = re.compile(r'operator\(\s*[^,()]+,\s*"(npu_\w+)"\s*\)')


def _cache_dir(config) -> Path:
    root = os.environ.get("FLASHRT_CACHE_DIR")
    if root:
        return Path(root) / "torch_npu"
    cache = getattr(config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("flashrt-torch-npu"))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashrt" / "torch_npu"


REQUIRE_ENV = "FLASHRT_REQUIRE_SCHEMA_CHECK"  # CI sets it: an unreachable index fails instead of skipping


def wheel_or_skip(cache: Path) -> Path:
    try:
        return npu_schema.fetch_wheel(cache)
    except npu_schema.IndexUnreachable as exc:
        msg = f"torch_npu {npu_schema.TORCH_NPU_VERSION} schema check not run: {exc}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{msg} ({REQUIRE_ENV}=1)")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def wheel(request):
    path = wheel_or_skip(_cache_dir(request.config))
    schemas, metas = npu_schema.load_schemas(path), npu_schema.load_meta(path)
    return {"schemas": schemas, "metas": metas, "bound": npu_schema.bound_operators(path),
            "ops": npu_schema.SchemaOps(schemas, metas)}


def used_operators() -> set[str]:
    """The torch_npu operators the adapters call (each call goes through ``npu_runtime.operator``)."""
    return {m for f in KERNELS.glob("*.py") for m in OPERATOR_CALL.findall(f.read_text())}


def test_adapters_reach_torch_npu_only_through_operator():
    direct = [f.name for f in KERNELS.glob("*.py") if re.search(r"npu\(\)\.npu_", f.read_text())]
    assert not direct, f"direct torch_npu operator calls (use npu_runtime.operator(op, name)): {direct}"
    assert {"npu_rms_norm", "npu_sparse_flash_attention", "npu_moe_init_routing_v2"} <= used_operators()


def test_every_used_operator_exists_is_bound_and_has_a_meta_function(wheel):
    for name in sorted(used_operators()):
        assert name in wheel["schemas"], f"{name}: no such operator in torch_npu {npu_schema.TORCH_NPU_VERSION}"
        assert name in wheel["bound"], f"{name}: not bound as torch_npu.{name} = torch.ops.npu.{name}"
        assert name in wheel["metas"], f"{name}: the wheel has no meta function"


def _schema_params(func: str) -> list[tuple]:
    s = torch._C.parse_schema(func)
    return [(a.name, a.kwarg_only, a.default_value if a.has_default_value() else "<required>") for a in s.arguments]


def _python_params(fn) -> list[tuple]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        default = "<required>" if p.default is inspect.Parameter.empty else p.default
        out.append((p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, default))
    return out


def test_emulated_operators_have_the_schema_signatures(wheel, npu_emulation):
    assert set(npu_emulation.OPERATORS) >= used_operators()
    for name, fn in sorted(npu_emulation.OPERATORS.items()):
        default = [f for f in wheel["schemas"][name] if f.startswith(f"{name}(")]
        assert len(default) == 1, f"{name}: expected one default overload, got {wheel['schemas'][name]}"
        assert _python_params(fn) == _schema_params(default[0]), f"{name}: emulation signature != {default[0]}"


def _call_problems(wheel, call) -> list[str]:
    per_overload = [binding_problems(f, call.positional, call.keywords) for f in wheel["schemas"][call.name]]
    where = call.signature()
    if all(per_overload):  # torch's parser takes the first overload that binds: none does
        return [f"{where}: {p}" for p in per_overload[0]]
    try:
        meta = wheel["ops"].run(call.name, call.positional, call.keywords)
    except Exception as exc:  # torch's parser or the meta function's checks rejected the call
        return [f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0]}"]
    return [f"{where}: {p}" for p in output_problems(meta, call.result)]


def test_every_backend_call_matches_the_real_schema_and_meta_shapes(wheel, npu_emulation, rng):
    calls = exercise_backend(rng)
    assert {c.name for c in calls} == used_operators(), "the exercise must reach every operator the adapters call"
    problems = sorted({p for c in calls for p in _call_problems(wheel, c)})
    assert not problems, "calls that the real torch_npu would reject or shape differently:\n" + "\n".join(problems)


@pytest.mark.parametrize("positional,keywords,expect", [
    ((torch.zeros(2, 8),), {}, None),
    ((), {"x": torch.zeros(2, 8)}, "unknown argument 'x'"),  # the name the emulation used to take
    ((torch.zeros(2, 8), None), {}, "2 positional arguments"),
    ((torch.zeros(2, 8),), {"dst_type": 1.0}, "argument 'dst_type' expects Optional[int], got float"),
    ((torch.zeros(2, 8),), {"quant_mode": 0}, "argument 'quant_mode' expects str, got int"),
    ((torch.zeros(2, 8),), {"smooth_scales": [torch.zeros(8)]}, "expects Optional[Tensor], got list[Tensor]"),
])
def test_the_binding_check_catches_what_the_real_binding_rejects(wheel, positional, keywords, expect):
    func = wheel["schemas"]["npu_dynamic_quant"][0]
    problems = binding_problems(func, positional, keywords)
    if expect is None:
        assert not problems
        y, scale = wheel["ops"].run("npu_dynamic_quant", positional, keywords)
        assert (y.dtype, tuple(y.shape), scale.dtype, tuple(scale.shape)) == (torch.int8, (2, 8), torch.float32, (2,))
        return
    assert any(expect in p for p in problems), problems
    with pytest.raises(RuntimeError):  # torch's own parser on the real schema agrees
        wheel["ops"].run("npu_dynamic_quant", positional, keywords)


def test_missing_arguments_and_wrong_shapes_are_caught(wheel):
    func = wheel["schemas"]["npu_moe_finalize_routing"][0]
    rows, src = torch.zeros(6, 4), torch.zeros(6, dtype=torch.int32)
    assert any("required argument 'skip1'" in p for p in binding_problems(func, (rows,), {}))
    out = wheel["ops"].run("npu_moe_finalize_routing", (rows, None, None, None, None, src, None), {"k": 2})
    assert tuple(out.shape) == (3, 4) and not output_problems(out, torch.zeros(3, 4))
    assert output_problems(out, torch.zeros(6, 4)) and output_problems(out, torch.zeros(3, 4, dtype=torch.bfloat16))
    assert output_problems((out, out), [torch.zeros(3, 4)])


def test_the_target_version_is_one_across_backend_emulation_and_check(npu_emulation):
    from flashrt.backends import ascend

    assert ascend.TORCH_NPU_TARGET == npu_schema.TORCH_NPU_VERSION
    assert npu_emulation.__version__.split("+")[0] == npu_schema.TORCH_NPU_VERSION
    assert ascend.versions()["torch_npu_target"] == npu_schema.TORCH_NPU_VERSION


def test_fetch_skips_only_when_the_index_is_unreachable(tmp_path, monkeypatch):
    failed = types.SimpleNamespace(returncode=1, stdout="", stderr="pip: resolution failed")
    monkeypatch.setattr(npu_schema.subprocess, "run", lambda cmd, **kw: failed)
    monkeypatch.setattr(npu_schema, "_index_reachable", lambda index: "URLError: no route to host")
    with pytest.raises(npu_schema.IndexUnreachable, match="no route to host"):
        npu_schema.fetch_wheel(tmp_path)
    monkeypatch.setattr(npu_schema, "_index_reachable", lambda index: None)  # reachable: pip's failure fails
    with pytest.raises(RuntimeError, match="resolution failed"):
        npu_schema.fetch_wheel(tmp_path)

    def wrong_file(cmd, **kw):
        (Path(cmd[cmd.index("-d") + 1]) / npu_schema.WHEEL_NAME).write_bytes(b"not the pinned wheel")
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(npu_schema.subprocess, "run", wrong_file)
    with pytest.raises(RuntimeError, match="sha256"):
        npu_schema.fetch_wheel(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing half-written is left behind


def test_an_unreachable_index_skips_unless_the_check_is_required(tmp_path, monkeypatch):
    def unreachable(cache):
        raise npu_schema.IndexUnreachable("package index https://pypi.org/simple unreachable (URLError)")

    monkeypatch.setattr(npu_schema, "fetch_wheel", unreachable)
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="schema check not run: package index"):
        wheel_or_skip(tmp_path)
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=REQUIRE_ENV):
        wheel_or_skip(tmp_path)
