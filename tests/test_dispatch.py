"""Dispatch: resolution once per (op, device type), explicit choice, fallback, capabilities."""
import logging

import pytest
import torch

import flashrt
from flashrt import dispatch, ops
from flashrt.errors import BackendError
from flashrt.hookspecs import Backend, hookimpl


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
