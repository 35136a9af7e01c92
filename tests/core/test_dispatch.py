"""Dispatch: resolution once per (op, device type), explicit choice, fallback, declared support checked
once per call key, fallbacks logged and listed by ``flashrt doctor``."""
import logging

import pytest
import torch

import flashrt
from flashrt import dispatch, ops
from flashrt.errors import BackendError
from flashrt.hookspecs import Backend, Dim, Support, hookimpl


class Plugin:
    """A run-time plugin whose rms_norm marks its output so the test can see who served it."""

    def __init__(self, name="fast", priority=50, supports=None, available=(True, ""), device_types=("cpu",)):
        self.calls = 0
        self.backend = Backend(
            name=name, device_types=device_types, priority=priority,
            ops={"rms_norm": self.rms_norm},
            supports={"rms_norm": supports} if supports else {},
            is_available=lambda: available,
        )

    def rms_norm(self, x, weight, eps):
        self.calls += 1
        return torch.full_like(x, 7.0)

    @hookimpl
    def flashrt_backend(self):
        return self.backend


def _x():
    return torch.randn(2, 3, 8), torch.ones(8)


def test_builtins_listed_with_availability():
    status = {s.name: s for s in flashrt.backends.available()}
    assert status["reference"].available and status["trace"].available
    assert set(status["reference"].ops) == set(ops.OPS)
    assert set(status["trace"].ops) == set(ops.OPS)


def test_higher_priority_plugin_serves_its_ops_only():
    plugin = Plugin()
    dispatch.register(plugin)
    x, w = _x()
    assert torch.all(ops.rms_norm(x, w, 1e-6) == 7.0)
    assert plugin.calls == 1
    # an op the plugin does not declare still goes to the reference
    assert ops.hc_collapse(torch.randn(1, 2, 4, 8), torch.rand(1, 2, 4)).shape == (1, 2, 8)
    assert dispatch.chain("rms_norm", "cpu") == ["fast", "reference"]


def test_resolution_is_cached_not_per_call():
    plugin = Plugin()
    dispatch.register(plugin)
    x, w = _x()
    ops.rms_norm(x, w, 1e-6)
    key = (None, "rms_norm", "cpu")  # resolved once per device type
    fn = dispatch._TABLE[key]
    ops.rms_norm(x, w, 1e-6)
    assert dispatch._TABLE[key] is fn and fn == plugin.rms_norm


def test_capability_predicate_falls_through_to_next_backend():
    plugin = Plugin(supports=lambda x, weight, eps: x.dtype == torch.float32)
    dispatch.register(plugin)
    x, w = _x()
    assert torch.all(ops.rms_norm(x, w, 1e-6) == 7.0)
    out = ops.rms_norm(x.double(), w.double(), 1e-6)
    assert not torch.all(out == 7.0) and plugin.calls == 1


def test_unavailable_plugin_is_skipped_and_fallback_logged_once(caplog):
    dispatch.register(Plugin(available=(False, "no such device")))
    status = {s.name: s for s in flashrt.backends.available()}
    assert not status["fast"].available and status["fast"].reason == "no such device"
    x, w = _x()
    with caplog.at_level(logging.INFO, logger="flashrt"):
        for _ in range(3):
            out = ops.rms_norm(x, w, 1e-6)
        ops.hc_collapse(torch.randn(1, 2, 4, 8), torch.rand(1, 2, 4))
    assert not torch.all(out == 7.0)
    lines = [r.getMessage() for r in caplog.records if "reference backend" in r.getMessage()]
    assert len(lines) == 1 and "fast: no such device" in lines[0]


def test_use_backend_is_honoured_and_scoped():
    plugin = Plugin(priority=-5)  # below the reference: never chosen automatically
    dispatch.register(plugin)
    x, w = _x()
    assert not torch.all(ops.rms_norm(x, w, 1e-6) == 7.0)
    with flashrt.use_backend("fast"):
        assert torch.all(ops.rms_norm(x, w, 1e-6) == 7.0)
        with pytest.raises(BackendError, match="does not serve op 'hc_collapse'"):
            ops.hc_collapse(torch.randn(1, 2, 4, 8), torch.rand(1, 2, 4))
    assert not torch.all(ops.rms_norm(x, w, 1e-6) == 7.0)


