"""``tiles.linear.ws_gemm``: the warp-specialized Gluon fp8 GEMM of ``linear`` (:mod:`.linear_ws`).

Without a GPU: the launcher takes it only where it fits (fp8_w, at least ``min_rows`` rows, bf16 /
fp32 x, an sm_90 target, the tile set), and it compiles for sm_90 with this machine's Triton (a
subprocess without the interpreter): within the shared-memory limit, one fp8 warpgroup MMA a trip of
its K loop (a 32-wide slice), the copies asynchronous. On an sm_90 GPU: its outputs against the
reference backend and against the plain kernel, on random activations and weights whose shapes
leave partial tiles, with the weight scales row and K major."""
from __future__ import annotations

import json

import pytest
import torch

import flashrt
from flashrt import formats, jit_targets, ops
from flashrt.jit_targets import ARCHS
from kernel_check import DEVICE, GPU, needs_ptxas, pinned_tiles, rel_err, requires_kernels, sm90_compile

pytestmark = requires_kernels
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
lws = pytest.importorskip("flashrt.kernels_cuda.linear_ws")
SM90 = GPU and torch.cuda.get_device_capability() == (9, 0)
WS = dict(ws_gemm=dict(min_rows=256))


def _fits(m, fmt, dtype, monkeypatch, arch="sm_90"):
    monkeypatch.setattr(lin, "INTERPRETED", False)
    with jit_targets.targeting(ARCHS[arch]):
        return lin._ws_gemm_fits(m, fmt, dtype)


@pytest.mark.skipif(not lws.AVAILABLE, reason="a Triton without Gluon")
def test_the_launcher_takes_it_only_where_it_fits(monkeypatch):
    with pinned_tiles(linear={}):
        assert not _fits(4096, "fp8_w", torch.bfloat16, monkeypatch)  # off by default
    with pinned_tiles(linear=WS):
        assert _fits(256, "fp8_w", torch.bfloat16, monkeypatch) and _fits(4096, "fp8_w", torch.float32, monkeypatch)
        assert not _fits(255, "fp8_w", torch.bfloat16, monkeypatch)
        assert not _fits(4096, "fp4_w", torch.bfloat16, monkeypatch)
        assert not _fits(4096, "fp8_w", torch.float16, monkeypatch)
        assert not _fits(4096, "fp8_w", torch.bfloat16, monkeypatch, "sm_89")  # warpgroup MMA: sm_90 only


@pytest.mark.skipif(not lws.AVAILABLE, reason="a Triton without Gluon")
@needs_ptxas
@pytest.mark.parametrize("ws_tiles", [{}, {"overlap": True, "maxnreg": 168}])
def test_it_compiles_for_sm90_on_fp8_warpgroup_mmas(ws_tiles):
    tiles = {"ws_gemm": {"min_rows": 1, **ws_tiles}}
    reports = sm90_compile("linear", "--B", "4096", "--S", "1", "--tiles", json.dumps(tiles))
    reports = [r for r in reports if r["kernel"] == "_fp8_ws_gemm_kernel"]
    assert len(reports) == 2  # small's two fp8_w projections
    for r in reports:
        assert r["shared_bytes"] <= ARCHS["sm_90"].smem_limit and r["stack_bytes"] == 0
        inner = min(r["mma_loop"]["loops"], key=lambda loop: loop["instructions"])
        assert inner["count"] == 1 and r["sass"]["QGMMA"] >= 1 and r["sass"]["HMMA"] == 0  # one MMA a slice
        assert r["sass"]["LDGSTS"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not (SM90 and lws.AVAILABLE), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("m,n,k", [(256, 1280, 5120), (300, 200, 96), (4096, 1024, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_match_the_reference_and_the_plain_kernel(rng, m, n, k, dtype, k_major, overlap):
    x = (torch.randn(m, k, generator=rng) * torch.logspace(-2, 2, k)).to(DEVICE, dtype)
    w = formats.quantize((torch.randn(n, k, generator=rng) * 0.2).to(DEVICE), "fp8_w")
    if k_major:  # the scales stored K major, as the experts' may be
        w = formats.QTensor(w.data, w.scale.t().contiguous().t(), w.fmt, tuple(w.shape))
    with flashrt.use_backend("reference"):
        want = ops.linear(x, w).float().cpu()
    out = {}
    ws = dict(ws_gemm=dict(WS["ws_gemm"], overlap=overlap, maxnreg=168 if overlap else 152))
    for name, tiles in (("plain", {}), ("ws", ws)):
        with flashrt.use_backend("cuda"), pinned_tiles(linear=tiles):
            assert lin._linear_plan(m, n, k, dtype, "fp8_w")["ws_gemm"] == (name == "ws")
            out[name] = ops.linear(x, w).float().cpu()
    tol = 1e-3 if dtype == torch.bfloat16 else 1e-4
    assert torch.isfinite(out["ws"]).all()
    assert rel_err(out["ws"], want) < tol and rel_err(out["ws"], out["plain"]) < tol
