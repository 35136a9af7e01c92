"""A third-party backend installed as a distribution with a ``flashrt.backends`` entry point."""
import sys
import textwrap

import torch

import flashrt
from flashrt import dispatch, ops

PLUGIN = textwrap.dedent(
    '''
    import torch
    from flashrt.hookspecs import Backend, hookimpl

    CALLS = []

    def hc_collapse(x, pre):
        CALLS.append("hc_collapse")
        return torch.zeros(x.shape[0], x.shape[1], x.shape[3], dtype=x.dtype)

    @hookimpl
    def flashrt_backend():
        return Backend(name="acme", device_types=("cpu",), priority=40, ops={"hc_collapse": hc_collapse},
                       description="third-party test backend")
    '''
)


def _install(tmp_path, monkeypatch, module_source: str, module="acme_flashrt"):
    """Lay out an installed distribution (module + dist-info with entry_points.txt) on sys.path."""
    (tmp_path / f"{module}.py").write_text(module_source)
    info = tmp_path / "acme_flashrt-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-flashrt\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[flashrt.backends]\nacme = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    dispatch.reload()


def test_entry_point_backend_is_found_and_used_for_its_ops(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, PLUGIN)
    names = {s.name: s for s in flashrt.backends.available()}
    assert "acme" in names and names["acme"].ops == ("hc_collapse",) and names["acme"].available
    x, pre = torch.randn(2, 3, 4, 8), torch.rand(2, 3, 4)
    out = ops.hc_collapse(x, pre)
    assert torch.count_nonzero(out) == 0  # the plugin's answer, not the reference's
    assert sys.modules["acme_flashrt"].CALLS == ["hc_collapse"]
    # ops it does not declare still run on the reference
    y = ops.rms_norm(x, torch.ones(8), 1e-6)
    assert torch.allclose(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-6)
    with flashrt.use_backend("acme"):
        assert torch.count_nonzero(ops.hc_collapse(x, pre)) == 0


def test_entry_point_that_fails_to_import_is_reported(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "raise ImportError('needs libacme.so')\n", module="acme_broken")
    errors = dispatch.load_errors()
    assert "acme" in errors and "needs libacme.so" in errors["acme"]
    assert "acme" not in dispatch.backends()
    assert ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6).shape == (2, 8)