def test_use_backend_unknown_or_unavailable_lists_registered():
    with pytest.raises(BackendError, match=r"'nope' is not registered; registered backends: .*reference.*trace"):
        with flashrt.use_backend("nope"):
            pass
    dispatch.register(Plugin(available=(False, "driver missing")))
    with pytest.raises(BackendError, match="'fast' is not available: driver missing"):
        with flashrt.use_backend("fast"):
            pass


def test_env_choice(monkeypatch):
    dispatch.register(Plugin(priority=-5))
    x, w = _x()
    monkeypatch.setenv("FLASHRT_BACKEND", "fast")
    dispatch.reset_table()
    assert torch.all(ops.rms_norm(x, w, 1e-6) == 7.0)
    monkeypatch.setenv("FLASHRT_BACKEND", "missing")
    dispatch.reset_table()
    with pytest.raises(BackendError, match="'missing' is not registered"):
        ops.rms_norm(x, w, 1e-6)


def test_explicit_choice_with_unsupported_call_fails_loudly():
    dispatch.register(Plugin(priority=-5, supports=lambda x, weight, eps: False))
    x, w = _x()
    with flashrt.use_backend("fast"):
        with pytest.raises(BackendError, match=r"op 'rms_norm': no backend serves this call .*tried \['fast'\]"):
            ops.rms_norm(x, w, 1e-6)


def test_broken_plugins_are_reported_not_fatal():
    class Broken:
        @hookimpl
        def flashrt_backend(self):
            return Backend(name="broken", device_types=("cpu",), ops={"no_such_op": print})

    dispatch.register(Broken(), name="broken-plugin")
    assert "broken-plugin" in dispatch.load_errors()
    assert "broken" not in dispatch.backends()
    x, w = _x()
    assert ops.rms_norm(x, w, 1e-6).shape == x.shape


def test_validation_runs_before_any_backend():
    plugin = Plugin()
    dispatch.register(plugin)
    with pytest.raises(ValueError, match=r"weight: expected shape \[N=8\], got \(5,\)"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(5), 1e-6)
    assert plugin.calls == 0


def test_value_checks_switch():
    q = torch.randn(1, 1, 2, 8)
    kv = torch.randn(1, 4, 8)
    bad = torch.tensor([[[0, 9]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="indices: expected values in"):
        ops.sparse_attention(q, kv, bad, None, 1.0)
    with flashrt.value_checks(False):  # no value read; the reference then fails on its own
        with pytest.raises(IndexError):
            ops.sparse_attention(q, kv, bad, None, 1.0)


class Declared:
    """A plugin serving rms_norm for fp32 rows of at most 8 (declared as data), counting how often
    its extra predicate runs and how often it serves."""

    def __init__(self):
        self.checks = self.calls = 0

        def extra(x, weight, eps):
            self.checks += 1
            return True

        def rms_norm(x, weight, eps):
            self.calls += 1
            return torch.full_like(x, 7.0)

        self.backend = Backend(name="declared", device_types=("cpu",), priority=50, ops={"rms_norm": rms_norm},
                               supports={"rms_norm": Support(inputs={"x": (torch.float32,)},
                                                             dims={"x[-1]": Dim(1, 8)}, extra=extra)})

    @hookimpl
    def flashrt_backend(self):
        return self.backend


def test_declared_support_is_checked_once_per_call_key():
    plugin = Declared()
    dispatch.register(plugin)
    for _ in range(5):
        assert torch.all(ops.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6) == 7.0)
        weight64 = torch.ones(4, dtype=torch.float64)  # another weight dtype: another key (the extra runs again)
        assert torch.all(ops.rms_norm(torch.randn(2, 5, 4), weight64, 1e-6) == 7.0)
        wide = ops.rms_norm(torch.randn(3, 16), torch.ones(16), 1e-6)  # x[-1] = 16 > 8: the reference
        f64 = ops.rms_norm(torch.randn(3, 8, dtype=torch.float64), torch.ones(8), 1e-6)  # declined by dtype
    assert not torch.all(wide == 7.0) and not torch.all(f64 == 7.0)
    assert plugin.calls == 10 and plugin.checks == 2  # the extra predicate: once per served key
    ops.rms_norm(torch.randn(7, 6), torch.ones(6), 1e-6)  # other sizes in range: the same key
    assert plugin.checks == 2 and plugin.calls == 11


def test_a_fallback_is_logged_once_with_the_reason_and_listed(caplog):
    dispatch.register(Declared())
    with caplog.at_level(logging.INFO, logger="flashrt"):
        for n in (16, 16, 32):
            ops.rms_norm(torch.randn(2, n), torch.ones(n), 1e-6)
    lines = [r.getMessage() for r in caplog.records if "declines" in r.getMessage()]
    assert lines == ["flashrt: rms_norm on cpu: declared declines (x[-1] = 16: served in [1, 8]); reference serves it"]
    assert dispatch.fallbacks() == [{"op": "rms_norm", "device_type": "cpu", "declined_by": "declared",
                                     "reason": "x[-1] = 16: served in [1, 8]", "served_by": "reference", "keys": 1}]


def test_explicit_choice_names_the_reason():
    dispatch.register(Declared())
    with flashrt.use_backend("declared"), pytest.raises(BackendError, match=r"tried \['declared'\] \(declared: x: "
                                                                            r"dtype torch.float64 is not served"):
        ops.rms_norm(torch.randn(2, 4, dtype=torch.float64), torch.ones(4), 1e-6)


def test_doctor_lists_the_ops_each_backend_serves_and_the_fallbacks(capsys):
    from flashrt.cli import commands as cli

    dispatch.register(Declared())
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ops: rms_norm" in out and "fallbacks seen: none in this process" in out
    ops.rms_norm(torch.randn(2, 16), torch.ones(16), 1e-6)
    assert cli.main(["doctor"]) == 0
    assert ("rms_norm on cpu: declared declines (x[-1] = 16: served in [1, 8]); reference serves it (1 call shapes)"
            in capsys.readouterr().out)


def test_doctor_probe_runs_every_op_and_lists_what_fell_back(capsys):
    from flashrt.cli import commands as cli

    dispatch.register(Declared())  # the conformance case of rms_norm is bf16: declined by dtype
    report = cli.doctor_report(probe=True, device="cpu")
    assert report["probe"]["total"] >= len(ops.OPS) and report["probe"]["failed"] == []
    assert [(f["op"], f["declined_by"], f["served_by"]) for f in report["fallbacks"]] == [
        ("rms_norm", "declared", "reference")]
    assert "torch.bfloat16 is not served" in report["fallbacks"][0]["reason"]


def test_a_declaration_naming_unknown_arguments_is_reported_at_load():
    class Wrong:
        def __init__(self, support):
            self.support = support

        @hookimpl
        def flashrt_backend(self):
            return Backend(name="wrong", device_types=("cpu",), ops={"rms_norm": print},
                           supports={"rms_norm": self.support})

    for declared, message in ((Support(inputs={"y": (torch.float32,)}), "unknown arguments ['y']"),
                              (Support(dims={"x[": Dim(1, 8)}), "dims key 'x['"),
                              (Support(dims={"w[0]": Dim(1, 8)}), "dims key 'w[0]'")):
        plugin = Wrong(declared)
        dispatch.register(plugin, name="wrong-plugin")
        assert message in dispatch.load_errors()["wrong-plugin"] and "wrong" not in dispatch.backends()
        dispatch.unregister(plugin)
